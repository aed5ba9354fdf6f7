"""The messages, JSON wire format and async API of nmt-incremental.

Pure Python, standard library only: a client, a proxy or a speech pipeline can depend on it
without pulling in the engine's numerical stack.
"""

from protocol.api import EngineClosed, InvalidEvent, NmtIncremental
from protocol.codec import (
    FROM_ENGINE_TYPES,
    MAX_MESSAGE_BYTES,
    MAX_TEXT_CHARS,
    MESSAGE_TYPES,
    TO_ENGINE_TYPES,
    load_schema,
    parse,
    schema_path,
    serialize,
)
from protocol.messages import (
    ERROR_CODES,
    MAX_FIELD_NAME_CHARS,
    MAX_ID,
    MAX_LANG_CHARS,
    MAX_SAMPLE_RATE,
    MAX_STREAM_ID_CHARS,
    MIN_SAMPLE_RATE,
    CloseStream,
    EndAudio,
    ErrorCode,
    ErrorMessage,
    InvalidMessage,
    Message,
    PartialTranscript,
    StartAudio,
    Subscribe,
    TranslationUpdate,
)
from protocol.writer import Backoff, FinalLedger, Outcome, Received

__all__ = [
    "ERROR_CODES",
    "FROM_ENGINE_TYPES",
    "MAX_FIELD_NAME_CHARS",
    "MAX_ID",
    "MAX_LANG_CHARS",
    "MAX_MESSAGE_BYTES",
    "MAX_SAMPLE_RATE",
    "MAX_STREAM_ID_CHARS",
    "MAX_TEXT_CHARS",
    "MESSAGE_TYPES",
    "MIN_SAMPLE_RATE",
    "TO_ENGINE_TYPES",
    "Backoff",
    "CloseStream",
    "EndAudio",
    "EngineClosed",
    "ErrorCode",
    "ErrorMessage",
    "FinalLedger",
    "InvalidEvent",
    "InvalidMessage",
    "Message",
    "NmtIncremental",
    "Outcome",
    "PartialTranscript",
    "Received",
    "StartAudio",
    "Subscribe",
    "TranslationUpdate",
    "load_schema",
    "parse",
    "schema_path",
    "serialize",
]
