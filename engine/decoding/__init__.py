"""Decoding: searches as per-request state, batches, one scheduler per model, `Translator`."""

from engine.decoding.search import (
    DecodeOptions,
    DecodingCancelled,
    Hypothesis,
    StepHook,
)

__all__ = ["DecodeOptions", "DecodingCancelled", "Hypothesis", "StepHook"]
