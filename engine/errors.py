"""Exceptions the engine raises on purpose, so callers can tell bad input from bugs."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises deliberately."""


class ModelLoadError(EngineError):
    """A model directory is missing files, holds corrupt files or an unknown export."""


class InputTooLongError(EngineError, ValueError):
    """A source is longer than the model's position embeddings allow."""

    def __init__(self, n_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"source is {n_tokens} tokens long but the model accepts at most {max_tokens} "
            "(split the text into sentences, or use Translator.translate_long)"
        )
        self.n_tokens = n_tokens
        self.max_tokens = max_tokens
