"""The JSON wire codec: round trips, the exact format, and every way input can be bad."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from protocol import (
    CloseStream,
    EndAudio,
    ErrorCode,
    ErrorMessage,
    GlossarySet,
    Message,
    PartialTranscript,
    SetGlossary,
    StartAudio,
    Subscribe,
    TranslationUpdate,
    parse,
    serialize,
)
from protocol.codec import (
    FROM_ENGINE_TYPES,
    MAX_MESSAGE_BYTES,
    MAX_TEXT_CHARS,
    MESSAGE_TYPES,
    TO_ENGINE_TYPES,
)
from protocol.messages import MAX_ID, MAX_SAMPLE_RATE, MIN_SAMPLE_RATE

MESSAGES: list[Message] = [
    PartialTranscript("mic-1", 0, 0, "", False),
    PartialTranscript("mic-1", 3, 17, "hello wor", False, start_ms=1200.0),
    PartialTranscript("会议 🎤", MAX_ID, MAX_ID, '你好，世界 "quoted" \\ \n', True, 0.0, 0.0),
    PartialTranscript("s", 0, 1, "final", True, 12.25, 1e9),
    TranslationUpdate("mic-1", 0, 0, "", "", False, 0.0, 0.0),
    TranslationUpdate("mic-1", 2, 9, "Hallo", " Welt", False, 35.5, 12.0, source_text="hello wor"),
    TranslationUpdate("mic-1", 2, 10, "Hallo, Welt!", "", True, 120.25, 80.5, revised=True),
    TranslationUpdate("mic-1", 2, 10, "你好", "", True, 1.0, 1.0, epoch=3, lang="zh"),
    ErrorMessage("internal", "the decoder failed"),
    ErrorMessage("internal", "the German decoder failed", None, "mic-1", 4, lang="de"),
    ErrorMessage(ErrorCode.OUT_OF_ORDER, "seq 3 is not above 5", "seq", "mic-1", 3),
    Subscribe("room-7"),
    Subscribe("room-7", lang="zh-Hans"),
    CloseStream("mic-1"),
    StartAudio("mic-1", 16000),
    StartAudio("会议 🎤", MIN_SAMPLE_RATE, lang="en-US"),
    StartAudio("s", MAX_SAMPLE_RATE),
    EndAudio("mic-1"),
    SetGlossary("mic-1", "en\tde\nTom\tThomas\nAcme\n"),
    GlossarySet("mic-1", "de", 2),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Message) -> None:
    wire = serialize(message)
    assert parse(wire) == message
    assert parse(wire.encode("utf-8")) == message
    assert parse(bytearray(wire.encode("utf-8"))) == message
    assert parse(memoryview(wire.encode("utf-8"))) == message


def test_every_type_is_covered() -> None:
    assert {type(m) for m in MESSAGES} == set(MESSAGE_TYPES.values())
    assert set(MESSAGE_TYPES) == TO_ENGINE_TYPES | FROM_ENGINE_TYPES
    assert not TO_ENGINE_TYPES & FROM_ENGINE_TYPES


def test_encoding_is_compact_type_first_and_omits_none() -> None:
    wire = serialize(PartialTranscript("mic-1", 0, 4, "héllo", False))
    assert wire == (
        '{"type":"partial_transcript","stream_id":"mic-1","segment_id":0,"seq":4,'
        '"text":"héllo","is_final":false}'
    )
    wire = serialize(ErrorMessage("internal", "boom"))
    assert wire == '{"type":"error","code":"internal","message":"boom"}'
    # revised has a default but is always written, so clients need not know the default.
    assert '"revised":false' in serialize(TranslationUpdate("a", 0, 0, "x", "", False, 1.0, 1.0))


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(TypeError):
        serialize({"type": "subscribe", "stream_id": "x"})  # type: ignore[arg-type]


def test_null_means_absent_for_optional_fields() -> None:
    wire = (
        '{"type":"partial_transcript","stream_id":"a","segment_id":0,"seq":1,"text":"x",'
        '"is_final":false,"start_ms":null,"end_ms":null}'
    )
    assert parse(wire) == PartialTranscript("a", 0, 1, "x", False)
    absent = '{"type":"translation_update","stream_id":"a","segment_id":0,"seq":1,'
    absent += '"stable_text":"","unstable_text":"","is_final":false,"latency_ms":1,"compute_ms":2}'
    assert parse(absent) == TranslationUpdate("a", 0, 1, "", "", False, 1.0, 2.0, revised=False)


def test_messages_without_lang_decode_to_lang_none() -> None:
    """`lang` is optional: an update, error or subscribe without it (what a single-language
    engine or client writes) decodes, to lang None."""
    old_update = (
        '{"type":"translation_update","stream_id":"a","segment_id":0,"seq":1,"stable_text":"x",'
        '"unstable_text":"","is_final":true,"latency_ms":1,"compute_ms":2,"revised":false,'
        '"source_text":"hi","epoch":1}'
    )
    update = parse(old_update)
    assert isinstance(update, TranslationUpdate) and update.lang is None and update.epoch == 1
    assert parse('{"type":"subscribe","stream_id":"a"}') == Subscribe("a", lang=None)
    error = parse('{"type":"error","code":"internal","message":"m","seq":3}')
    assert isinstance(error, ErrorMessage) and error.lang is None and error.seq == 3
    # And the new field is written only when set, after the fields it extends.
    wire = serialize(Subscribe("a", "de"))
    assert wire == '{"type":"subscribe","stream_id":"a","lang":"de"}'
    assert "lang" not in serialize(Subscribe("a"))


def test_whitespace_around_and_inside_json_is_fine() -> None:
    assert parse(' \n{ "type" : "subscribe" ,\t"stream_id" : "a" }\r\n') == Subscribe("a")


# --- bad input --------------------------------------------------------------------------

PT = {
    "type": "partial_transcript",
    "stream_id": "mic-1",
    "segment_id": 0,
    "seq": 5,
    "text": "hi",
    "is_final": False,
}
TU = {
    "type": "translation_update",
    "stream_id": "mic-1",
    "segment_id": 0,
    "seq": 5,
    "stable_text": "",
    "unstable_text": "x",
    "is_final": False,
    "latency_ms": 1.0,
    "compute_ms": 1.0,
}
ER = {"type": "error", "code": "internal", "message": "boom"}


def with_(base: dict[str, Any], **changes: Any) -> str:
    return json.dumps({**base, **changes})


def without(base: dict[str, Any], key: str) -> str:
    return json.dumps({k: v for k, v in base.items() if k != key})


# (wire, code, field, stream_id and seq the error should carry)
BAD: list[tuple[str | bytes, str, str | None, str | None, int | None]] = [
    ("", "invalid_json", None, None, None),
    ("{", "invalid_json", None, None, None),
    ("not json", "invalid_json", None, None, None),
    ('{"type":"subscribe","stream_id":"a"} trailing', "invalid_json", None, None, None),
    ("{'type':'subscribe'}", "invalid_json", None, None, None),
    (b"\xff\xfe{}", "invalid_json", None, None, None),
    (b'{"type":"subscribe","stream_id":"\xc3"}', "invalid_json", None, None, None),
    (b"\xef\xbb\xbf" + json.dumps(PT).encode(), "invalid_json", None, None, None),  # BOM
    ("[" * 100_00 + "]" * 100_00, "invalid_json", None, None, None),
    ('{"seq":' + "9" * 5000 + "}", "invalid_json", None, None, None),
    ("[]", "invalid_message", None, None, None),
    ('"partial_transcript"', "invalid_message", None, None, None),
    ("null", "invalid_message", None, None, None),
    ("42", "invalid_message", None, None, None),
    (without(PT, "type"), "invalid_message", "type", "mic-1", 5),
    (with_(PT, type=None), "invalid_message", "type", "mic-1", 5),
    (with_(PT, type=["partial_transcript"]), "invalid_message", "type", "mic-1", 5),
    (with_(PT, type="partial"), "unknown_type", "type", "mic-1", 5),
    (with_(PT, type="Partial_Transcript"), "unknown_type", "type", "mic-1", 5),
    (with_(PT, extra=1), "invalid_message", "extra", "mic-1", 5),
    (with_(PT, stable_text="x"), "invalid_message", "stable_text", "mic-1", 5),
    (with_(PT, **{"bad\nkey": 1}), "invalid_message", None, "mic-1", 5),
    (
        '{"type":"subscribe","stream_id":"a","stream_id":"b"}',
        "invalid_message",
        "stream_id",
        None,
        None,
    ),
    (without(PT, "stream_id"), "invalid_message", "stream_id", None, 5),
    (without(PT, "segment_id"), "invalid_message", "segment_id", "mic-1", 5),
    (without(PT, "seq"), "invalid_message", "seq", "mic-1", None),
    (without(PT, "text"), "invalid_message", "text", "mic-1", 5),
    (without(PT, "is_final"), "invalid_message", "is_final", "mic-1", 5),
    (with_(PT, stream_id=""), "invalid_message", "stream_id", None, 5),
    (with_(PT, stream_id="a" * 129), "invalid_message", "stream_id", None, 5),
    (with_(PT, stream_id="a\tb"), "invalid_message", "stream_id", None, 5),
    (with_(PT, stream_id=7), "invalid_message", "stream_id", None, 5),
    (with_(PT, stream_id=None), "invalid_message", "stream_id", None, 5),
    (with_(PT, segment_id=-1), "invalid_message", "segment_id", "mic-1", 5),
    (with_(PT, segment_id=MAX_ID + 1), "invalid_message", "segment_id", "mic-1", 5),
    (with_(PT, segment_id=True), "invalid_message", "segment_id", "mic-1", 5),
    (with_(PT, segment_id=0.0), "invalid_message", "segment_id", "mic-1", 5),
    (with_(PT, segment_id="0"), "invalid_message", "segment_id", "mic-1", 5),
    (with_(PT, seq=5.0), "invalid_message", "seq", "mic-1", None),
    (with_(PT, seq=5.5), "invalid_message", "seq", "mic-1", None),
    (with_(PT, seq=1e3), "invalid_message", "seq", "mic-1", None),
    (with_(PT, seq=-5), "invalid_message", "seq", "mic-1", None),
    (with_(PT, seq=False), "invalid_message", "seq", "mic-1", None),
    (with_(PT, seq=[5]), "invalid_message", "seq", "mic-1", None),
    (with_(PT, seq={"n": 5}), "invalid_message", "seq", "mic-1", None),
    (with_(PT, text=None), "invalid_message", "text", "mic-1", 5),
    (with_(PT, text=["hi"]), "invalid_message", "text", "mic-1", 5),
    (with_(PT, text="x" * (MAX_TEXT_CHARS + 1)), "too_large", "text", "mic-1", 5),
    (with_(PT, text="", is_final=True), "invalid_message", "text", "mic-1", 5),
    (with_(PT, text="\ud83d"), "invalid_message", "text", "mic-1", 5),  # lone surrogate
    (with_(PT, is_final=1), "invalid_message", "is_final", "mic-1", 5),
    (with_(PT, is_final=0), "invalid_message", "is_final", "mic-1", 5),
    (with_(PT, is_final="false"), "invalid_message", "is_final", "mic-1", 5),
    (with_(PT, is_final=None), "invalid_message", "is_final", "mic-1", 5),
    (with_(PT, start_ms=-1), "invalid_message", "start_ms", "mic-1", 5),
    (with_(PT, start_ms="0"), "invalid_message", "start_ms", "mic-1", 5),
    (with_(PT, start_ms=True), "invalid_message", "start_ms", "mic-1", 5),
    (with_(PT, start_ms=float("nan")), "invalid_message", "start_ms", "mic-1", 5),
    (with_(PT, start_ms=float("inf")), "invalid_message", "start_ms", "mic-1", 5),
    (with_(PT, end_ms=float("-inf")), "invalid_message", "end_ms", "mic-1", 5),
    (with_(PT, start_ms=1e400), "invalid_message", "start_ms", "mic-1", 5),  # parses as inf
    (with_(PT, start_ms=10**400), "invalid_message", "start_ms", "mic-1", 5),
    (with_(PT, start_ms=MAX_ID + 1), "invalid_message", "start_ms", "mic-1", 5),
    (with_(PT, start_ms=500, end_ms=499), "invalid_message", "end_ms", "mic-1", 5),
    (without(TU, "latency_ms"), "invalid_message", "latency_ms", "mic-1", 5),
    (without(TU, "compute_ms"), "invalid_message", "compute_ms", "mic-1", 5),
    (without(TU, "unstable_text"), "invalid_message", "unstable_text", "mic-1", 5),
    (with_(TU, latency_ms=-0.5), "invalid_message", "latency_ms", "mic-1", 5),
    (with_(TU, latency_ms=None), "invalid_message", "latency_ms", "mic-1", 5),
    (with_(TU, compute_ms="1"), "invalid_message", "compute_ms", "mic-1", 5),
    (with_(TU, revised=None), "invalid_message", "revised", "mic-1", 5),
    (with_(TU, revised=1), "invalid_message", "revised", "mic-1", 5),
    (with_(TU, revised=True), "invalid_message", "revised", "mic-1", 5),
    (with_(TU, is_final=True), "invalid_message", "unstable_text", "mic-1", 5),
    (with_(TU, stable_text="x" * (MAX_TEXT_CHARS + 1)), "too_large", "stable_text", "mic-1", 5),
    (with_(TU, unstable_text="y" * (MAX_TEXT_CHARS + 1)), "too_large", "unstable_text", "mic-1", 5),
    (with_(TU, source_text="z" * (MAX_TEXT_CHARS + 1)), "too_large", "source_text", "mic-1", 5),
    (with_(TU, source_text=3), "invalid_message", "source_text", "mic-1", 5),
    (with_(TU, text="x"), "invalid_message", "text", "mic-1", 5),
    (with_(ER, code="teapot"), "invalid_message", "code", None, None),
    (with_(ER, code=None), "invalid_message", "code", None, None),
    (without(ER, "code"), "invalid_message", "code", None, None),
    (without(ER, "message"), "invalid_message", "message", None, None),
    (with_(ER, message=""), "invalid_message", "message", None, None),
    (with_(ER, message="m" * (MAX_TEXT_CHARS + 1)), "too_large", "message", None, None),
    (with_(ER, field=""), "invalid_message", "field", None, None),
    (with_(ER, seq=-1), "invalid_message", "seq", None, None),
    (with_(ER, seq=1, stream_id="\n"), "invalid_message", "stream_id", None, 1),
    ('{"type":"subscribe"}', "invalid_message", "stream_id", None, None),
    ('{"type":"subscribe","stream_id":"a","seq":1}', "invalid_message", "seq", "a", 1),
    ('{"type":"close_stream","stream_id":""}', "invalid_message", "stream_id", None, None),
    ('{"type":"close_stream","stream_id":"a","text":"x"}', "invalid_message", "text", "a", None),
    ('{"type":"start_audio","stream_id":"a"}', "invalid_message", "sample_rate", "a", None),
    *[
        (
            f'{{"type":"start_audio","stream_id":"a","sample_rate":{rate}}}',
            "invalid_message",
            "sample_rate",
            "a",
            None,
        )
        for rate in ["16000.0", "7999", "192001", "0", "-16000", '"16000"', "true", "null"]
    ],
    (
        '{"type":"start_audio","stream_id":"a","sample_rate":16000,"lang":"english!"}',
        "invalid_message",
        "lang",
        "a",
        None,
    ),
    (
        '{"type":"start_audio","stream_id":"a","sample_rate":16000,"channels":2}',
        "invalid_message",
        "channels",
        "a",
        None,
    ),
    ('{"type":"start_audio","stream_id":"","sample_rate":16000}', "invalid_message", "stream_id",
     None, None),
    ('{"type":"end_audio"}', "invalid_message", "stream_id", None, None),
    ('{"type":"end_audio","stream_id":"a","sample_rate":16000}', "invalid_message",
     "sample_rate", "a", None),
]  # fmt: skip


@pytest.mark.parametrize(("wire", "code", "field", "stream_id", "seq"), BAD)
def test_bad_input_returns_an_error_naming_the_problem(
    wire: str | bytes, code: str, field: str | None, stream_id: str | None, seq: int | None
) -> None:
    result = parse(wire)
    assert isinstance(result, ErrorMessage), result
    assert (result.code, result.field, result.stream_id, result.seq) == (
        code,
        field,
        stream_id,
        seq,
    ), result.message
    if field is not None:
        assert field in result.message
    # The error itself is a valid message a server can send back as is.
    assert parse(serialize(result)) == result


def test_unknown_field_with_unreportable_name_is_quoted_in_the_message() -> None:
    result = parse(with_(PT, **{"bad\nkey": 1, "k" * 300: 2}))
    assert isinstance(result, ErrorMessage)
    assert result.field is None
    assert "'bad\\nkey'" in result.message
    result = parse(with_(PT, **{"k" * 300: 2}))
    assert isinstance(result, ErrorMessage)
    assert result.field is None
    assert len(result.message) < 200


def test_messages_describe_json_types_in_json_terms() -> None:
    cases = {
        with_(PT, seq=5.0): "seq must be an integer, got number 5.0",
        with_(PT, seq=True): "seq must be an integer, got true",
        with_(PT, is_final=1): "is_final must be a boolean, got integer 1",
        with_(PT, text=None): "text must be a string, got null",
        with_(PT, start_ms=float("nan")): "start_ms must be a finite number, got NaN",
        with_(PT, start_ms=float("-inf")): "start_ms must be a finite number, got -Infinity",
    }
    for wire, message in cases.items():
        result = parse(wire)
        assert isinstance(result, ErrorMessage)
        assert result.message == message


def test_message_size_limit_counts_utf8_bytes_and_is_configurable() -> None:
    wire = serialize(PartialTranscript("a", 0, 0, "好" * 3000, False))  # > 9000 bytes
    size = len(wire.encode("utf-8"))
    assert isinstance(parse(wire), PartialTranscript)
    for data in (wire, wire.encode("utf-8")):
        assert isinstance(parse(data, max_bytes=size), PartialTranscript)
        small = parse(data, max_bytes=size - 1)
        assert isinstance(small, ErrorMessage)
        assert small.code == "too_large"
        assert str(size - 1) in small.message
    huge = " " * (MAX_MESSAGE_BYTES + 1)
    result = parse(huge)
    assert isinstance(result, ErrorMessage)
    assert result.code == "too_large"


def test_text_limit_is_configurable() -> None:
    wire = with_(PT, text="x" * 10)
    assert isinstance(parse(wire, max_text_chars=10), PartialTranscript)
    result = parse(wire, max_text_chars=9)
    assert isinstance(result, ErrorMessage)
    assert (result.code, result.field) == ("too_large", "text")
    assert isinstance(parse(with_(PT, text="x" * MAX_TEXT_CHARS)), PartialTranscript)


def test_audio_messages_are_written_as_documented() -> None:
    assert serialize(StartAudio("mic", 48000)) == (
        '{"type":"start_audio","stream_id":"mic","sample_rate":48000}'
    )
    assert serialize(StartAudio("mic", 16000, "en")) == (
        '{"type":"start_audio","stream_id":"mic","sample_rate":16000,"lang":"en"}'
    )
    assert serialize(EndAudio("mic")) == '{"type":"end_audio","stream_id":"mic"}'
    # A client sends them; the engine never does (it echoes partial_transcript instead).
    assert {"start_audio", "end_audio"} <= TO_ENGINE_TYPES
    assert not {"start_audio", "end_audio"} & FROM_ENGINE_TYPES
    refused = parse('{"type":"start_audio","stream_id":"a","sample_rate":4000}')
    assert isinstance(refused, ErrorMessage) and "8000 and 192000 Hz" in refused.message


def test_accept_restricts_types_so_errors_are_unambiguous() -> None:
    assert parse(serialize(Subscribe("a")), accept=TO_ENGINE_TYPES) == Subscribe("a")
    echoed = parse(serialize(ErrorMessage("internal", "x")), accept=TO_ENGINE_TYPES)
    assert isinstance(echoed, ErrorMessage)
    assert (echoed.code, echoed.field) == ("invalid_message", "type")
    assert "not accepted" in echoed.message
    with pytest.raises(ValueError):
        parse("{}", accept={"nope"})


def test_bad_arguments_are_programming_errors() -> None:
    with pytest.raises(ValueError):
        parse("{}", max_bytes=0)
    with pytest.raises(ValueError):
        parse("{}", max_text_chars=-1)
    with pytest.raises(TypeError):
        parse(42)  # type: ignore[arg-type]


# --- randomised: decode never raises, and whatever it accepts round-trips -----------------

_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2.0,
    0.5,
    -0.5,
    MAX_ID,
    MAX_ID + 1,
    "",
    "a",
    "mic-1",
    "\n",
    "x" * 200,
    [],
    [1],
    {},
    {"a": 1},
    "internal",
    "partial_transcript",
    "subscribe",
    "error",
]


def _mutate_object(rng: random.Random, obj: dict[str, Any]) -> dict[str, Any]:
    obj = dict(obj)
    for _ in range(rng.randint(1, 3)):
        action = rng.random()
        keys = list(obj)
        if action < 0.5 and keys:
            obj[rng.choice(keys)] = rng.choice(_VALUES)
        elif action < 0.7 and keys:
            del obj[rng.choice(keys)]
        elif action < 0.85:
            obj[rng.choice(["type", "x", "seq", "text", "code", "revised", "field"])] = rng.choice(
                _VALUES
            )
        else:
            obj["type"] = rng.choice(list(MESSAGE_TYPES))
    return obj


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(buf) + 1)
        action = rng.random()
        if action < 0.4 and buf:
            buf[min(pos, len(buf) - 1)] = rng.randrange(256)
        elif action < 0.7:
            buf[pos:pos] = bytes([rng.choice(b'{}[]",:\\0123456789.eE-+ntfu\xc3\xff')])
        else:
            del buf[pos : pos + rng.randint(1, 5)]
    return bytes(buf)


def _check_decodes_safely(data: str | bytes) -> None:
    result = parse(data)
    assert isinstance(result, tuple(MESSAGE_TYPES.values()))
    assert parse(serialize(result)) == result


def test_randomised_inputs_never_raise() -> None:
    rng = random.Random(20240601)
    originals = [json.loads(serialize(m)) for m in MESSAGES]
    for _ in range(3000):
        obj = _mutate_object(rng, rng.choice(originals))
        _check_decodes_safely(json.dumps(obj, ensure_ascii=rng.random() < 0.5))
        _check_decodes_safely(_mutate_bytes(rng, serialize(rng.choice(MESSAGES)).encode("utf-8")))


# --- set_glossary: bounded in bytes and entries ----------------------------------------


def test_set_glossary_past_its_bytes_is_too_large() -> None:
    from protocol.messages import MAX_GLOSSARY_BYTES

    text = "en\tde\n" + "#" * MAX_GLOSSARY_BYTES
    reply = parse(json.dumps({"type": "set_glossary", "stream_id": "s", "glossary": text}))
    assert isinstance(reply, ErrorMessage)
    assert (reply.code, reply.field, reply.stream_id) == ("too_large", "glossary", "s")
    assert f"limit is {MAX_GLOSSARY_BYTES}" in reply.message


def test_set_glossary_past_its_entries_is_too_large() -> None:
    from protocol.messages import MAX_GLOSSARY_ENTRIES

    lines = [f"term{i}\tT{i}" for i in range(MAX_GLOSSARY_ENTRIES + 1)]
    ok = "en\tde\n# comment\n\n" + "\n".join(lines[:-1])
    assert isinstance(parse(serialize(SetGlossary("s", ok))), SetGlossary)
    reply = parse(
        json.dumps(
            {"type": "set_glossary", "stream_id": "s", "glossary": "en\tde\n" + "\n".join(lines)}
        )
    )
    assert isinstance(reply, ErrorMessage)
    assert (reply.code, reply.field) == ("too_large", "glossary")
    assert f"{MAX_GLOSSARY_ENTRIES + 1} entries" in reply.message


def test_set_glossary_needs_its_text() -> None:
    reply = parse(json.dumps({"type": "set_glossary", "stream_id": "s", "glossary": 3}))
    assert isinstance(reply, ErrorMessage)
    assert (reply.code, reply.field) == ("invalid_message", "glossary")
