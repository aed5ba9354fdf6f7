"""The messages exchanged with the engine, as frozen dataclasses that validate themselves.

Validation lives here rather than in the codec so that an embedding pipeline, which never
touches JSON, gets the same guarantees as a WebSocket client: a message object that exists is
a valid message. Every failure raises `InvalidMessage` naming the offending field.
"""

from __future__ import annotations

import math
import operator
import re
import unicodedata
from dataclasses import dataclass, fields
from enum import Enum
from typing import TypeAlias

MAX_ID = 2**53 - 1
"""Largest `segment_id`, `seq` and millisecond value: the largest integer a JavaScript
client can hold exactly, so browsers never see two different ids collapse into one."""

MAX_STREAM_ID_CHARS = 128
MAX_FIELD_NAME_CHARS = 128
MAX_LANG_CHARS = 35

MAX_GLOSSARY_BYTES = 32 * 1024
"""Largest `SetGlossary.glossary`, in UTF-8 bytes: a stream's own terms (a talk's names),
not a terminology database (that is the server's `--glossary`)."""
MAX_GLOSSARY_ENTRIES = 1000
"""Most entries (lines other than the header, blank lines and comments) a
`SetGlossary` holds."""

MIN_SAMPLE_RATE = 8000
"""Lowest audio rate `StartAudio` takes: telephone audio; below it speech loses the band a
recognizer needs, so a lower rate is a mistake rather than audio."""
MAX_SAMPLE_RATE = 192_000
"""Highest audio rate `StartAudio` takes (studio audio); past it a rate is a mistake (bytes
per second, or a stereo rate counted twice). The engine's recognizer seam
(`engine.asr.audio`) takes the same range; a test checks the two agree."""

_LANG = re.compile(r"[A-Za-z]{2,8}(?:[_-][A-Za-z0-9]{1,8})*")
"""A language tag as models and browsers write them ("zh", "de", "zh-Hans", "cmn_Hans"):
letters, then subtags joined by "-" or "_". Deliberately not full BCP 47: the engine keys
languages by their base code, and `wire.schema.json` states the same pattern (a test
checks the two agree)."""

_UNPRINTABLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\xa0\xad\u034f\u0600-\u0605\u061c\u06dd\u070f\u08e2\u115f-\u1160\u17b4-\u17b5\u180b-\u180f\u2000-\u200f\u2028-\u202f\u205f-\u206f\u3000\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff9-\ufffb]"
)
"""Characters an identifier may not contain: C0/C1 controls; line and paragraph separators
and bidirectional controls (they break or spoof a log line); and characters that show as
nothing or as a plain space (zero-width spaces and joiners, direction marks, soft hyphen,
variation selectors, fillers, spaces other than U+0020), with which two ids that look the
same could name different streams. Deliberately not `str.isprintable()` or a Unicode
category, whose answers depend on the Python version's Unicode database: this set is fixed
and is expressed exactly in `wire.schema.json` (a test checks the two agree)."""


class InvalidMessage(ValueError):
    """A message field holds a value the protocol does not allow; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return self.message


class TooLarge(InvalidMessage):
    """A field past one of the protocol's size limits (the wire code `too_large`)."""


class ErrorCode(str, Enum):
    """The fixed set of error codes; clients switch on these, so they never change meaning."""

    INVALID_JSON = "invalid_json"
    INVALID_MESSAGE = "invalid_message"
    UNKNOWN_TYPE = "unknown_type"
    TOO_LARGE = "too_large"
    UNKNOWN_STREAM = "unknown_stream"
    OUT_OF_ORDER = "out_of_order"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    RATE_LIMITED = "rate_limited"
    LIMIT_EXCEEDED = "limit_exceeded"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"  # shutting down: refused, or accepted but not translated in time

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:
        # Enum hashes by member name; hash by value so that, like equality, a code and its
        # string are interchangeable (e.g. as dict keys).
        return hash(self.value)


ERROR_CODES: frozenset[str] = frozenset(code.value for code in ErrorCode)


# --- field checks -----------------------------------------------------------------------


def _type_name(value: object) -> str:
    return type(value).__name__


def _check_str(field: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidMessage(field, f"{field} must be a string, got {_type_name(value)}")
    if value.isascii():  # a flag of the string's, read at once: nothing to encode
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates (e.g. from a JSON "\ud800" escape) cannot be sent on as UTF-8.
        raise InvalidMessage(field, f"{field} contains a lone surrogate") from None
    return value


def _check_optional_str(field: str, value: object) -> str | None:
    return None if value is None else _check_str(field, value)


def _check_name(field: str, value: object, max_chars: int) -> str:
    text = _check_str(field, value)
    if not text:
        raise InvalidMessage(field, f"{field} must not be empty")
    if len(text) > max_chars:
        raise InvalidMessage(
            field, f"{field} is {len(text)} characters long; the limit is {max_chars}"
        )
    bad = _UNPRINTABLE.search(text)
    if bad is not None:
        raise InvalidMessage(
            field, f"{field} contains the unprintable character U+{ord(bad.group()):04X}"
        )
    return text


def _check_stream_id(value: object, field: str = "stream_id") -> str:
    """A valid stream id, in NFC: "é" typed as one code point or as "e" + combining accent
    names the same stream (look-alike ids must not name two streams)."""
    text = _check_name(field, value, MAX_STREAM_ID_CHARS)
    return text if text.isascii() else unicodedata.normalize("NFC", text)  # ASCII is NFC


def _check_optional_lang(value: object) -> str | None:
    if value is None:
        return None
    text = _check_str("lang", value)
    if len(text) > MAX_LANG_CHARS or not _LANG.fullmatch(text):
        raise InvalidMessage(
            "lang", f"lang must be a language tag such as 'de' or 'zh-Hans', got {text[:40]!r}"
        )
    return text


_CURSOR = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


def _check_optional_cursor(field: str, value: object) -> str | None:
    """A place in a stream's history of updates: `MS-N` (two decimal numbers), as the
    server numbers them (a Redis Stream entry id, or a count on a server without one)."""
    if value is None:
        return None
    text = _check_str(field, value)
    if not _CURSOR.fullmatch(text):
        raise InvalidMessage(
            field, f"{field} must be a cursor such as '1732451234567-0', got {text[:40]!r}"
        )
    return text


def _check_count(field: str, value: object) -> int:
    # bool is an int subclass; True as a sequence number is always a client bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidMessage(field, f"{field} must be an integer, got {_type_name(value)}")
    if not 0 <= value <= MAX_ID:
        raise InvalidMessage(field, f"{field} must be between 0 and {MAX_ID}, got {value}")
    return value


def _check_rate(field: str, value: object) -> int:
    rate = _check_count(field, value)
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise InvalidMessage(
            field,
            f"{field} must be between {MIN_SAMPLE_RATE} and {MAX_SAMPLE_RATE} Hz, got {rate}: "
            "the rate of 16-bit mono PCM (not bytes per second, not a stereo rate)",
        )
    return rate


def _check_bool(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidMessage(field, f"{field} must be a boolean, got {_type_name(value)}")
    return value


def _check_ms(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidMessage(field, f"{field} must be a number, got {_type_name(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidMessage(field, f"{field} must be a finite number, got {value}")
    if not 0 <= value <= MAX_ID:
        raise InvalidMessage(field, f"{field} must be between 0 and {MAX_ID}, got {value}")
    return float(value)


def _check_optional_ms(field: str, value: object) -> float | None:
    return None if value is None else _check_ms(field, value)


def _set(obj: object, name: str, value: object) -> None:
    """Store a normalised value on a frozen instance (only ever called from __post_init__)."""
    object.__setattr__(obj, name, value)


# --- messages ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PartialTranscript:
    """One ASR hypothesis for a segment: the whole transcript so far, not a delta.

    Sending the whole text makes every event self-contained, so the engine may skip stale
    partials (latest wins) without losing words. `seq` increases per stream; a new
    `segment_id` starts a new sentence. `text` may be empty only while not final.

    `stable_chars`: optional, from recognisers that know which part of their hypothesis
    they will not change (whisper_streaming's committed text, WhisperLiveKit's
    confirmed/buffer split): the number of leading characters (code points) of `text`
    that are settled. The engine then commits translation only as far as that settled
    source supports it. Absent (None): the engine judges stability on its own. A count
    past the end of `text` is taken as the whole text (it is clamped, never refused): a
    recogniser counting UTF-16 units or bytes overshoots on every emoji or non-ASCII
    character, and an optional hint must not cost the transcript.
    """

    stream_id: str
    segment_id: int
    seq: int
    text: str
    is_final: bool
    start_ms: float | None = None
    end_ms: float | None = None
    stable_chars: int | None = None

    def __post_init__(self) -> None:
        _set(self, "stream_id", _check_stream_id(self.stream_id))
        _check_count("segment_id", self.segment_id)
        _check_count("seq", self.seq)
        _check_str("text", self.text)
        _check_bool("is_final", self.is_final)
        if self.is_final and not self.text:
            raise InvalidMessage("text", "text must not be empty in a final transcript")
        start = _check_optional_ms("start_ms", self.start_ms)
        end = _check_optional_ms("end_ms", self.end_ms)
        if start is not None and end is not None and end < start:
            raise InvalidMessage("end_ms", f"end_ms ({end}) is before start_ms ({start})")
        _set(self, "start_ms", start)
        _set(self, "end_ms", end)
        if self.stable_chars is not None:
            stable = _check_count("stable_chars", self.stable_chars)
            _set(self, "stable_chars", min(stable, len(self.text)))


@dataclass(frozen=True, slots=True)
class TranslationUpdate:
    """The translation of one transcript `seq`: a committed part and a tentative tail.

    `stable_text` only grows within a segment, so a display can append it; `unstable_text`
    may change with every update. A final update has everything stable. `revised` flags the
    one exception: a final whose text does not extend what was shown, so the display must
    replace the line instead of appending. `latency_ms` runs from the partial's arrival at
    the engine to this update; `compute_ms` is the encoder and decoder time spent on it.
    `epoch` numbers the stream's life: it changes when the id is opened anew (closed and
    reopened, or taken over by another writer after its first one left), so a viewer can
    tell a new stream under the same id from the old one going on. `start_ms`/`end_ms` are
    the audio span of the transcript it answers, when the recogniser gave one (subtitle
    cues are timed by them). `lang` is the target language of the translation: one
    source stream may be translated into several languages at once (fan-out), and the
    guarantees above hold per stream, segment and language. None only in messages from
    engines that predate fan-out. `cursor` is the update's place in its stream's history
    (per language): a viewer that reconnects, to any server node, sends the last one it
    got as `Subscribe.after` and receives exactly what it missed. None on updates that
    were never published to viewers (an embedded engine's, before the bus numbers them).
    """

    stream_id: str
    segment_id: int
    seq: int
    stable_text: str
    unstable_text: str
    is_final: bool
    latency_ms: float
    compute_ms: float
    revised: bool = False
    source_text: str | None = None
    epoch: int | None = None
    start_ms: float | None = None
    end_ms: float | None = None
    lang: str | None = None
    cursor: str | None = None

    def __post_init__(self) -> None:
        _set(self, "stream_id", _check_stream_id(self.stream_id))
        _check_optional_lang(self.lang)
        _check_optional_cursor("cursor", self.cursor)
        _check_count("segment_id", self.segment_id)
        _check_count("seq", self.seq)
        if self.epoch is not None:
            _check_count("epoch", self.epoch)
        _set(self, "start_ms", _check_optional_ms("start_ms", self.start_ms))
        _set(self, "end_ms", _check_optional_ms("end_ms", self.end_ms))
        _check_str("stable_text", self.stable_text)
        _check_str("unstable_text", self.unstable_text)
        _check_bool("is_final", self.is_final)
        _set(self, "latency_ms", _check_ms("latency_ms", self.latency_ms))
        _set(self, "compute_ms", _check_ms("compute_ms", self.compute_ms))
        _check_bool("revised", self.revised)
        _check_optional_str("source_text", self.source_text)
        if self.is_final and self.unstable_text:
            raise InvalidMessage("unstable_text", "unstable_text must be empty in a final update")
        if self.revised and not self.is_final:
            raise InvalidMessage("revised", "revised may only be true in a final update")

    @property
    def text(self) -> str:
        """The whole translation to display: stable part then tentative tail."""
        return self.stable_text + self.unstable_text

    def with_cursor(self, cursor: str | None) -> TranslationUpdate:
        """This update carrying `cursor` (the bus numbers an update as it publishes it):
        only the cursor is checked, the rest was when this one was made, where
        `dataclasses.replace` checks every field again (5 us against 1.7 here, once per
        update published)."""
        cursor = _check_optional_cursor("cursor", cursor)
        stamped = object.__new__(TranslationUpdate)
        # Every other field read in one call, each stored by its slot's own descriptor
        # (which a frozen class's `__setattr__` does not guard).
        for store, value in zip(_UPDATE_STORES, _UPDATE_VALUES(self), strict=True):
            store(stamped, value)
        _UPDATE_CURSOR(stamped, cursor)
        return stamped


_UPDATE_FIELDS = tuple(f.name for f in fields(TranslationUpdate) if f.name != "cursor")
_UPDATE_VALUES = operator.attrgetter(*_UPDATE_FIELDS)
_UPDATE_STORES = tuple(getattr(TranslationUpdate, name).__set__ for name in _UPDATE_FIELDS)
_UPDATE_CURSOR = getattr(TranslationUpdate, "cursor").__set__  # noqa: B009 (a slot's descriptor)


@dataclass(frozen=True, slots=True)
class ErrorMessage:
    """A refusal sent instead of a result; the stream it names carries on.

    `code` is one of `ErrorCode` (stored as its plain string so it compares, hashes and
    serialises like one); `field`, `stream_id` and `seq` locate the problem when known.
    `lang`: the error is about that target language only (translating a final into it
    failed, or a shutdown cut it off), so it answers the final for that language alone;
    an error without `lang` concerns the message itself and answers it for every language.
    """

    code: str
    message: str
    field: str | None = None
    stream_id: str | None = None
    seq: int | None = None
    lang: str | None = None

    def __post_init__(self) -> None:
        code = self.code.value if isinstance(self.code, ErrorCode) else self.code
        if not isinstance(code, str):
            raise InvalidMessage("code", f"code must be a string, got {_type_name(code)}")
        if code not in ERROR_CODES:
            raise InvalidMessage(
                "code", f"code {code[:64]!r} is not one of {', '.join(sorted(ERROR_CODES))}"
            )
        _set(self, "code", code)
        if not _check_str("message", self.message):
            raise InvalidMessage("message", "message must not be empty")
        if self.field is not None:
            _check_name("field", self.field, MAX_FIELD_NAME_CHARS)
        if self.stream_id is not None:
            _set(self, "stream_id", _check_stream_id(self.stream_id))
        if self.seq is not None:
            _check_count("seq", self.seq)
        _check_optional_lang(self.lang)


@dataclass(frozen=True, slots=True)
class Subscribe:
    """A viewer asks to receive a stream's updates read-only (it may not push to it).

    `lang`: the target language to receive, when the engine translates into several.
    Without it a viewer gets the engine's first (default) language: a viewer shows one
    line per segment, and one that does not ask for a language cannot tell two apart.
    To watch several languages, subscribe once per language.

    `after`: the `cursor` of the last update this viewer showed. A viewer that reconnects
    (to any node of the service) sends it and gets every update it missed, in order, and
    nothing twice; without it a viewer starts from the stream's last lines (its backlog).
    `0-0` asks for all the server keeps of the stream (a few hundred updates: a transcript).
    """

    stream_id: str
    lang: str | None = None
    after: str | None = None

    def __post_init__(self) -> None:
        _set(self, "stream_id", _check_stream_id(self.stream_id))
        _check_optional_lang(self.lang)
        _check_optional_cursor("after", self.after)


@dataclass(frozen=True, slots=True)
class CloseStream:
    """The writer ends a stream, so the engine can free its state at once."""

    stream_id: str

    def __post_init__(self) -> None:
        _set(self, "stream_id", _check_stream_id(self.stream_id))


@dataclass(frozen=True, slots=True)
class StartAudio:
    """A writer starts an audio stream: the binary frames it sends next, until `EndAudio`
    (or `CloseStream`), are 16-bit little-endian mono PCM at `sample_rate` Hz, spoken into
    stream `stream_id`.

    A server started with a recognizer hears the audio and takes what it hears as this
    connection's `PartialTranscript`s (numbered on from anything it sent the stream
    before), so translation, replies and viewers are those of a writer sending text; it
    also echoes each of them to the writer as a `partial_transcript` message (what was
    heard). Binary frames carry no stream id, so a connection has one audio stream at a
    time. A frame may end inside a sample: the dangling byte waits for the next frame.
    `lang`: the language spoken, when the writer knows it; a server whose recognizer
    hears another language refuses the stream rather than transcribe nonsense.
    """

    stream_id: str
    sample_rate: int
    lang: str | None = None

    def __post_init__(self) -> None:
        _set(self, "stream_id", _check_stream_id(self.stream_id))
        _check_rate("sample_rate", self.sample_rate)
        _check_optional_lang(self.lang)


@dataclass(frozen=True, slots=True)
class EndAudio:
    """The writer's audio stream ends: the utterance in progress gets its final, the stream
    itself stays open (text, or a new `StartAudio`, may follow; `CloseStream` ends both)."""

    stream_id: str

    def __post_init__(self) -> None:
        _set(self, "stream_id", _check_stream_id(self.stream_id))


@dataclass(frozen=True, slots=True)
class SetGlossary:
    """A writer gives its stream its own glossary for one target language: `glossary` is
    the text of a glossary file (TSV whose first line names the languages,
    source<TAB>target; docs/glossaries.md), at most `MAX_GLOSSARY_BYTES` and
    `MAX_GLOSSARY_ENTRIES` entries. The engine checks each entry (a bad one is refused
    with its line number), merges it with its own glossary for that language (the
    stream's entries win) and answers `GlossarySet`; it replaces the stream's earlier one
    for that language (a header alone clears it) and applies to every translation that
    starts after the answer, from the writer's next partial."""

    stream_id: str
    glossary: str

    def __post_init__(self) -> None:
        _set(self, "stream_id", _check_stream_id(self.stream_id))
        _check_str("glossary", self.glossary)
        size = len(self.glossary.encode("utf-8", "surrogatepass"))
        if size > MAX_GLOSSARY_BYTES:
            raise TooLarge(
                "glossary", f"glossary is {size} bytes; the limit is {MAX_GLOSSARY_BYTES}"
            )
        entries = glossary_entries(self.glossary)
        if entries > MAX_GLOSSARY_ENTRIES:
            raise TooLarge(
                "glossary",
                f"glossary holds {entries} entries; the limit is {MAX_GLOSSARY_ENTRIES}",
            )


def glossary_entries(text: str) -> int:
    """Entries in a glossary file's text: lines that are not blank, not comments (`#`),
    and not the first such line (the header naming the languages)."""
    lines = [
        line for line in text.split("\n") if line.strip() and not line.lstrip().startswith("#")
    ]
    return max(0, len(lines) - 1)


@dataclass(frozen=True, slots=True)
class GlossarySet:
    """The engine's acknowledgement of `SetGlossary`: stream `stream_id` now translates
    into `lang` with its own `entries` terms (merged over the server's), from its
    writer's next partial on."""

    stream_id: str
    lang: str
    entries: int

    def __post_init__(self) -> None:
        _set(self, "stream_id", _check_stream_id(self.stream_id))
        _check_optional_lang(self.lang)
        _check_count("entries", self.entries)


Message: TypeAlias = (
    PartialTranscript
    | TranslationUpdate
    | ErrorMessage
    | Subscribe
    | CloseStream
    | StartAudio
    | EndAudio
    | SetGlossary
    | GlossarySet
)
"""Any message of the protocol."""
