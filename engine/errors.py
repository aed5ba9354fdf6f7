"""Exceptions the engine raises on purpose, so callers can tell bad input from bugs; and
`unwrapped`, which takes the one failure out of a task group's exception group."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

if sys.version_info < (3, 11):  # pragma: no cover (anyio brings the backport there)
    from exceptiongroup import BaseExceptionGroup


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


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """Every exception inside a (nested) exception group."""
    found: list[BaseException] = []
    for exc in group.exceptions:
        found += leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return found


@contextlib.contextmanager
def unwrapped() -> Iterator[None]:
    """Task groups wrap what their body raises in an exception group; a command or a
    bridge fails for one reason at a time, which is raised as itself, so that it is
    handled by its type (a user's mistake printed in one line, not a group's traceback).
    Several failures stay a group."""
    try:
        yield
    except BaseExceptionGroup as group:
        found = leaves(group)
        if len(found) == 1:
            raise found[0] from None
        raise
