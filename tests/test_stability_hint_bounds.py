"""A `stable_chars` hint past the end of the text is taken as the whole text, never refused.

The hint is optional, so a wrong count must not cost the message: a recogniser counting
UTF-16 units overshoots on every text with an emoji, and its finals still get translated."""

from __future__ import annotations

import json

import pytest
from websockets.asyncio.client import connect

from engine.decoding.translator import Translator
from engine.streaming.controller import IncrementalTranslator
from protocol import PartialTranscript, TranslationUpdate, parse, serialize
from tests.live_server import STREAMING, recv, serving, ws_url

EMOJI = "Tom will play tennis 🎾 with Lucy"


def utf16_units(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def wire(seq: int, text: str, final: bool, stable_chars: int) -> str:
    return json.dumps(
        {
            "type": "partial_transcript",
            "stream_id": "s",
            "segment_id": 0,
            "seq": seq,
            "text": text,
            "is_final": final,
            "stable_chars": stable_chars,
        }
    )


@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("extra", [1, 10, 2**53 - 1 - len(EMOJI)])
def test_a_count_past_the_end_is_the_whole_text(final: bool, extra: int) -> None:
    event = parse(wire(3, EMOJI, final, len(EMOJI) + extra))
    assert isinstance(event, PartialTranscript), event
    assert event.stable_chars == len(EMOJI)
    assert parse(serialize(event)) == event
    made = PartialTranscript("s", 0, 3, EMOJI, final, stable_chars=len(EMOJI) + extra)
    assert made == event


def test_a_utf16_count_of_an_emoji_text_overshoots_and_is_taken() -> None:
    assert utf16_units(EMOJI) == len(EMOJI) + 1  # a UTF-16-counting client overshoots
    event = parse(wire(0, EMOJI, True, utf16_units(EMOJI)))
    assert isinstance(event, PartialTranscript) and event.stable_chars == len(EMOJI)


def test_counts_within_the_text_are_kept() -> None:
    for count in (0, 5, len(EMOJI)):
        event = parse(wire(0, EMOJI, False, count))
        assert isinstance(event, PartialTranscript) and event.stable_chars == count


@pytest.mark.anyio
async def test_the_engine_translates_a_final_whose_hint_overshoots(translator: Translator) -> None:
    """The same final update as without the hint."""
    async with IncrementalTranslator(translator, STREAMING) as nmt:
        updates = nmt.updates("s")
        await nmt.push(PartialTranscript("s", 0, 0, EMOJI, True))
        plain = await anext(aiter(updates))
        await nmt.push(PartialTranscript("s", 1, 1, EMOJI, True, stable_chars=utf16_units(EMOJI)))
        hinted = await anext(aiter(updates))
    assert isinstance(plain, TranslationUpdate) and isinstance(hinted, TranslationUpdate)
    assert hinted.is_final and hinted.seq == 1
    assert hinted.stable_text == plain.stable_text != ""


@pytest.mark.anyio
async def test_a_utf16_counting_client_gets_every_final_translated(translator: Translator) -> None:
    """Over the wire, partials and a final counted in UTF-16 units: each is translated,
    none gets an `invalid_message` error naming `stable_chars`."""
    words = EMOJI.split()
    texts = [" ".join(words[:k]) for k in range(1, len(words) + 1)]
    async with serving(translator) as server, connect(ws_url(server)) as ws:
        for seq, text in enumerate(texts):
            await ws.send(wire(seq, text, seq == len(texts) - 1, utf16_units(text)))
        replies: list[dict[str, object]] = []
        while not replies or replies[-1].get("seq") != len(texts) - 1:
            replies.append(await recv(ws))
    assert not [r for r in replies if r["type"] == "error"], replies
    final = replies[-1]
    assert final["type"] == "translation_update" and final["is_final"], final
    assert final["stable_text"]
