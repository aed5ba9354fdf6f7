"""Incremental translation of partial transcripts: sans-I/O session + async controller."""

from engine.streaming.controller import IncrementalTranslator, Subscription
from engine.streaming.policies import BiasedDecoding, LocalAgreement, MaskK, Policy, parse_policy
from engine.streaming.session import (
    EventGate,
    StreamingOptions,
    StreamSession,
    normalize_source,
)

__all__ = [
    "BiasedDecoding",
    "EventGate",
    "IncrementalTranslator",
    "LocalAgreement",
    "MaskK",
    "Policy",
    "StreamSession",
    "StreamingOptions",
    "Subscription",
    "normalize_source",
    "parse_policy",
]
