"""The messages, JSON wire format and async API of nmt-incremental.

Pure Python, standard library only: a client, a proxy or a speech pipeline can depend on it
without pulling in the engine's numerical stack.

Exported here is what a user of the protocol needs: the messages, `parse` and `serialize`,
the errors, the `NmtIncremental` API and the writer's helpers (`protocol/writer.py`). The
limits, the message-type tables and the JSON Schema stay in their modules
(`protocol.messages`, `protocol.codec`).
"""

from protocol.api import EngineClosed, InvalidEvent, NmtIncremental
from protocol.codec import parse, serialize
from protocol.messages import (
    CloseStream,
    EndAudio,
    ErrorCode,
    ErrorMessage,
    GlossarySet,
    InvalidMessage,
    Message,
    PartialTranscript,
    SetGlossary,
    StartAudio,
    Subscribe,
    TranslationUpdate,
)
from protocol.writer import Backoff, FinalLedger, Outcome, Pacer, Received

__all__ = [
    "Backoff",
    "CloseStream",
    "EndAudio",
    "EngineClosed",
    "ErrorCode",
    "ErrorMessage",
    "FinalLedger",
    "GlossarySet",
    "InvalidEvent",
    "InvalidMessage",
    "Message",
    "NmtIncremental",
    "Outcome",
    "Pacer",
    "PartialTranscript",
    "Received",
    "SetGlossary",
    "StartAudio",
    "Subscribe",
    "TranslationUpdate",
    "parse",
    "serialize",
]
