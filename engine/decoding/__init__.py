"""Decoding: searches as per-request state, batches, one scheduler per model (a policy
and the engine running it), `Translator`."""

from engine.decoding.policy import Priority, RequestId, new_request_id
from engine.decoding.search import (
    DecodeOptions,
    DecodingCancelled,
    Hypothesis,
    StepHook,
)

__all__ = [
    "DecodeOptions",
    "DecodingCancelled",
    "Hypothesis",
    "Priority",
    "RequestId",
    "StepHook",
    "new_request_id",
]
