"""The JSON wire format: one JSON object per message, tagged by a `type` field.

Sans-I/O in the manner of h11: `serialize` and `parse` turn messages into text and back and
never touch a socket, so the WebSocket server, the replay tool and tests share one codec.
`parse` never raises for bad input: whatever arrives, it returns either a message or an
`ErrorMessage` that the server can send straight back, naming the field at fault.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from protocol.messages import (
    MAX_FIELD_NAME_CHARS,
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
    TooLarge,
    TranslationUpdate,
    _check_count,
    _check_name,
    _check_stream_id,
)

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

MAX_MESSAGE_BYTES = 64 * 1024
"""Default limit on one encoded message, in UTF-8 bytes."""

MAX_TEXT_CHARS = 4096
"""Default limit on each free-text field, in characters (code points)."""

MESSAGE_TYPES: Mapping[str, type[Message]] = MappingProxyType(
    {
        "partial_transcript": PartialTranscript,
        "translation_update": TranslationUpdate,
        "error": ErrorMessage,
        "subscribe": Subscribe,
        "close_stream": CloseStream,
        "start_audio": StartAudio,
        "end_audio": EndAudio,
        "set_glossary": SetGlossary,
        "glossary_set": GlossarySet,
    }
)
"""Wire `type` tag -> message class."""

TO_ENGINE_TYPES: frozenset[str] = frozenset(
    {
        "partial_transcript",
        "subscribe",
        "close_stream",
        "start_audio",
        "end_audio",
        "set_glossary",
    }
)
"""What a client may send; pass as `parse(..., accept=...)` on the engine side so that any
`ErrorMessage` returned is a decoding failure, not an echoed "error" message. (After
`start_audio`, a writer also sends binary frames of PCM, which are not messages.)"""

FROM_ENGINE_TYPES: frozenset[str] = frozenset({"translation_update", "error", "glossary_set"})
"""What the engine sends (`glossary_set` only to a writer that sent `set_glossary`). A
writer streaming audio (`start_audio`) also gets what the server heard, as
`partial_transcript` messages: it parses with
`accept=FROM_ENGINE_TYPES | {"partial_transcript"}`."""

SCHEMA_RESOURCE = "wire.schema.json"

_TYPE_NAMES: dict[type, str] = {cls: name for name, cls in MESSAGE_TYPES.items()}

_Kind = Literal["string", "integer", "boolean", "number"]

# JSON kind of every field name; names mean the same thing in every message type.
_KINDS: dict[str, _Kind] = {
    "stream_id": "string",
    "segment_id": "integer",
    "seq": "integer",
    "text": "string",
    "is_final": "boolean",
    "start_ms": "number",
    "end_ms": "number",
    "stable_chars": "integer",
    "stable_text": "string",
    "unstable_text": "string",
    "latency_ms": "number",
    "compute_ms": "number",
    "revised": "boolean",
    "source_text": "string",
    "epoch": "integer",
    "code": "string",
    "message": "string",
    "field": "string",
    "lang": "string",
    "cursor": "string",
    "after": "string",
    "sample_rate": "integer",
    "glossary": "string",
    "entries": "integer",
}

# Free text, bounded by max_text_chars (identifiers have fixed limits in messages.py).
_TEXT_FIELDS = frozenset({"text", "stable_text", "unstable_text", "source_text", "message"})


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kind: _Kind
    required: bool
    nullable: bool  # an optional field whose default is None also accepts JSON null
    text: bool


def _wire_fields(cls: type[Message]) -> tuple[_Field, ...]:
    return tuple(
        _Field(
            name=f.name,
            kind=_KINDS[f.name],
            required=f.default is dataclasses.MISSING,
            nullable=f.default is None,
            text=f.name in _TEXT_FIELDS,
        )
        for f in dataclasses.fields(cls)
    )


_SPECS: dict[str, tuple[_Field, ...]] = {
    name: _wire_fields(cls) for name, cls in MESSAGE_TYPES.items()
}

_NAMES: dict[str, frozenset[str]] = {
    name: frozenset(field.name for field in spec) for name, spec in _SPECS.items()
}
"""Each message type's field names, for the unknown-field check."""

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
"""One encoder for every message (`json.dumps` with options builds one per call)."""


def schema_path() -> Traversable:
    """Locate `wire.schema.json` inside the installed package (zip-safe)."""
    from importlib.resources import files

    return files(__package__ or "protocol").joinpath(SCHEMA_RESOURCE)


def load_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the wire format, for non-Python clients and tests."""
    schema: dict[str, Any] = json.loads(schema_path().read_text(encoding="utf-8"))
    return schema


# --- encoding ---------------------------------------------------------------------------


def serialize(message: Message) -> str:
    """One compact JSON object, `type` first; optional fields that are None are left out."""
    name = _TYPE_NAMES.get(type(message))
    if name is None:
        raise TypeError(f"not a protocol message: {type(message).__name__}")
    obj: dict[str, object] = {"type": name}
    for field in _SPECS[name]:
        value = getattr(message, field.name)
        if value is not None:
            obj[field.name] = value
    return _ENCODER.encode(obj)


# --- decoding ---------------------------------------------------------------------------


class _Reject(Exception):
    """Internal: unwinds decoding to return `error` instead."""

    def __init__(self, error: ErrorMessage) -> None:
        super().__init__(error.message)
        self.error = error


class _NonFinite:
    """Stands in for the NaN/Infinity literals Python's json accepts but JSON does not, so the
    field holding one is reported by name instead of the whole message as malformed."""

    __slots__ = ("literal",)

    def __init__(self, literal: str) -> None:
        self.literal = literal


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Python keeps the last of repeated keys, other parsers the first: refuse rather than
    # let the engine and a validating proxy read two different messages.
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_object, parse_constant=_NonFinite)


def _describe(value: object) -> str:
    """Name a JSON value in JSON's own terms, briefly (it may be hostile and huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        digits = str(value) if abs(value) < 10**30 else "with more than 30 digits"
        return f"integer {digits}"
    if isinstance(value, float):
        return f"number {value!r}"
    if isinstance(value, _NonFinite):
        return value.literal
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _quote(name: str) -> str:
    """A client-supplied name, shortened and escaped so it is safe inside a message."""
    return repr(name if len(name) <= 64 else name[:64] + "…")


def _safe_field(name: str) -> str | None:
    """`name` if it can be reported as `ErrorMessage.field`, else None (it is still quoted in
    the message)."""
    try:
        _check_name("field", name, MAX_FIELD_NAME_CHARS)
    except InvalidMessage:
        return None
    return name


_KIND_WORDS: dict[_Kind, str] = {
    "string": "a string",
    "integer": "an integer",
    "boolean": "a boolean",
    "number": "a finite number",
}


def _has_kind(value: object, kind: _Kind) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):  # JSON true/false is never a number
        return False
    if kind == "integer":
        return isinstance(value, int)  # 3.0 is refused: an id is never a float
    return isinstance(value, (int, float))


def parse(
    data: str | bytes | bytearray | memoryview,
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_text_chars: int = MAX_TEXT_CHARS,
    accept: Collection[str] | None = None,
) -> Message:
    """Parse one wire message; never raises for bad input.

    Returns the message, or an `ErrorMessage` describing why `data` was refused: its `field`
    names the offending field and it carries `stream_id`/`seq` when those could be read.
    `accept` restricts the `type`s allowed (e.g. `TO_ENGINE_TYPES` on the engine side).
    """
    if max_bytes < 1 or max_text_chars < 0:
        raise ValueError("max_bytes must be positive and max_text_chars non-negative")
    known = accept is TO_ENGINE_TYPES or accept is FROM_ENGINE_TYPES  # checked once
    if accept is not None and not known and not set(accept) <= MESSAGE_TYPES.keys():
        unknown = sorted(set(accept) - MESSAGE_TYPES.keys())
        raise ValueError(f"unknown message types in accept: {unknown}")
    try:
        return _decode(data, max_bytes, max_text_chars, accept)
    except _Reject as reject:
        return reject.error


def _reject(
    code: ErrorCode,
    message: str,
    field: str | None = None,
    context: tuple[str | None, int | None] = (None, None),
) -> _Reject:
    return _Reject(ErrorMessage(code.value, message, field, context[0], context[1]))


def _decode(
    data: str | bytes | bytearray | memoryview,
    max_bytes: int,
    max_text_chars: int,
    accept: Collection[str] | None,
) -> Message:
    text = _text_of(data, max_bytes)
    try:
        obj = _DECODER.decode(text)
    except _DuplicateKey as dup:
        raise _reject(
            ErrorCode.INVALID_MESSAGE, f"duplicate field {_quote(dup.key)}", _safe_field(dup.key)
        ) from None
    except RecursionError:
        raise _reject(ErrorCode.INVALID_JSON, "malformed JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer with too many digits
        raise _reject(ErrorCode.INVALID_JSON, f"malformed JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _reject(
            ErrorCode.INVALID_MESSAGE, f"a message must be a JSON object, got {_describe(obj)}"
        )

    context = _context(obj)
    type_name = _type_of(obj, accept, context)
    spec = _SPECS[type_name]
    known = _NAMES[type_name]
    for key in obj:
        if key != "type" and key not in known:
            raise _reject(
                ErrorCode.INVALID_MESSAGE,
                f"unknown field {_quote(key)} in a {type_name} message",
                _safe_field(key),
                context,
            )

    kwargs: dict[str, Any] = {}
    for field in spec:
        if field.name not in obj:
            if field.required:
                raise _reject(
                    ErrorCode.INVALID_MESSAGE,
                    f"missing field {field.name!r} in a {type_name} message",
                    field.name,
                    context,
                )
            continue
        value = obj[field.name]
        if value is None and field.nullable:
            continue
        if not _has_kind(value, field.kind):
            raise _reject(
                ErrorCode.INVALID_MESSAGE,
                f"{field.name} must be {_KIND_WORDS[field.kind]}, got {_describe(value)}",
                field.name,
                context,
            )
        if field.text and len(value) > max_text_chars:
            raise _reject(
                ErrorCode.TOO_LARGE,
                f"{field.name} is {len(value)} characters long; the limit is {max_text_chars}",
                field.name,
                context,
            )
        kwargs[field.name] = value

    try:
        return MESSAGE_TYPES[type_name](**kwargs)
    except TooLarge as exc:
        raise _reject(ErrorCode.TOO_LARGE, exc.message, exc.field, context) from None
    except InvalidMessage as exc:
        raise _reject(ErrorCode.INVALID_MESSAGE, exc.message, exc.field, context) from None


def _text_of(data: str | bytes | bytearray | memoryview, max_bytes: int) -> str:
    if isinstance(data, str):
        # Each character takes 1 to 4 bytes: encode only when the length alone cannot tell.
        if len(data) > max_bytes or (
            len(data) * 4 > max_bytes and len(data.encode("utf-8", "surrogatepass")) > max_bytes
        ):
            raise _too_large(max_bytes)
        return data
    if isinstance(data, memoryview):
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"parse() takes str or bytes, not {type(data).__name__}")
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _reject(
            ErrorCode.INVALID_JSON, f"message is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None


def _too_large(max_bytes: int) -> _Reject:
    return _reject(ErrorCode.TOO_LARGE, f"message exceeds the limit of {max_bytes} bytes")


def _context(obj: dict[str, Any]) -> tuple[str | None, int | None]:
    """The message's stream_id and seq if they are valid, so an error can be routed."""
    # Plain `try`s: two `contextlib.suppress` blocks were a third of this, every message.
    stream_id: str | None
    seq: int | None
    try:
        stream_id = _check_stream_id(obj.get("stream_id"))
    except InvalidMessage:
        stream_id = None
    try:
        seq = _check_count("seq", obj.get("seq"))
    except InvalidMessage:
        seq = None
    return stream_id, seq


def _type_of(
    obj: dict[str, Any], accept: Collection[str] | None, context: tuple[str | None, int | None]
) -> str:
    if "type" not in obj:
        raise _reject(ErrorCode.INVALID_MESSAGE, "missing field 'type'", "type", context)
    type_name = obj["type"]
    if not isinstance(type_name, str):
        raise _reject(
            ErrorCode.INVALID_MESSAGE,
            f"type must be a string, got {_describe(type_name)}",
            "type",
            context,
        )
    if type_name not in MESSAGE_TYPES:
        raise _reject(
            ErrorCode.UNKNOWN_TYPE,
            f"unknown message type {_quote(type_name)}; expected one of "
            + ", ".join(MESSAGE_TYPES),
            "type",
            context,
        )
    if accept is not None and type_name not in accept:
        raise _reject(
            ErrorCode.INVALID_MESSAGE,
            f"{type_name} messages are not accepted here; expected one of "
            + ", ".join(sorted(accept)),
            "type",
            context,
        )
    return type_name
