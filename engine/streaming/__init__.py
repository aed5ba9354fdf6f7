"""Incremental translation of partial transcripts: sans-I/O session + async controller."""

from engine.streaming.controller import IncrementalTranslator, Subscription
from engine.streaming.lifecycle import Owner, Phase, StreamTable
from engine.streaming.policies import (
    BiasedDecoding,
    FirstWord,
    LocalAgreement,
    MaskK,
    Policy,
    parse_policy,
)
from engine.streaming.session import (
    StreamingOptions,
    StreamSession,
    normalize_source,
)

__all__ = [
    "BiasedDecoding",
    "FirstWord",
    "IncrementalTranslator",
    "LocalAgreement",
    "MaskK",
    "Owner",
    "Phase",
    "Policy",
    "StreamSession",
    "StreamTable",
    "StreamingOptions",
    "Subscription",
    "normalize_source",
    "parse_policy",
]
