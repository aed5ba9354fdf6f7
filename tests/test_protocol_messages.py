"""Message validation, the async API protocol and the package's import weight."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import subprocess
import sys
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import pytest

from protocol import (
    CloseStream,
    EndAudio,
    ErrorCode,
    ErrorMessage,
    InvalidEvent,
    InvalidMessage,
    NmtIncremental,
    PartialTranscript,
    StartAudio,
    Subscribe,
    TranslationUpdate,
)
from protocol.messages import ERROR_CODES, MAX_ID, MAX_SAMPLE_RATE, MIN_SAMPLE_RATE

PARTIAL: dict[str, Any] = {
    "stream_id": "mic-1",
    "segment_id": 0,
    "seq": 0,
    "text": "hello",
    "is_final": False,
}
UPDATE: dict[str, Any] = {
    "stream_id": "mic-1",
    "segment_id": 0,
    "seq": 0,
    "stable_text": "Hallo",
    "unstable_text": " Welt",
    "is_final": False,
    "latency_ms": 12.5,
    "compute_ms": 8.0,
}
ERROR: dict[str, Any] = {"code": "out_of_order", "message": "seq 3 is not above 5"}
STREAM: dict[str, Any] = {"stream_id": "mic-1"}

BASES: dict[type, dict[str, Any]] = {
    PartialTranscript: PARTIAL,
    TranslationUpdate: UPDATE,
    ErrorMessage: ERROR,
    Subscribe: STREAM,
    CloseStream: STREAM,
    StartAudio: {**STREAM, "sample_rate": 16000},
    EndAudio: STREAM,
}


def make(cls: type, **changes: Any) -> Any:
    return cls(**{**BASES[cls], **changes})


# --- valid messages ---------------------------------------------------------------------

VALID: list[tuple[type, dict[str, Any]]] = [
    (PartialTranscript, {}),
    (PartialTranscript, {"text": ""}),  # an empty non-final partial is allowed
    (PartialTranscript, {"is_final": True}),
    (PartialTranscript, {"start_ms": 0, "end_ms": 0}),
    (PartialTranscript, {"start_ms": 10.5, "end_ms": 900}),
    (PartialTranscript, {"start_ms": 10.5}),
    (PartialTranscript, {"end_ms": 10.5}),
    (PartialTranscript, {"segment_id": MAX_ID, "seq": MAX_ID}),
    (PartialTranscript, {"stream_id": "x" * 128}),
    (PartialTranscript, {"stream_id": "会议室 2 / mic #1 🎤"}),
    (PartialTranscript, {"text": "line one\nline two\t\x00"}),  # free text is not restricted
    (TranslationUpdate, {}),
    (TranslationUpdate, {"stable_text": "", "unstable_text": ""}),
    (TranslationUpdate, {"is_final": True, "unstable_text": ""}),
    (TranslationUpdate, {"is_final": True, "unstable_text": "", "revised": True}),
    (TranslationUpdate, {"source_text": "hello"}),
    (TranslationUpdate, {"latency_ms": 0, "compute_ms": 0}),
    (ErrorMessage, {}),
    (ErrorMessage, {"code": ErrorCode.INTERNAL}),
    (ErrorMessage, {"field": "seq", "stream_id": "mic-1", "seq": 7}),
    (Subscribe, {}),
    (CloseStream, {}),
    (StartAudio, {}),
    (StartAudio, {"sample_rate": MIN_SAMPLE_RATE, "lang": "en-US"}),
    (StartAudio, {"sample_rate": MAX_SAMPLE_RATE}),
    (EndAudio, {}),
]


@pytest.mark.parametrize(("cls", "changes"), VALID)
def test_valid_messages_construct(cls: type, changes: dict[str, Any]) -> None:
    message = make(cls, **changes)
    for name, value in changes.items():
        assert getattr(message, name) == value


def test_messages_are_frozen_slotted_and_hashable() -> None:
    for cls in BASES:
        message = make(cls)
        with pytest.raises(dataclasses.FrozenInstanceError):
            message.stream_id = "other"
        assert not hasattr(message, "__dict__")
        assert hash(message) == hash(make(cls))


def test_milliseconds_are_normalised_to_float() -> None:
    partial = make(PartialTranscript, start_ms=0, end_ms=5)
    assert (type(partial.start_ms), type(partial.end_ms)) == (float, float)
    update = make(TranslationUpdate, latency_ms=3, compute_ms=1)
    assert (type(update.latency_ms), type(update.compute_ms)) == (float, float)


def test_translation_update_text_joins_stable_and_unstable() -> None:
    assert make(TranslationUpdate).text == "Hallo Welt"
    assert make(TranslationUpdate, stable_text="", unstable_text="").text == ""


def test_error_code_is_stored_as_plain_string() -> None:
    error = make(ErrorMessage, code=ErrorCode.RATE_LIMITED)
    assert type(error.code) is str
    assert error == make(ErrorMessage, code="rate_limited")
    assert error.code == ErrorCode.RATE_LIMITED
    # A code and its string are interchangeable, hash included.
    assert {"rate_limited": 1}[ErrorCode.RATE_LIMITED] == 1
    assert str(ErrorCode.RATE_LIMITED) == "rate_limited"


def test_error_codes_are_the_documented_set() -> None:
    documented = {
        "invalid_json",
        "invalid_message",
        "unknown_type",
        "too_large",
        "unknown_stream",
        "out_of_order",
        "unauthorized",
        "forbidden",
        "rate_limited",
        "limit_exceeded",
        "internal",
        "unavailable",
    }
    assert documented == ERROR_CODES


# --- invalid messages: (class, changes, field at fault) ----------------------------------

_BAD_STREAM_IDS = [
    "",
    "x" * 129,
    "mic\n1",
    "mic\x00",
    "mic\x7f",
    "mic\x85",
    "a\u2028b",
    "a\u202eb",
    "a\u2066b",
    "mic\u200b1",  # zero-width space: looks like "mic1"
    "mic\u200f1",  # right-to-left mark
    "mic\u061c1",  # Arabic letter mark
    "mic\u00a01",  # no-break space: looks like "mic 1"
    "\ufeffmic",  # byte order mark
    "\ud800",
    1,
    None,
]

INVALID: list[tuple[type, dict[str, Any], str]] = [
    *[
        (cls, {"stream_id": bad}, "stream_id")
        for cls in BASES
        for bad in _BAD_STREAM_IDS
        if cls is not ErrorMessage or bad is not None  # an error's stream_id is optional
    ],
    (PartialTranscript, {"segment_id": -1}, "segment_id"),
    (PartialTranscript, {"segment_id": MAX_ID + 1}, "segment_id"),
    (PartialTranscript, {"segment_id": True}, "segment_id"),
    (PartialTranscript, {"segment_id": 1.0}, "segment_id"),
    (PartialTranscript, {"segment_id": "1"}, "segment_id"),
    (PartialTranscript, {"seq": -1}, "seq"),
    (PartialTranscript, {"seq": False}, "seq"),
    (PartialTranscript, {"seq": 2.0}, "seq"),
    (PartialTranscript, {"seq": None}, "seq"),
    (PartialTranscript, {"text": None}, "text"),
    (PartialTranscript, {"text": b"hello"}, "text"),
    (PartialTranscript, {"text": "bad \udc80 surrogate"}, "text"),
    (PartialTranscript, {"text": "", "is_final": True}, "text"),
    (PartialTranscript, {"is_final": 1}, "is_final"),
    (PartialTranscript, {"is_final": "true"}, "is_final"),
    (PartialTranscript, {"is_final": None}, "is_final"),
    (PartialTranscript, {"start_ms": -0.5}, "start_ms"),
    (PartialTranscript, {"start_ms": float("nan")}, "start_ms"),
    (PartialTranscript, {"start_ms": float("inf")}, "start_ms"),
    (PartialTranscript, {"start_ms": True}, "start_ms"),
    (PartialTranscript, {"start_ms": "0"}, "start_ms"),
    (PartialTranscript, {"start_ms": 10**400}, "start_ms"),
    (PartialTranscript, {"end_ms": -1}, "end_ms"),
    (PartialTranscript, {"end_ms": float("-inf")}, "end_ms"),
    (PartialTranscript, {"start_ms": 100, "end_ms": 99.5}, "end_ms"),
    (TranslationUpdate, {"segment_id": -3}, "segment_id"),
    (TranslationUpdate, {"seq": True}, "seq"),
    (TranslationUpdate, {"stable_text": None}, "stable_text"),
    (TranslationUpdate, {"unstable_text": 0}, "unstable_text"),
    (TranslationUpdate, {"is_final": 0}, "is_final"),
    (TranslationUpdate, {"is_final": True}, "unstable_text"),  # final with a tentative tail
    (TranslationUpdate, {"latency_ms": -1}, "latency_ms"),
    (TranslationUpdate, {"latency_ms": float("nan")}, "latency_ms"),
    (TranslationUpdate, {"latency_ms": None}, "latency_ms"),
    (TranslationUpdate, {"compute_ms": -0.1}, "compute_ms"),
    (TranslationUpdate, {"compute_ms": False}, "compute_ms"),
    (TranslationUpdate, {"revised": 1}, "revised"),
    (TranslationUpdate, {"revised": True}, "revised"),  # only a final can be a revision
    (TranslationUpdate, {"source_text": 5}, "source_text"),
    (ErrorMessage, {"code": "nope"}, "code"),
    (ErrorMessage, {"code": "INTERNAL"}, "code"),
    (ErrorMessage, {"code": None}, "code"),
    (ErrorMessage, {"message": ""}, "message"),
    (ErrorMessage, {"message": None}, "message"),
    (ErrorMessage, {"field": ""}, "field"),
    (ErrorMessage, {"field": "a\nb"}, "field"),
    (ErrorMessage, {"field": 3}, "field"),
    (ErrorMessage, {"seq": -1}, "seq"),
    (ErrorMessage, {"seq": True}, "seq"),
    (StartAudio, {"sample_rate": MIN_SAMPLE_RATE - 1}, "sample_rate"),
    (StartAudio, {"sample_rate": MAX_SAMPLE_RATE + 1}, "sample_rate"),
    (StartAudio, {"sample_rate": 16000.0}, "sample_rate"),
    (StartAudio, {"sample_rate": True}, "sample_rate"),
    (StartAudio, {"sample_rate": None}, "sample_rate"),
    (StartAudio, {"lang": "e"}, "lang"),
]


@pytest.mark.parametrize(("cls", "changes", "field"), INVALID)
def test_invalid_field_raises_naming_it(cls: type, changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidMessage) as info:
        make(cls, **changes)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_invalid_message_pickles() -> None:
    exc = InvalidMessage("seq", "seq must be an integer")
    copy = pickle.loads(pickle.dumps(exc))
    assert (copy.field, str(copy)) == ("seq", "seq must be an integer")


# --- the async API ----------------------------------------------------------------------


class FakeEngine:
    """The smallest NmtIncremental: "translates" by upper-casing, everything stable."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[TranslationUpdate | None] = asyncio.Queue()
        self._last_seq: dict[str, int] = {}

    async def push(self, event: PartialTranscript) -> None:
        last = self._last_seq.get(event.stream_id, -1)
        if event.seq <= last:
            raise InvalidEvent(
                ErrorMessage(
                    ErrorCode.OUT_OF_ORDER,
                    f"seq {event.seq} is not above {last}",
                    "seq",
                    event.stream_id,
                    event.seq,
                )
            )
        self._last_seq[event.stream_id] = event.seq
        stable = event.text.upper()
        await self._queue.put(
            TranslationUpdate(
                event.stream_id, event.segment_id, event.seq, stable, "", event.is_final, 0.1, 0.1
            )
        )

    async def updates(self, stream_id: str | None = None) -> AsyncIterator[TranslationUpdate]:
        while (update := await self._queue.get()) is not None:
            if stream_id is None or update.stream_id == stream_id:
                yield update

    async def close_stream(self, stream_id: str) -> None:
        self._last_seq.pop(stream_id)
        await self._queue.put(None)

    async def aclose(self) -> None:
        self._last_seq.clear()

    async def __aenter__(self) -> FakeEngine:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


def test_api_usage_reads_as_documented() -> None:
    engine: NmtIncremental = FakeEngine()  # also checked statically by mypy
    assert isinstance(engine, NmtIncremental)

    async def pipeline() -> list[str]:
        texts = []
        async with engine as nmt:
            await nmt.push(PartialTranscript("mic-1", 0, 0, "hel", False))
            await nmt.push(PartialTranscript("mic-1", 0, 1, "hello", True))
            with pytest.raises(InvalidEvent) as info:
                await nmt.push(PartialTranscript("mic-1", 0, 1, "again", False))
            assert info.value.error.code == ErrorCode.OUT_OF_ORDER
            assert (info.value.error.stream_id, info.value.error.seq) == ("mic-1", 1)
            await nmt.close_stream("mic-1")
            async for update in nmt.updates("mic-1"):
                texts.append(update.text)
        return texts

    assert asyncio.run(pipeline()) == ["HEL", "HELLO"]


def test_runtime_check_rejects_incomplete_implementations() -> None:
    class NoUpdates:
        async def push(self, event: PartialTranscript) -> None: ...

    assert not isinstance(NoUpdates(), NmtIncremental)
    assert not isinstance(object(), NmtIncremental)


def test_invalid_event_carries_the_error() -> None:
    error = ErrorMessage("unknown_stream", "stream 'x' is not open", stream_id="x")
    exc = InvalidEvent(error)
    assert isinstance(exc, ValueError)
    assert exc.error is error
    assert str(exc) == "stream 'x' is not open"
    assert pickle.loads(pickle.dumps(exc)).error == error


# --- weight -----------------------------------------------------------------------------


def test_importing_protocol_pulls_in_nothing_heavy() -> None:
    code = (
        "import sys, protocol, protocol.api, protocol.codec, protocol.messages\n"
        "protocol.codec.load_schema()\n"
        "heavy = {'numpy', 'onnxruntime', 'anyio', 'websockets', 'sentencepiece', 'engine',"
        " 'jsonschema', 'asyncio'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


def test_stream_ids_are_compared_in_nfc() -> None:
    """ "é" as one code point or as "e" + combining acute names the same stream."""
    composed = PartialTranscript("caf\u00e9", 0, 0, "x", is_final=False)
    decomposed = PartialTranscript("cafe\u0301", 0, 0, "x", is_final=False)
    assert composed.stream_id == decomposed.stream_id == "caf\u00e9"
    assert CloseStream("cafe\u0301").stream_id == "caf\u00e9"


def test_an_update_stamped_with_a_cursor_equals_one_made_with_it() -> None:
    update = TranslationUpdate(
        "s1", 2, 5, "Hello", " there", False, 12.5, 3.0, source_text="hallo", epoch=1, lang="en"
    )
    stamped = update.with_cursor("1732451234567-3")
    assert stamped == dataclasses.replace(update, cursor="1732451234567-3")
    assert update.cursor is None  # the original is left as it was
    assert stamped.with_cursor(None) == update
    with pytest.raises(InvalidMessage, match="cursor"):
        update.with_cursor("not a cursor")
