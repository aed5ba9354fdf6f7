"""`wire.schema.json` agrees with the codec, so non-Python clients can validate with it."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from typing import Any

import jsonschema
import pytest

from protocol import (
    CloseStream,
    EndAudio,
    ErrorCode,
    ErrorMessage,
    Message,
    PartialTranscript,
    StartAudio,
    Subscribe,
    TranslationUpdate,
    parse,
    serialize,
)
from protocol.codec import MAX_TEXT_CHARS, MESSAGE_TYPES, load_schema, schema_path
from protocol.messages import (
    ERROR_CODES,
    MAX_ID,
    MAX_LANG_CHARS,
    MAX_SAMPLE_RATE,
    MAX_STREAM_ID_CHARS,
    MIN_SAMPLE_RATE,
)
from tests.test_protocol_codec import ER, PT, TU, with_, without

SCHEMA = load_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
INT_FIELDS = {"segment_id", "seq", "sample_rate"}


def strict_json(wire: str) -> Any:
    """Parse as RFC 8259 JSON: Python's NaN/Infinity extension is refused."""

    def refuse(literal: str) -> Any:
        raise ValueError(f"{literal} is not JSON")

    return json.loads(wire, parse_constant=refuse)


def schema_accepts(wire: str) -> bool:
    try:
        doc = strict_json(wire)
    except ValueError:
        return False
    return bool(VALIDATOR.is_valid(doc))


def codec_accepts(wire: str) -> bool:
    """Whether `decode` accepted `wire`; an "error" message counts as accepted when what came
    back is that message, not a refusal."""
    result = parse(wire)
    if not isinstance(result, ErrorMessage):
        return True
    try:
        doc = json.loads(wire)
    except ValueError:
        return False
    if not isinstance(doc, dict) or doc.get("type") != "error":
        return False
    return bool(json.loads(serialize(result)) == {k: v for k, v in doc.items() if v is not None})


# --- the schema itself ------------------------------------------------------------------


def test_schema_is_valid_draft_2020_12() -> None:
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_schema_ships_inside_the_package() -> None:
    path = schema_path()
    assert path.name == "wire.schema.json"
    assert json.loads(path.read_text(encoding="utf-8")) == SCHEMA


def test_schema_describes_exactly_the_codecs_messages() -> None:
    defs = SCHEMA["$defs"]
    assert [ref["$ref"].rsplit("/", 1)[1] for ref in SCHEMA["oneOf"]] == list(MESSAGE_TYPES)
    for name, cls in MESSAGE_TYPES.items():
        fields = dataclasses.fields(cls)
        schema = defs[name]
        assert schema["additionalProperties"] is False
        assert schema["properties"]["type"] == {"const": name}
        assert list(schema["properties"]) == ["type", *(f.name for f in fields)]
        required = [f.name for f in fields if f.default is dataclasses.MISSING]
        assert schema["required"] == ["type", *required]
    assert set(defs["error"]["properties"]["code"]["enum"]) == ERROR_CODES
    assert defs["text"]["maxLength"] == MAX_TEXT_CHARS
    assert defs["name"]["maxLength"] == MAX_STREAM_ID_CHARS
    assert defs["count"]["maximum"] == defs["ms"]["maximum"] == MAX_ID
    assert defs["lang"]["maxLength"] == MAX_LANG_CHARS
    rate = defs["start_audio"]["properties"]["sample_rate"]
    assert (rate["minimum"], rate["maximum"]) == (MIN_SAMPLE_RATE, MAX_SAMPLE_RATE)


def test_schema_and_code_take_the_same_language_tags() -> None:
    """The `lang` pattern is written twice (Python and JSON Schema): same verdicts."""
    from protocol.messages import _LANG

    pattern = re.compile(SCHEMA["$defs"]["lang"]["pattern"])
    tags = "de zh zh-Hans cmn_Hans pt-BR und sr-Latn-RS x zh- zh--x -de d3 de1".split()
    tags += ["en-123456789", "ab_c-d", "de ", "ÄB", "zh-Hans\n"]
    for tag in tags:
        assert bool(pattern.search(tag)) == bool(_LANG.fullmatch(tag)), tag


# --- a table of cases -------------------------------------------------------------------


UNPRINTABLE = (
    "\x00\t\n\x1f\x7f\x85\x9f\u2028\u2029\u202a\u202e\u2066\u2069"
    # invisible or space-like: two ids that look the same must not name two streams
    "\u200b\u200d\u200f\u061c\u00a0\u00ad\u2060\u3000\ufe0f\ufeff\u3164"
)

VALID: list[str] = [
    json.dumps(PT),
    with_(PT, text=""),
    with_(PT, is_final=True),
    with_(PT, start_ms=0, end_ms=0.5),
    with_(PT, start_ms=None, end_ms=None),
    with_(PT, stream_id="x" * MAX_STREAM_ID_CHARS, segment_id=MAX_ID, seq=MAX_ID),
    with_(PT, stream_id="会议室 🎤 #2", text="好" * MAX_TEXT_CHARS),
    with_(PT, text="line\nbreak\u2028and\x00control"),
    json.dumps(TU),
    with_(TU, is_final=True, unstable_text="", revised=True),
    with_(TU, is_final=True, unstable_text="", revised=False),
    with_(TU, source_text="hello", latency_ms=0, compute_ms=MAX_ID),
    with_(TU, source_text=None),
    json.dumps(ER),
    *[with_(ER, code=code) for code in sorted(ERROR_CODES)],
    with_(ER, field="seq", stream_id="mic-1", seq=3),
    with_(ER, field=None, stream_id=None, seq=None),
    '{"type":"subscribe","stream_id":"room"}',
    '{"type":"subscribe","stream_id":"room","lang":"de"}',
    '{"type":"subscribe","stream_id":"room","lang":"zh-Hans"}',
    '{"type":"subscribe","stream_id":"room","lang":null}',
    with_(TU, lang="zh"),
    with_(TU, lang="cmn_Hans"),
    with_(ER, lang="de", seq=3),
    '{"type":"close_stream","stream_id":"room"}',
    ' {\n "stream_id" : "room", "type":"close_stream" } ',
    '{"type":"start_audio","stream_id":"mic","sample_rate":16000}',
    '{"type":"start_audio","stream_id":"mic","sample_rate":8000,"lang":"en-US"}',
    '{"type":"start_audio","stream_id":"mic","sample_rate":192000,"lang":null}',
    '{"type":"end_audio","stream_id":"mic"}',
]

INVALID: list[str] = [
    "{",
    "[]",
    "null",
    '"subscribe"',
    "{}",
    without(PT, "type"),
    with_(PT, type="partial"),
    with_(PT, type=None),
    with_(PT, extra=1),
    *[without(PT, key) for key in PT if key != "type"],
    *[without(TU, key) for key in TU if key != "type"],
    without(ER, "code"),
    without(ER, "message"),
    with_(PT, stream_id=""),
    with_(PT, stream_id="x" * (MAX_STREAM_ID_CHARS + 1)),
    *[with_(PT, stream_id=f"a{c}b") for c in UNPRINTABLE],
    with_(PT, stream_id=1),
    with_(PT, segment_id=-1),
    with_(PT, segment_id=MAX_ID + 1),
    with_(PT, segment_id=True),
    with_(PT, segment_id="1"),
    with_(PT, seq=2.5),
    with_(PT, seq=None),
    with_(PT, text=None),
    with_(PT, text="x" * (MAX_TEXT_CHARS + 1)),
    with_(PT, text="", is_final=True),
    with_(PT, is_final=1),
    with_(PT, is_final="true"),
    with_(PT, start_ms=-1),
    with_(PT, start_ms=MAX_ID + 1),
    with_(PT, start_ms=float("nan")),
    with_(PT, end_ms=float("inf")),
    with_(PT, start_ms=True),
    with_(PT, start_ms="3"),
    with_(TU, latency_ms=-1),
    with_(TU, latency_ms=None),
    with_(TU, compute_ms=[]),
    with_(TU, revised=True),
    with_(TU, revised=None),
    with_(TU, is_final=True),
    with_(TU, stable_text="s" * (MAX_TEXT_CHARS + 1)),
    with_(TU, source_text="s" * (MAX_TEXT_CHARS + 1)),
    with_(TU, text="x"),
    with_(ER, code="teapot"),
    with_(ER, message=""),
    with_(ER, message=None),
    with_(ER, message="m" * (MAX_TEXT_CHARS + 1)),
    with_(ER, field=""),
    with_(ER, field="a\nb"),
    with_(ER, stream_id=""),
    with_(ER, seq=-1),
    '{"type":"subscribe"}',
    '{"type":"subscribe","stream_id":"a","seq":1}',
    *[
        f'{{"type":"subscribe","stream_id":"a","lang":{json.dumps(bad)}}}'
        for bad in ["", "d", "zh-", "-zh", "zh--Hans", "z1", "de\n", "zh Hans", "x" * 36, 7]
    ],
    with_(TU, lang=""),
    with_(ER, lang="zh_"),
    '{"type":"close_stream","stream_id":"a","lang":"de"}',
    '{"type":"close_stream","stream_id":""}',
    '{"type":"start_audio","stream_id":"mic"}',
    '{"type":"start_audio","sample_rate":16000}',
    '{"type":"start_audio","stream_id":"mic","sample_rate":7999}',
    '{"type":"start_audio","stream_id":"mic","sample_rate":192001}',
    '{"type":"start_audio","stream_id":"mic","sample_rate":16000.5}',
    '{"type":"start_audio","stream_id":"mic","sample_rate":"16000"}',
    '{"type":"start_audio","stream_id":"mic","sample_rate":16000,"lang":"x"}',
    '{"type":"start_audio","stream_id":"mic","sample_rate":16000,"seq":1}',
    '{"type":"end_audio","stream_id":""}',
    '{"type":"end_audio","stream_id":"mic","lang":"en"}',
]

# What the codec refuses but JSON Schema cannot express (listed in the schema's description).
CODEC_ONLY: list[str] = [
    with_(PT, seq=5.0),  # JSON Schema counts 5.0 as an integer
    with_(PT, segment_id=0.0),
    with_(ER, seq=1.0),
    with_(PT, start_ms=10, end_ms=9),  # no comparison between fields
    with_(PT, text="\ud800"),  # lone surrogate, escaped
    with_(PT, stream_id="a\udfffb"),
    '{"type":"subscribe","stream_id":"a","stream_id":"b"}',  # duplicate key
    '{"type":"start_audio","stream_id":"a","sample_rate":16000.0}',
    json.dumps(PT)[:-1] + " " * (64 * 1024) + "}",  # over the size limit, padded with spaces
]


@pytest.mark.parametrize("wire", VALID)
def test_valid_examples_pass_both(wire: str) -> None:
    assert codec_accepts(wire)
    assert parse(wire) == parse(serialize(parse(wire)))
    VALIDATOR.validate(strict_json(wire))


@pytest.mark.parametrize("wire", INVALID)
def test_invalid_examples_fail_both(wire: str) -> None:
    assert not codec_accepts(wire)
    assert not schema_accepts(wire)


@pytest.mark.parametrize("wire", CODEC_ONLY)
def test_checks_beyond_json_schema_are_the_documented_ones(wire: str) -> None:
    assert not codec_accepts(wire)
    assert schema_accepts(wire)


# --- randomised -------------------------------------------------------------------------

_CHARS = "abcXYZ019 -_:/.#éß好世🎤"
_TEXT_CHARS = _CHARS + '\n\t"\\\x00\u2028\u200b'


def _string(rng: random.Random, alphabet: str, low: int, high: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))


def _count(rng: random.Random) -> int:
    return rng.choice([0, 1, rng.randrange(1000), rng.randrange(MAX_ID + 1), MAX_ID])


def _ms(rng: random.Random) -> float:
    return rng.choice([0.0, rng.uniform(0, 1e4), float(rng.randrange(10**6)), rng.uniform(0, 1e12)])


def random_message(rng: random.Random) -> Message:
    stream_id = _string(rng, _CHARS, 1, 130)[:MAX_STREAM_ID_CHARS]
    kind = rng.choice(list(MESSAGE_TYPES.values()))
    if kind is PartialTranscript:
        final = rng.random() < 0.3
        start = rng.choice([None, _ms(rng)])
        end = rng.choice([None, (start or 0.0) + _ms(rng)])
        return PartialTranscript(
            stream_id,
            _count(rng),
            _count(rng),
            _string(rng, _TEXT_CHARS, int(final), 40),
            final,
            start,
            end,
        )
    if kind is TranslationUpdate:
        final = rng.random() < 0.3
        return TranslationUpdate(
            stream_id,
            _count(rng),
            _count(rng),
            _string(rng, _TEXT_CHARS, 0, 40),
            "" if final else _string(rng, _TEXT_CHARS, 0, 20),
            final,
            _ms(rng),
            _ms(rng),
            revised=final and rng.random() < 0.5,
            source_text=rng.choice([None, _string(rng, _TEXT_CHARS, 0, 40)]),
            lang=rng.choice([None, "zh", "de", "zh-Hans", "cmn_Hans"]),
        )
    if kind is ErrorMessage:
        return ErrorMessage(
            rng.choice(list(ErrorCode)),
            _string(rng, _TEXT_CHARS, 1, 60),
            rng.choice([None, "seq", "text", "stream_id"]),
            rng.choice([None, stream_id]),
            rng.choice([None, _count(rng)]),
            rng.choice([None, "de"]),
        )
    if kind is Subscribe:
        return Subscribe(stream_id, rng.choice([None, "zh", "pt-BR"]))
    if kind is StartAudio:
        rate = rng.choice([MIN_SAMPLE_RATE, 16000, 44100, 48000, MAX_SAMPLE_RATE])
        return StartAudio(stream_id, rate, rng.choice([None, "en", "en-US"]))
    if kind is EndAudio:
        return EndAudio(stream_id)
    return CloseStream(stream_id)


_ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    7,
    -1,
    3.0,
    2.5,
    -0.0,
    MAX_ID + 1,
    "",
    "x",
    "\n",
    "x" * 129,
    [],
    {},
    "internal",
    "subscribe",
    1e300,
]


def _mutate(rng: random.Random, doc: dict[str, Any]) -> dict[str, Any]:
    doc = dict(doc)
    action = rng.random()
    if action < 0.6:
        doc[rng.choice(list(doc))] = rng.choice(_ODD_VALUES)
    elif action < 0.8:
        del doc[rng.choice(list(doc))]
    elif action < 0.9:
        doc[rng.choice(["extra", "seq", "text", "revised", "start_ms", "end_ms", "lang"])] = (
            rng.choice(_ODD_VALUES)
        )
    else:
        doc["type"] = rng.choice(list(MESSAGE_TYPES))
    return doc


def _beyond_schema(doc: dict[str, Any]) -> bool:
    """Whether `doc` breaks a rule JSON Schema cannot express (see CODEC_ONLY)."""
    for key in INT_FIELDS:
        value = doc.get(key)
        if isinstance(value, float) and value.is_integer() and 0 <= value <= MAX_ID:
            return True
    rate = doc.get("sample_rate")
    if isinstance(rate, float) and rate.is_integer() and MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        return True
    start, end = doc.get("start_ms"), doc.get("end_ms")
    numbers = (int, float)
    return (
        isinstance(start, numbers)
        and isinstance(end, numbers)
        and not isinstance(start, bool)
        and not isinstance(end, bool)
        and math.isfinite(start)
        and end < start
    )


def test_random_valid_messages_validate_and_round_trip() -> None:
    rng = random.Random(7)
    for _ in range(500):
        message = random_message(rng)
        wire = serialize(message)
        assert parse(wire) == message
        VALIDATOR.validate(strict_json(wire))


def test_random_mutations_get_the_same_verdict_from_codec_and_schema() -> None:
    rng = random.Random(11)
    checked = rejected = 0
    for _ in range(1500):
        doc = _mutate(rng, json.loads(serialize(random_message(rng))))
        wire = json.dumps(doc)
        codec_ok = codec_accepts(wire)
        if codec_ok:
            assert schema_accepts(wire), wire
        elif not _beyond_schema(doc):
            assert not schema_accepts(wire), (wire, parse(wire))
            rejected += 1
        checked += 1
    assert rejected > checked // 2  # the mutations mostly produce bad messages


def test_schema_forbids_exactly_the_identifier_characters_the_codec_does() -> None:
    """The fixed set of characters an identifier may not hold, in the schema and in the
    code, agree on every code point of the Basic Multilingual Plane."""
    import re

    from protocol.messages import _UNPRINTABLE

    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    pattern = re.compile(schema["$defs"]["name"]["not"]["pattern"])
    for cp in range(0x10000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        assert bool(pattern.search(ch)) == bool(_UNPRINTABLE.search(ch)), hex(cp)
