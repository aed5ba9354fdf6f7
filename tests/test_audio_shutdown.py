"""A stopping server and its speakers: every utterance a speaker began is ended and
answered, within `shutdown_timeout`.

A text writer whose final crosses a shutdown is told to send it again; a speaker cannot
say it again. So on a stop every audio stream ends as `end_audio` would (queued audio
recognized, the recognizer flushed, the finals translated) within the configured timeout,
and a stream still recognizing when its share of the timeout is spent is cut: its
utterance in progress ends with the words shown last, its speaker is told of the audio
left unrecognized, and each final is answered (its translation, or `unavailable` when
even that did not fit).

The recognizers here are scripted and slow on purpose (each call sleeps), so that a stop
lands while they still hold audio; one test uses pocketsphinx on espeak-ng speech.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from engine.asr.recognizer import SpeechHypothesis
from engine.decoding.translator import Translator
from engine.server import client as client_module
from engine.server import shutdown
from engine.server.app import SubtitleServer
from engine.server.audio import AudioInput
from tests.conftest import slow_decodes, wait_for
from tests.live_server import STREAMING, serving
from tests.test_audio_ws import (
    SENTENCE,
    SPEECH,
    Scripted,
    needs_speech,
    receive_until,
    said,
    scripted_input,
    silence,
    spoken,
    start,
    words_right,
    ws_url,
)

SPEAKERS = 4
CALL_S = 2.0  # each slow recognizer call (after the first)
HEARD = "i will meet tom"  # shown after the first chunk
FIRST = "i will meet tom at three"  # final of the first utterance, from the third chunk
LAST = "tom reads a book"  # the second utterance's final, at flush


class Sluggish(Scripted):
    """A scripted recognizer whose calls after the first each take `CALL_S`."""

    def __init__(self) -> None:
        super().__init__(
            [
                (1600, said(HEARD, False)),
                (4800, said(FIRST, True)),
                (4800, said("tom reads", False, 2000)),
            ],
            at_flush=[said(LAST, True, 2000)],
        )
        self.calls = 0

    def _wait(self) -> None:
        self.calls += 1
        if self.calls > 1:
            time.sleep(CALL_S)

    def accept(self, pcm: bytes) -> list[SpeechHypothesis]:
        self._wait()
        return super().accept(pcm)

    def flush(self) -> list[SpeechHypothesis]:
        self._wait()
        return super().flush()


def sluggish_input(count: int) -> AudioInput:
    return scripted_input(*[Sluggish() for _ in range(count)])


async def mid_utterance(server: SubtitleServer, count: int) -> list[ClientConnection]:
    """`count` speakers, each with its first words shown, a chunk being recognized and
    one more queued behind it (the queued one finishes a sentence)."""
    writers = [await connect(ws_url(server)) for _ in range(count)]
    for i, ws in enumerate(writers):
        await ws.send(start(f"mic{i}"))
        await ws.send(silence(0.1))
    for ws in writers:
        await receive_until(ws, lambda m: m["type"] == "partial_transcript")
    for ws in writers:
        await ws.send(silence(0.1))  # recognized for CALL_S
    await anyio.sleep(0.3)
    for ws in writers:
        await ws.send(silence(0.1))  # queued behind it
    await anyio.sleep(0.1)
    return writers


async def until_closed(ws: ClientConnection) -> tuple[list[dict[str, Any]], int | None]:
    """Everything the server sends until its close frame, and the close code."""
    messages: list[dict[str, Any]] = []
    with anyio.fail_after(30):
        try:
            while True:
                messages.append(json.loads(await ws.recv()))
        except ConnectionClosed as closed:
            return messages, closed.rcvd.code if closed.rcvd is not None else None


def answers(messages: list[dict[str, Any]], seq: int) -> list[dict[str, Any]]:
    """The replies about the final of `seq`: its final translation or an error."""
    return [
        m
        for m in messages
        if m.get("seq") == seq
        and (m["type"] == "error" or (m["type"] == "translation_update" and m["is_final"]))
    ]


def echoed_finals(messages: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [
        (m["seq"], m["text"])
        for m in messages
        if m["type"] == "partial_transcript" and m["is_final"]
    ]


def translation(translator: Translator, text: str) -> str:
    return translator.translate([text], STREAMING.decode)[0].text


@pytest.mark.anyio
async def test_speakers_get_every_utterance_translated_within_the_shutdown_timeout(
    translator: Translator,
) -> None:
    """The stop lands with a sentence still queued and one in progress: recognizing them
    takes a few seconds, within the share of the 14 s timeout that audio gets, and both
    are translated before the close."""
    async with serving(translator, audio=sluggish_input(SPEAKERS), shutdown_timeout=14.0) as server:
        writers = await mid_utterance(server, SPEAKERS)
        async with anyio.create_task_group() as group:
            group.start_soon(server.shutdown)
            got = [await until_closed(ws) for ws in writers]
    for messages, code in got:
        assert code == 1001
        assert [m for m in messages if m["type"] == "error"] == []
        assert [text for _, text in echoed_finals(messages)] == [FIRST, LAST]
        for seq, text in echoed_finals(messages):
            (reply,) = answers(messages, seq)
            assert reply["type"] == "translation_update", reply
            assert (reply["source_text"], reply["stable_text"]) == (
                text,
                translation(translator, text),
            )
    assert server.state.audio.held == 0


@pytest.mark.parametrize("slow_translation", [False, True])
@pytest.mark.anyio
async def test_a_speaker_cut_short_by_the_timeout_gets_its_words_and_an_answer(
    translator: Translator, monkeypatch: pytest.MonkeyPatch, slow_translation: bool
) -> None:
    """A 2 s timeout: at half of it the recognizers still hold audio, so each utterance in
    progress ends with the words shown, which are translated in the other half, or, when
    translating is slower than that, answered `unavailable`. The speaker hears what was
    not recognized."""
    timeout = 2.0
    async with serving(
        translator, audio=sluggish_input(SPEAKERS), shutdown_timeout=timeout
    ) as server:
        writers = await mid_utterance(server, SPEAKERS)
        if slow_translation:
            slow_decodes(monkeypatch, 1.5)
        started = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(server.shutdown)
            got = [await until_closed(ws) for ws in writers]
            await server.wait_shutdown()
        took = time.monotonic() - started
    assert took <= timeout + shutdown.ABORT_GRACE + 1.0, took
    for i, (messages, code) in enumerate(got):
        assert code == 1001
        ((seq, text),) = echoed_finals(messages)
        assert text == HEARD  # the words shown, made final
        (reply,) = answers(messages, seq)
        if slow_translation:
            assert (reply["type"], reply["code"], reply["stream_id"]) == (
                "error",
                "unavailable",
                f"mic{i}",
            )
        else:
            assert reply["type"] == "translation_update", reply
            assert reply["stable_text"] == translation(translator, HEARD)
        (unheard,) = [m for m in messages if m["type"] == "error" and m.get("seq") is None]
        assert (unheard["code"], unheard["stream_id"]) == ("unavailable", f"mic{i}")
        assert "0.2 s of audio were not recognized" in unheard["message"]


@pytest.mark.anyio
async def test_a_speaker_gone_mid_utterance_is_cut_after_the_grace(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that left while its recognizer is still busy: past the grace its viewers
    get the words shown as the final, without waiting for the recognizer."""
    monkeypatch.setattr(client_module, "AUDIO_LEAVE_GRACE", 0.2)
    async with serving(translator, audio=sluggish_input(1)) as server:
        async with connect(ws_url(server)) as viewer:
            await viewer.send(json.dumps({"type": "subscribe", "stream_id": "mic0"}))
            await wait_for(lambda: server.role_counts()["viewer"] == 1)
            (writer,) = await mid_utterance(server, 1)
            await writer.close()
            viewed = await receive_until(
                viewer,
                lambda m: m["type"] == "translation_update" and m["is_final"],
                timeout=CALL_S,
            )
        assert (viewed[-1]["source_text"], viewed[-1]["seq"]) == (HEARD, 1)


@pytest.fixture(scope="module")
def speech() -> AudioInput:
    needs_speech()
    from engine.asr.sphinx import SphinxOptions
    from engine.server.audio import pocketsphinx_input

    return pocketsphinx_input(
        SphinxOptions(language_model=SPEECH / "fixture.lm.gz", dictionary=SPEECH / "fixture.dict")
    )


@pytest.mark.anyio
async def test_pocketsphinx_speakers_stopped_mid_sentence_get_it_translated(
    translator: Translator, speech: AudioInput
) -> None:
    """Real recognizers: three speakers, each stopped right after its sentence, before
    the pause that would end it; each gets the sentence as a final, translated."""
    pcm = spoken(SENTENCE)[: -int(0.6 * 16_000) * 2]  # without the pause after it
    async with serving(translator, audio=speech, shutdown_timeout=10.0) as server:
        writers = [await connect(ws_url(server)) for _ in range(3)]
        for i, ws in enumerate(writers):
            await ws.send(start(f"mic{i}"))
        for at in range(0, len(pcm), 3200):
            for ws in writers:
                await ws.send(pcm[at : at + 3200])
        for ws in writers:
            await receive_until(ws, lambda m: m["type"] == "partial_transcript")
        async with anyio.create_task_group() as group:
            group.start_soon(server.shutdown)
            got = [await until_closed(ws) for ws in writers]
    for messages, code in got:
        assert code == 1001
        ((seq, text),) = echoed_finals(messages)
        assert words_right(SENTENCE, text) >= 0.8, text
        (reply,) = answers(messages, seq)
        assert reply["type"] == "translation_update" and reply["source_text"] == text
