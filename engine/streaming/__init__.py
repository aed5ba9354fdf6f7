"""Incremental translation of partial transcripts: the layer between decoding and I/O.

`lifecycle` decides each stream's life (admission, ownership, closing) in one table,
`session` translates one stream's events (sans I/O), `policies` choose what becomes
stable, `controller` runs many streams at once (`IncrementalTranslator`), `bus` records
their replies and hands out each stream's life (`UpdateBus`), and `fanout` carries the
replies to this process's writers and viewers (`Subscription`).
"""

from engine.streaming.bus import InProcessBus, UpdateBus
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.lifecycle import EnginePhase, Owner, Phase, StreamTable
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
from engine.streaming.subscriptions import Subscription

__all__ = [
    "BiasedDecoding",
    "EnginePhase",
    "FirstWord",
    "InProcessBus",
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
    "UpdateBus",
    "normalize_source",
    "parse_policy",
]
