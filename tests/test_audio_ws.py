"""Audio over the WebSocket: a writer's `start_audio`, binary frames of 16-bit
PCM and `end_audio`. First the connection's rules, sans I/O; then a real `SubtitleServer`
on loopback with the fixture model, recognizing espeak-ng speech with pocketsphinx
(skipped without them) or a scripted recognizer that can be made to fail."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import threading
import time
import wave
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from engine.asr.audio import MAX_RATE, MIN_RATE, resample
from engine.asr.recognizer import SpeechHypothesis
from engine.decoding.translator import Translator
from engine.server.audio import AudioInput
from engine.server.connection import (
    AUDIO_OFF,
    ConnectionCore,
    FeedAudio,
    FinishAudio,
    Ignore,
    OpenAudio,
    Push,
    Reply,
    Role,
    Watch,
)
from engine.server.credentials import Credentials as Creds
from engine.server.limits import AudioLimits, Limits
from engine.server.state import ServerState
from protocol.messages import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE
from tests.conftest import FIXTURE_MODEL, ROOT, partial_message, wait_for
from tests.live_server import STREAMING, http_get, serving

SPEECH = ROOT / "examples" / "speech"
RATE = 16_000
SENTENCE = "I will meet Tom at three"
VOICE = "en-us+f5"  # pocketsphinx hears this voice saying SENTENCE word for word


def start(stream: str = "mic", rate: int = RATE, **extra: Any) -> str:
    return json.dumps({"type": "start_audio", "stream_id": stream, "sample_rate": rate, **extra})


def end(stream: str = "mic") -> str:
    return json.dumps({"type": "end_audio", "stream_id": stream})


def silence(seconds: float, rate: int = RATE) -> bytes:
    return b"\0\0" * int(seconds * rate)


# --- the rules, sans I/O ----------------------------------------------------------------


def audio_core(
    state: ServerState | None = None,
    audio: AudioLimits | None = None,
    address: str = "local",
    **limits: Any,
) -> ConnectionCore:
    return ConnectionCore(
        1,
        Limits(**{"rate_limit": None, **limits}),
        state or ServerState(),
        audio=audio or AudioLimits(language="en"),
        address=address,
    )


def error_of(action: object) -> Any:
    assert isinstance(action, Reply), action
    return action.error


def test_the_protocol_takes_the_rates_the_recognizer_seam_takes() -> None:
    assert (MIN_SAMPLE_RATE, MAX_SAMPLE_RATE) == (MIN_RATE, MAX_RATE)


def test_a_server_without_audio_says_how_to_enable_it() -> None:
    core = ConnectionCore(1, Limits(rate_limit=None), ServerState())
    error = error_of(core.receive(start(), 0.0))
    assert (error.code, error.field, error.stream_id) == ("invalid_message", "type", "mic")
    assert error.message == AUDIO_OFF and "--asr pocketsphinx" in error.message
    error = error_of(core.receive(b"\x00\x01", 0.0))
    assert "binary frames are not accepted" in error.message and "--asr" in error.message


def test_an_audio_stream_from_start_to_end() -> None:
    core = audio_core()
    action = core.receive(start("mic", 48000), 0.0)
    assert action == OpenAudio("mic", 48000) and core.role is Role.WRITER
    opened = action
    assert isinstance(opened, OpenAudio) and opened.slot is not None
    assert core.server.audio.held == 1
    action = core.receive(b"\x01\x02\x03", 0.0)  # an odd byte count is the seam's to carry
    assert action == FeedAudio("mic", b"\x01\x02\x03") and core.message_type == "audio"
    # Binary frames carry no stream id: one audio stream per connection.
    error = error_of(core.receive(start("other"), 0.0))
    assert (error.code, error.field, error.stream_id) == ("limit_exceeded", "stream_id", "other")
    assert "one audio stream at a time" in error.message
    # The recognizer writes the stream: text into it from the same connection is refused.
    reply = core.receive(partial_message("mic", 0), 0.0)
    assert isinstance(reply, Reply) and reply.error.code == "forbidden"
    assert isinstance(core.receive(partial_message("text-stream", 0), 0.0), Push)  # others are fine
    error = error_of(core.receive(end("other"), 0.0))
    assert (error.code, error.field) == ("unknown_stream", "stream_id")
    assert core.receive(end("mic"), 0.0) == FinishAudio("mic")
    # The slot is held until the I/O layer says the recognizer is gone.
    assert core.server.audio.held == 1 and core.listening is None
    opened.slot.release()
    assert core.server.audio.held == 0
    # Audio after the end: one error for a run of stray frames, then silence.
    error = error_of(core.receive(b"\x00\x00", 0.0))
    assert error.code == "invalid_message" and "send start_audio first" in error.message
    assert isinstance(core.receive(b"\x00\x00", 0.0), Ignore)
    assert isinstance(core.receive(b"\x00\x00", 0.0), Ignore)
    assert isinstance(core.receive(partial_message("text-stream", 1), 0.0), Push)
    assert isinstance(core.receive(b"\x00\x00", 0.0), Reply)  # a new run: said again
    # close_stream of the stream its audio goes to ends the audio, then closes it.
    action = core.receive(start("mic"), 0.0)
    assert isinstance(action, OpenAudio) and action.slot is not None
    close = json.dumps({"type": "close_stream", "stream_id": "mic"})
    assert core.receive(close, 0.0) == FinishAudio("mic", close=True)
    assert core.server.audio.held == 1 and core.listening is None
    action.slot.release()
    assert core.server.audio.held == 0


def test_who_may_stream_audio_and_in_what_language() -> None:
    state = ServerState()
    viewer = audio_core(state)
    assert isinstance(viewer.receive(json.dumps({"type": "subscribe", "stream_id": "x"}), 0), Watch)
    assert error_of(viewer.receive(start(), 0.0)).code == "forbidden"
    keyed = audio_core(state)
    keyed.access = Creds(writer="w", viewer="v").access("v") or keyed.access
    error = error_of(keyed.receive(start(), 0.0))
    assert error.code == "unauthorized" and "streaming audio to stream 'mic'" in error.message
    speaker = audio_core(state)
    error = error_of(speaker.receive(start(lang="de"), 0.0))
    assert (error.code, error.field) == ("invalid_message", "lang")
    assert "hears 'en' speech, not 'de'" in error.message
    assert isinstance(speaker.receive(start(lang="en-GB"), 0.0), OpenAudio)
    error = error_of(audio_core(state).receive(start(rate=4000), 0.0))
    assert (error.code, error.field) == ("invalid_message", "sample_rate")
    assert state.audio.held == 1


def test_audio_streams_are_capped_on_the_whole_server() -> None:
    state = ServerState()
    limits = AudioLimits(max_streams=2)
    cores = [audio_core(state, limits, address=f"10.0.0.{i}") for i in range(3)]
    opened = cores[0].receive(start("a"), 0.0)
    assert isinstance(opened, OpenAudio) and opened.slot is not None
    assert isinstance(cores[1].receive(start("b"), 0.0), OpenAudio)
    error = error_of(cores[2].receive(start("c"), 0.0))
    assert error.code == "limit_exceeded" and "2 audio streams" in error.message
    cores[0].audio_ended("a")  # the I/O layer says it ended (failed, or the client left)
    assert cores[0].listening is None and state.audio.held == 2  # its recognizer is not gone
    opened.slot.release()  # now it is
    assert state.audio.held == 1
    assert isinstance(cores[2].receive(start("c"), 0.0), OpenAudio)


def test_ending_an_audio_stream_keeps_its_slot_until_its_recognizer_is_gone() -> None:
    """start_audio then end_audio, over and over, with no audio: each stream holds its
    slot while its recognizer is being made, so past `max_starting` a start is refused for
    now (`rate_limited`, field `type`), and past `max_streams` in all (`limit_exceeded`);
    the frames sent behind a refused start are dropped without a word of their own."""
    state = ServerState()
    limits = AudioLimits(max_streams=4, max_starting=2, max_streams_per_address=0)
    core = audio_core(state, limits)
    slots = []
    for _ in range(2):
        opened = core.receive(start(), 0.0)
        assert isinstance(opened, OpenAudio) and opened.slot is not None
        slots.append(opened.slot)
        assert isinstance(core.receive(end(), 0.0), FinishAudio)
    assert (state.audio.held, state.audio.starting) == (2, 2)
    error = error_of(core.receive(start(), 0.0))
    assert (error.code, error.field, error.stream_id) == ("rate_limited", "type", "mic")
    assert "2 audio streams are starting" in error.message and "send it again" in error.message
    assert isinstance(core.receive(silence(0.1), 0.0), Ignore)  # its refusal said why
    assert core.listening is None and state.audio.held == 2
    # Once their recognizers are made, two more may start; then the server is full.
    for slot in slots:
        slot.started()
    for _ in range(2):
        opened = core.receive(start(), 0.0)
        assert isinstance(opened, OpenAudio) and opened.slot is not None
        slots.append(opened.slot)
        assert isinstance(core.receive(end(), 0.0), FinishAudio)
    error = error_of(core.receive(start(), 0.0))
    assert (error.code, error.field) == ("limit_exceeded", "type")
    assert "4 audio streams, its limit" in error.message
    # Each recognizer gone frees its slot (a release before the start counts it started).
    for slot in slots:
        slot.release()
        slot.release()  # idempotent
    assert (state.audio.held, state.audio.starting) == (0, 0)
    assert isinstance(core.receive(start(), 0.0), OpenAudio)


def test_one_address_may_hold_only_its_share_of_the_audio_streams() -> None:
    state = ServerState()
    limits = AudioLimits(max_streams=4)  # half of them per address by default
    assert limits.per_address == 2 and AudioLimits(max_streams_per_address=0).per_address is None
    here = [audio_core(state, limits, address="192.0.2.1") for _ in range(3)]
    for core in here[:2]:
        assert isinstance(core.receive(start(), 0.0), OpenAudio)
    error = error_of(here[2].receive(start(), 0.0))
    assert (error.code, error.field) == ("limit_exceeded", "type")
    assert "your address has 2 audio streams open" in error.message
    there = audio_core(state, limits, address="198.51.100.7")
    assert isinstance(there.receive(start(), 0.0), OpenAudio)
    assert state.audio.held_by("192.0.2.1") == 2 and state.audio.held_by("198.51.100.7") == 1


def test_audio_faster_than_the_speed_limit_is_dropped_once_per_burst() -> None:
    """2x real time sustained, bursts of 6 s: a client pushing a file as fast as it can
    gets the first 6 s, then what the limit refills; one error per burst of drops."""
    core = audio_core(audio=AudioLimits(max_speed=2.0, burst_s=6.0), rate_limit=5.0)
    assert isinstance(core.receive(start(), 0.0), OpenAudio)
    frame = silence(0.1)  # 100 ms
    actions = [core.receive(frame, 0.0) for _ in range(80)]  # 8 s at once
    fed = [a for a in actions if isinstance(a, FeedAudio)]
    errors = [a.error for a in actions if isinstance(a, Reply)]
    assert len(fed) == 60 and len(errors) == 1  # 6 s, then 20 frames dropped, said once
    assert errors[0].code == "rate_limited" and errors[0].stream_id == "mic"
    assert "faster than 2x real time" in errors[0].message
    assert core.dropped_audio_ms == pytest.approx(2000)
    # One second later the limit has refilled two seconds' worth.
    actions = [core.receive(frame, 1.0) for _ in range(25)]
    assert sum(isinstance(a, FeedAudio) for a in actions) == 20
    assert sum(isinstance(a, Reply) for a in actions) == 1  # a new burst: said again
    # At real time it goes on for ever (audio frames are not held to --rate-limit, 5/s).
    now = 1.0
    for _ in range(600):
        now += 0.1
        assert isinstance(core.receive(frame, now), FeedAudio)


def test_a_huge_audio_frame_is_too_large_and_the_stream_goes_on() -> None:
    core = audio_core(max_message_bytes=4096)
    core.receive(start(), 0.0)
    error = error_of(core.receive(b"\0" * 5000, 0.0))
    assert (error.code, error.stream_id) == ("too_large", "mic")
    assert isinstance(core.receive(b"\0" * 4096, 0.0), FeedAudio)


def test_a_stopping_server_refuses_audio() -> None:
    state = ServerState()
    core = audio_core(state)
    core.receive(start(), 0.0)
    state.stop()
    assert error_of(core.receive(b"\0\0", 0.0)).code == "unavailable"
    assert isinstance(core.receive(b"\0\0", 0.0), Ignore)
    assert error_of(core.receive(start("b"), 0.0)).code == "unavailable"


# --- a real server ------------------------------------------------------------------------


class Scripted:
    """A recognizer that says `plan[i][1]` once it was given `plan[i][0]` samples, says
    `at_flush` at the end, and raises once it was given `fail_after` samples."""

    sample_rate = RATE

    def __init__(
        self,
        plan: Sequence[tuple[int, SpeechHypothesis]],
        at_flush: Sequence[SpeechHypothesis] = (),
        fail_after: int | None = None,
    ) -> None:
        self.plan = list(plan)
        self.at_flush = list(at_flush)
        self.fail_after = fail_after
        self.samples = 0

    def accept(self, pcm: bytes) -> list[SpeechHypothesis]:
        self.samples += len(pcm) // 2
        if self.fail_after is not None and self.samples >= self.fail_after:
            self.fail_after = None
            raise RuntimeError("decoder exploded")
        heard = [h for at, h in self.plan if at <= self.samples]
        self.plan = [(at, h) for at, h in self.plan if at > self.samples]
        return heard

    def flush(self) -> list[SpeechHypothesis]:
        return self.at_flush


def said(text: str, final: bool, start_ms: float = 0.0) -> SpeechHypothesis:
    return SpeechHypothesis(text, final, start_ms, start_ms + 100 * len(text.split()))


def meeting_tom() -> Scripted:
    """Hears "i will meet tom" in its first 100 ms; its flush finishes the sentence."""
    return Scripted(
        [(1600, said("i will meet tom", False))], at_flush=[said("i will meet tom at three", True)]
    )


def scripted_input(*recognizers: Scripted | Exception, **limits: Any) -> AudioInput:
    """Each audio stream gets the next recognizer (an exception: the factory raises it)."""
    queue = list(recognizers)

    def make() -> Scripted:
        item = queue.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    return AudioInput(make, AudioLimits(**limits), description="scripted")


async def receive_until(
    ws: ClientConnection, done: Callable[[dict[str, Any]], bool], timeout: float = 20.0
) -> list[dict[str, Any]]:
    """Messages until one for which `done` is true (included)."""
    seen: list[dict[str, Any]] = []
    with anyio.fail_after(timeout):
        while True:
            data = await ws.recv()
            assert isinstance(data, str)
            seen.append(json.loads(data))
            if done(seen[-1]):
                return seen


async def receive_all(
    ws: ClientConnection, *conditions: Callable[[dict[str, Any]], bool], timeout: float = 20.0
) -> list[dict[str, Any]]:
    """Messages until each of `conditions` has held for one of them, in any order."""
    seen: list[dict[str, Any]] = []
    with anyio.fail_after(timeout):
        while not all(any(c(m) for m in seen) for c in conditions):
            data = await ws.recv()
            assert isinstance(data, str)
            seen.append(json.loads(data))
    return seen


async def quiet_for(ws: ClientConnection, seconds: float) -> list[dict[str, Any]]:
    """Whatever arrives within `seconds` (expected: nothing)."""
    got: list[dict[str, Any]] = []
    with anyio.move_on_after(seconds):
        while True:
            got.append(json.loads(await ws.recv()))
    return got


def final_update(stream: str = "mic") -> Callable[[dict[str, Any]], bool]:
    return lambda m: (
        m["type"] == "translation_update" and m["stream_id"] == stream and m["is_final"]
    )


def ws_url(server: Any) -> str:
    return f"ws://127.0.0.1:{server.port}/ws"


@pytest.mark.anyio
async def test_a_server_without_audio_refuses_start_audio(translator: Translator) -> None:
    async with serving(translator) as server, connect(ws_url(server)) as ws:
        await ws.send(start())
        error = (await receive_until(ws, lambda m: True))[0]
        assert (error["code"], error["field"]) == ("invalid_message", "type")
        assert "--asr pocketsphinx" in error["message"]
        await ws.send(partial_message("mic", 0, SENTENCE, final=True))  # the connection goes on
        assert (await receive_until(ws, final_update()))[-1]["stable_text"]


@pytest.mark.anyio
async def test_heard_events_are_echoed_and_translated_like_text(translator: Translator) -> None:
    recognizer = Scripted(
        [
            (1600, said("i will", False)),
            (3200, said("i will meet tom", False)),
            (4800, said("i will meet tom at three", True)),
            (6400, said("tom reads", False, 2000)),
        ],
        at_flush=[said("tom reads a book", True, 2000)],
    )
    async with (
        serving(translator, audio=scripted_input(recognizer)) as server,
        connect(ws_url(server)) as writer,
        connect(ws_url(server)) as viewer,
    ):
        await viewer.send(json.dumps({"type": "subscribe", "stream_id": "mic"}))
        await wait_for(lambda: server.role_counts()["viewer"] == 1)
        await writer.send(start())
        for _ in range(8):
            await writer.send(silence(0.05))  # 800 samples a frame
        await writer.send(end())
        messages = await receive_until(writer, lambda m: final_update()(m) and m["segment_id"] == 1)
        viewed = await receive_until(viewer, lambda m: final_update()(m) and m["segment_id"] == 1)
    echoes = [m for m in messages if m["type"] == "partial_transcript"]
    assert [(e["segment_id"], e["seq"], e["text"], e["is_final"]) for e in echoes] == [
        (0, 0, "i will", False),
        (0, 1, "i will meet tom", False),
        (0, 2, "i will meet tom at three", True),
        (1, 3, "tom reads", False),
        (1, 4, "tom reads a book", True),
    ]
    finals = [m for m in messages if m["type"] == "translation_update" and m["is_final"]]
    expected = [t.text for t in translator.translate(
        ["i will meet tom at three", "tom reads a book"], STREAMING.decode
    )]  # fmt: skip
    assert [f["stable_text"] for f in finals] == expected
    assert [f["source_text"] for f in finals] == [echoes[2]["text"], echoes[4]["text"]]
    # Each echo comes before the translation of its seq.
    for echo in echoes:
        at = messages.index(echo)
        replies = [i for i, m in enumerate(messages) if m["seq"] == echo["seq"] and m is not echo]
        assert all(i > at for i in replies)
    # Viewers get the translations, never the echoes.
    assert all(m["type"] == "translation_update" for m in viewed)
    assert [m["stable_text"] for m in viewed if m["is_final"]] == expected


@pytest.mark.anyio
async def test_a_failing_recognizer_is_an_internal_error_and_a_new_start_works(
    translator: Translator,
) -> None:
    failing = Scripted(
        [(1600, said("i will meet tom at three", True)), (3200, said("tom reads", False))],
        fail_after=4800,
    )
    fresh = Scripted([(1600, said("tom reads a book", True))])
    audio = scripted_input(RuntimeError("no model here"), failing, fresh)
    async with serving(translator, audio=audio) as server, connect(ws_url(server)) as ws:
        # A recognizer that cannot even be made: an internal error; the stream may retry.
        await ws.send(start())
        error = (await receive_until(ws, lambda m: m["type"] == "error"))[-1]
        assert (error["code"], error["stream_id"]) == ("internal", "mic")
        assert "could not start (no model here)" in error["message"]
        await wait_for(lambda: server.state.audio.held == 0)
        # One that fails after a final and a partial: the final is answered as usual, the
        # partial shown is made final (kept as it was shown) and answered too.
        await ws.send(start())
        messages: list[dict[str, Any]] = []
        for at in range(3):  # a frame at a time: each call of the recognizer sees one
            await ws.send(silence(0.1))
            if at < 2:
                messages += await receive_until(ws, lambda m: m["type"] == "partial_transcript")
        messages += await receive_all(
            ws,
            lambda m: m["type"] == "error",
            lambda m: final_update()(m) and m["segment_id"] == 1,
        )
        error = next(m for m in messages if m["type"] == "error")
        assert (error["code"], error["stream_id"]) == ("internal", "mic")
        assert "stream 'mic': the recognizer failed at 0.30 s" in error["message"]
        assert "RuntimeError: decoder exploded" in error["message"]
        assert "send start_audio to go on" in error["message"]
        finals = [m for m in messages if final_update()(m)]
        assert [(f["seq"], f["source_text"]) for f in finals] == [
            (0, "i will meet tom at three"),
            (2, "tom reads"),
        ]
        # The audio stream ended: its frames are stray now (said once).
        await ws.send(silence(0.1))
        await ws.send(silence(0.1))
        stray = await receive_until(ws, lambda m: m["type"] == "error")
        assert "no audio stream" in stray[-1]["message"]
        assert await quiet_for(ws, 0.3) == []
        # A new start_audio works, and its numbering goes on from the failed one's.
        await ws.send(start())
        await ws.send(silence(0.1))
        await ws.send(end())
        messages = await receive_until(ws, final_update())
        last = messages[-1]
        assert (last["segment_id"], last["seq"], last["source_text"]) == (2, 3, "tom reads a book")
        assert not [m for m in messages if m["type"] == "error"]


class Slow(Scripted):
    """A recognizer that takes `seconds` over every call (the server is overloaded)."""

    def __init__(self, seconds: float, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = seconds

    def accept(self, pcm: bytes) -> list[SpeechHypothesis]:
        time.sleep(self.seconds)
        return super().accept(pcm)


@pytest.mark.anyio
async def test_recognition_too_far_behind_drops_audio_with_one_error(
    translator: Translator,
) -> None:
    slow = Slow(0.5, [(1600, said("i will meet tom at three", True))])
    audio = scripted_input(slow)
    audio = AudioInput(audio.recognizer, audio.limits, max_backlog_s=0.5)
    async with serving(translator, audio=audio) as server, connect(ws_url(server)) as ws:
        await ws.send(start())
        for _ in range(20):  # 2 s at once: within the speed limit, past the backlog
            await ws.send(silence(0.1))
        messages = await receive_all(ws, lambda m: m["type"] == "error", final_update())
        errors = [m for m in messages if m["type"] == "error"]
        assert [(e["code"], e["stream_id"]) for e in errors] == [("rate_limited", "mic")]
        assert "more than 0.5 s of audio behind" in errors[0]["message"]
        await ws.send(end())
        assert [m for m in await quiet_for(ws, 1.5) if m["type"] == "error"] == []
        assert server.audio is not None
        assert server.audio.stats.dropped_backlog_s == pytest.approx(1.4, abs=0.3)


@pytest.mark.anyio
async def test_a_writer_that_leaves_mid_utterance_still_gets_its_final_to_viewers(
    translator: Translator,
) -> None:
    recognizer = meeting_tom()
    expected = translator.translate(["i will meet tom at three"], STREAMING.decode)[0].text
    async with serving(translator, audio=scripted_input(recognizer)) as server:
        async with connect(ws_url(server)) as viewer:
            await viewer.send(json.dumps({"type": "subscribe", "stream_id": "mic"}))
            await wait_for(lambda: server.role_counts()["viewer"] == 1)
            async with connect(ws_url(server)) as writer:
                await writer.send(start())
                await writer.send(silence(0.2))
                await receive_until(writer, lambda m: m["type"] == "translation_update")
            # Gone without end_audio: the recognizer is flushed, its final goes out.
            viewed = await receive_until(viewer, final_update())
        assert viewed[-1]["stable_text"] == expected
        engine = server.engine
        assert engine is not None
        await wait_for(lambda: server.state.audio.held == 0 and not engine.streams)


@pytest.mark.anyio
async def test_a_stopping_server_translates_what_was_heard_before_it_closes(
    translator: Translator,
) -> None:
    recognizer = meeting_tom()
    expected = translator.translate(["i will meet tom at three"], STREAMING.decode)[0].text
    async with serving(translator, audio=scripted_input(recognizer)) as server:
        writer = await connect(ws_url(server))
        await writer.send(start())
        await writer.send(silence(0.2))
        await receive_until(writer, lambda m: m["type"] == "translation_update")
        await server.shutdown()
        messages: list[dict[str, Any]] = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                messages.append(json.loads(await writer.recv()))
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    finals = [m for m in messages if final_update()(m)]
    assert [f["stable_text"] for f in finals] == [expected]
    assert server.state.audio.held == 0


class Census:
    """Recognizers that exist (being made, or made and not flushed yet), counted across
    the feeds' threads: now and the most at once."""

    def __init__(self, make_s: float) -> None:
        self.make_s = make_s
        self.lock = threading.Lock()
        self.alive = 0
        self.most = 0
        self.made = 0

    def make(self) -> Scripted:
        with self.lock:
            self.alive += 1
            self.most = max(self.most, self.alive)
        time.sleep(self.make_s)  # a recognizer takes a while to make
        with self.lock:
            self.made += 1
        return Counted(self)


class Counted(Scripted):
    def __init__(self, census: Census) -> None:
        super().__init__([])
        self.census = census

    def flush(self) -> list[SpeechHypothesis]:
        with self.census.lock:
            self.census.alive -= 1
        return []


@pytest.mark.anyio
async def test_starting_and_ending_audio_without_audio_never_exceeds_the_caps(
    translator: Translator,
) -> None:
    """Eight connections each send start_audio then end_audio three times, at once, with
    no audio: no more recognizers exist at once than `max_streams`, the starts past
    `max_starting` are refused for now (rate_limited), and every slot comes back."""
    census = Census(0.2)
    limits = AudioLimits(max_streams=3, max_starting=2, max_streams_per_address=0)
    audio = AudioInput(census.make, limits, description="census")
    async with serving(translator, audio=audio) as server, contextlib.AsyncExitStack() as stack:
        sockets = [await stack.enter_async_context(connect(ws_url(server))) for _ in range(8)]
        for _ in range(3):
            for i, ws in enumerate(sockets):
                await ws.send(start(f"s{i}"))
                await ws.send(end(f"s{i}"))
        replies = []
        for ws in sockets:  # each connection's messages are taken in order: once the reply
            await ws.send(end("last"))  # to this one is in, all before it were taken
            replies += await receive_until(ws, lambda m: m.get("stream_id") == "last", 10)
        await wait_for(lambda: server.state.audio.held == 0, 10)
    refusals = [m for m in replies if m["type"] == "error" and m.get("field") == "type"]
    assert {m["code"] for m in refusals} >= {"rate_limited"}
    assert census.made > 0 and census.most <= 3 and census.alive == 0
    assert server.state.audio.starting == 0


@pytest.mark.anyio
async def test_audio_into_another_connections_stream_is_refused_before_a_recognizer_is_made(
    translator: Translator,
) -> None:
    census = Census(0.0)
    audio = AudioInput(census.make, AudioLimits(), description="census")
    async with (
        serving(translator, audio=audio) as server,
        connect(ws_url(server)) as owner,
        connect(ws_url(server)) as other,
    ):
        text = {"type": "partial_transcript", "stream_id": "mic", "segment_id": 0, "seq": 0}
        await owner.send(json.dumps({**text, "text": "hello", "is_final": False}))
        await receive_until(owner, lambda m: m["type"] == "translation_update")
        await other.send(start("mic"))
        refused = await receive_until(other, lambda m: m["type"] == "error")
        assert (refused[-1]["code"], refused[-1]["field"]) == ("forbidden", "stream_id")
        assert "belongs to another connection" in refused[-1]["message"]
        await other.send(silence(0.1))  # no audio stream: a stray frame
        stray = await receive_until(other, lambda m: m["type"] == "error")
        assert "no audio stream" in stray[-1]["message"]
        assert census.made == 0 and server.state.audio.held == 0
        await other.send(start("own"))  # a stream of its own is taken as usual
        await other.send(end("own"))
        await wait_for(lambda: census.made == 1 and server.state.audio.held == 0)


@pytest.mark.anyio
async def test_an_audio_stream_that_sends_nothing_is_ended_and_its_slot_freed(
    translator: Translator,
) -> None:
    silent = meeting_tom()
    fresh = Scripted([(1600, said("tom reads a book", True))])
    audio = scripted_input(silent, fresh, max_streams=1, idle_timeout_s=0.5)
    async with (
        serving(translator, audio=audio) as server,
        connect(ws_url(server)) as ws,
        connect(ws_url(server)) as other,
    ):
        await ws.send(start())
        await ws.send(silence(0.1))  # then nothing
        messages = await receive_all(ws, lambda m: m["type"] == "error", final_update(), timeout=5)
        error = next(m for m in messages if m["type"] == "error")
        assert (error["code"], error["stream_id"]) == ("limit_exceeded", "mic")
        assert "no audio for 0.5 s" in error["message"]
        assert "send start_audio to go on" in error["message"]
        # What it had heard was finished and translated.
        assert [m["source_text"] for m in messages if final_update()(m)] == [
            "i will meet tom at three"
        ]
        await wait_for(lambda: server.state.audio.held == 0)
        # Its slot went back: another speaker gets it.
        await other.send(start("other"))
        await other.send(silence(0.1))
        await other.send(end("other"))
        heard = await receive_until(other, final_update("other"), timeout=5)
        assert heard[-1]["source_text"] == "tom reads a book"
        assert not [m for m in heard if m["type"] == "error"]
        assert server.audio is not None and server.audio.stats.idle_timeouts == 1


@pytest.mark.anyio
async def test_the_per_address_audio_cap_leaves_room_for_other_addresses(
    translator: Translator,
) -> None:
    audio = scripted_input(Scripted([]), Scripted([]), max_streams=4, max_streams_per_address=1)
    async with (
        serving(translator, audio=audio) as server,
        connect(ws_url(server)) as first,
        connect(ws_url(server)) as second,
        connect(ws_url(server), local_addr=("127.0.0.2", 0)) as elsewhere,
    ):
        await first.send(start("a"))
        await wait_for(lambda: server.state.audio.held == 1)
        await second.send(start("b"))
        error = (await receive_until(second, lambda m: m["type"] == "error", timeout=5))[-1]
        assert (error["code"], error["stream_id"]) == ("limit_exceeded", "b")
        assert "your address has 1 audio streams open" in error["message"]
        await elsewhere.send(start("c"))
        await wait_for(lambda: server.state.audio.held == 2)
        assert await quiet_for(elsewhere, 0.3) == []


# --- pocketsphinx on espeak-ng speech -------------------------------------------------------


def needs_speech() -> None:
    pytest.importorskip("pocketsphinx")
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")


def espeak(text: str, voice: str = VOICE) -> tuple[bytes, int]:
    """espeak-ng's own output: 16-bit mono PCM at its rate (22050 Hz)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speech.wav"
        command = ["espeak-ng", "-v", voice, "-w", str(out), text]
        subprocess.run(command, check=True, capture_output=True)
        with wave.open(str(out)) as w:
            return w.readframes(w.getnframes()), w.getframerate()


def spoken(text: str, voice: str = VOICE) -> bytes:
    """`text` spoken, at 16 kHz with silence around it (250 ms before, 600 after, as in
    examples/speech/make_set.py: more than the recognizer's end-of-utterance pause)."""
    pcm, rate = espeak(text, voice)
    return silence(0.25) + resample(pcm, rate, RATE) + silence(0.6)


@pytest.fixture(scope="module")
def sphinx() -> AudioInput:
    needs_speech()
    from engine.asr.sphinx import SphinxOptions
    from engine.server.audio import pocketsphinx_input

    return pocketsphinx_input(
        SphinxOptions(language_model=SPEECH / "fixture.lm.gz", dictionary=SPEECH / "fixture.dict")
    )


def words_right(reference: str, heard: str) -> float:
    ref, got = reference.lower().split(), heard.split()
    return sum(1 for a, b in zip(ref, got, strict=False) if a == b) / len(ref)


async def speak_into(
    ws: ClientConnection, pcm: bytes, rate: int, *, frame_bytes: int, stream: str = "mic"
) -> list[dict[str, Any]]:
    """One audio stream: start, the PCM in frames, end; the messages until its final."""
    await ws.send(start(stream, rate))
    for i in range(0, len(pcm), frame_bytes):
        await ws.send(pcm[i : i + frame_bytes])
    await ws.send(end(stream))
    return await receive_until(ws, final_update(stream))


def check_heard(messages: list[dict[str, Any]], translator: Translator) -> dict[str, Any]:
    """Echoed partials, then one final transcript and its translation; returns the final."""
    echoes = [m for m in messages if m["type"] == "partial_transcript"]
    assert [m for m in messages if m["type"] == "error"] == []
    assert any(not e["is_final"] for e in echoes)  # it showed what it heard as it heard it
    finals = [e for e in echoes if e["is_final"]]
    assert len(finals) == 1
    heard = finals[0]["text"]
    assert words_right(SENTENCE, heard) >= 0.8, heard
    update = messages[-1]
    assert update["source_text"] == heard and update["seq"] == finals[0]["seq"]
    assert update["stable_text"] == translator.translate([heard], STREAMING.decode)[0].text
    assert update["start_ms"] == finals[0]["start_ms"] and update["end_ms"] > update["start_ms"]
    return update


@pytest.mark.anyio
async def test_speech_at_16khz_and_at_22050hz_is_heard_and_translated(
    translator: Translator, sphinx: AudioInput
) -> None:
    pcm = spoken(SENTENCE)
    raw, raw_rate = espeak(SENTENCE)
    assert raw_rate != RATE  # espeak-ng's own rate: the server resamples it
    raw = silence(0.25, raw_rate) + raw + silence(0.6, raw_rate)
    async with serving(translator, audio=sphinx) as server, connect(ws_url(server)) as ws:
        first = check_heard(await speak_into(ws, pcm, RATE, frame_bytes=3200), translator)
        # A second audio stream into the same stream goes on numbering; its frames are
        # cut at odd byte counts (a dangling byte waits for the next frame).
        again = check_heard(await speak_into(ws, pcm, RATE, frame_bytes=3201), translator)
        assert again["source_text"] == first["source_text"]
        assert again["segment_id"] > first["segment_id"] and again["seq"] > first["seq"]
        assert again["start_ms"] > first["end_ms"]  # the stream's audio clock goes on
        resampled = await speak_into(ws, raw, raw_rate, frame_bytes=raw_rate // 5, stream="hifi")
        check_heard(resampled, translator)
        metrics = (await http_get(server, "/metrics")).body
    heard = next(x for x in metrics.splitlines() if 'nmt_audio_seconds_total{kind="heard"}' in x)
    total = 2 * len(pcm) / 2 / RATE + len(raw) / 2 / raw_rate
    assert float(heard.split()[1]) == pytest.approx(total, abs=0.01)
    assert 'nmt_audio_events_total{kind="streams"} 3.0' in metrics
    assert 'nmt_audio_events_total{kind="finals"} 3.0' in metrics
    assert 'nmt_server_messages_received_total{type="audio"}' in metrics


@pytest.mark.anyio
async def test_bad_audio_gets_clear_errors_and_the_connection_carries_on(
    translator: Translator, sphinx: AudioInput
) -> None:
    pcm = spoken(SENTENCE)
    async with serving(translator, audio=sphinx) as server, connect(ws_url(server)) as ws:

        async def error_for(*frames: str | bytes) -> dict[str, Any]:
            for frame in frames:
                await ws.send(frame)
            return (await receive_until(ws, lambda m: m["type"] == "error"))[-1]

        for rate in (4000, 500_000):
            error = await error_for(start(rate=rate))
            assert (error["code"], error["field"]) == ("invalid_message", "sample_rate")
            assert "between 8000 and 192000 Hz" in error["message"]
        error = await error_for('{"type": "start_audio", "stream_id": "mic", "sample_rate": 1.6e4}')
        assert error["field"] == "sample_rate"
        error = await error_for(silence(0.1), silence(0.1), silence(0.1))  # no stream started
        assert error["code"] == "invalid_message" and "send start_audio first" in error["message"]
        assert await quiet_for(ws, 0.3) == []  # the other stray frames: said once
        error = await error_for(start(), start("other"))
        assert error["code"] == "limit_exceeded" and error["stream_id"] == "other"
        error = await error_for(end("other"))
        assert error["code"] == "unknown_stream"
        error = await error_for(partial_message("mic", 0, "typed text"))
        assert error["code"] == "forbidden"
        # Faster than 2x real time for longer than the 6 s burst: the excess is dropped,
        # with one error for the burst.
        for _ in range(12):
            await ws.send(silence(1.0))
        messages = await receive_until(ws, lambda m: m["type"] == "error")
        assert messages[-1]["code"] == "rate_limited" and messages[-1]["stream_id"] == "mic"
        assert await quiet_for(ws, 0.5) == []  # silence: nothing heard, nothing said
        await ws.send(end())
        assert await quiet_for(ws, 0.5) == []
        error = await error_for(silence(0.1))  # after the end: stray again
        assert "no audio stream" in error["message"]
        # And after all that, speech on the same connection is heard and translated.
        check_heard(await speak_into(ws, pcm, RATE, frame_bytes=3200), translator)
        metrics = (await http_get(server, "/metrics")).body
    dropped = next(
        x for x in metrics.splitlines() if 'nmt_audio_seconds_total{kind="dropped_too_fast"}' in x
    )
    assert 5.0 <= float(dropped.split()[1]) <= 6.5


@pytest.mark.anyio
async def test_minutes_of_silence_say_nothing_and_speech_after_them_is_heard(
    translator: Translator,
) -> None:
    needs_speech()
    from engine.asr.sphinx import SphinxOptions
    from engine.server.audio import pocketsphinx_input

    fast = pocketsphinx_input(
        SphinxOptions(language_model=SPEECH / "fixture.lm.gz", dictionary=SPEECH / "fixture.dict")
    )
    # Sent far faster than real time, which the speed limit exists to stop: lifted here.
    fast = AudioInput(fast.recognizer, AudioLimits(max_speed=1000.0, burst_s=600.0), 600.0)
    quiet = (np.random.default_rng(0).normal(0, 30, RATE * 180)).astype("<i2").tobytes()
    async with serving(translator, audio=fast) as server, connect(ws_url(server)) as ws:
        await ws.send(start())
        for i in range(0, len(quiet), 32000):  # three minutes of a quiet room, 1 s a frame
            await ws.send(quiet[i : i + 32000])
        assert await quiet_for(ws, 2.0) == []
        audio = server.audio
        assert audio is not None
        await wait_for(lambda: audio.stats.heard_s >= 179.9, 60)
        pcm = spoken(SENTENCE)
        for i in range(0, len(pcm), 3200):
            await ws.send(pcm[i : i + 3200])
        await ws.send(end())
        messages = await receive_until(ws, final_update())
        check_heard(messages, translator)
        assert messages[-1]["start_ms"] > 180_000  # on the stream's audio clock


# --- serve's options ----------------------------------------------------------------------


def test_recognizer_options_need_asr_and_files_that_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.cli.main import build_parser
    from engine.cli.serve import run_serve

    base = ["serve", "--model", str(FIXTURE_MODEL), "--port", "0"]
    args = build_parser().parse_args([*base, "--lm", str(SPEECH / "fixture.lm.gz")])
    assert run_serve(args) == 2
    assert "--lm is a recognizer option: it needs --asr pocketsphinx" in capsys.readouterr().err
    pytest.importorskip("pocketsphinx")
    args = build_parser().parse_args([*base, "--asr", "pocketsphinx", "--lm", "missing.lm"])
    assert run_serve(args) == 2  # before any model is loaded
    assert "missing.lm: no such file" in capsys.readouterr().err


@pytest.mark.anyio
async def test_serve_asr_takes_speech(translator: Translator) -> None:
    """`nmt-incremental serve --asr pocketsphinx --domain-text FILE`: the log names the
    audio input and the speaker page, and speech sent to it comes back translated."""
    import re
    import signal

    from engine.cli.serve_audio import default_asr_workers
    from tests.conftest import serving as serve

    needs_speech()
    pcm = spoken(SENTENCE)
    args = ["--model", str(FIXTURE_MODEL), "--asr", "pocketsphinx", "--domain-text"]
    with tempfile.TemporaryDirectory() as tmp:
        domain = Path(tmp) / "domain.txt"
        domain.write_text("I will meet Tom at three\nTom reads a book\nI will read\n")
        with serve([*args, str(domain), "--token", "s3cret"], ready_within=60) as served:
            log = served.text
            # The defaults are what its recognition processes serve.
            streams = 12 * default_asr_workers()
            assert (
                f"audio input: pocketsphinx (domain.lm), at most {streams} streams at once "
                f"({streams // 2} per address; ended after 30 s without audio)"
            ) in log, log
            page = re.search(r"speaker page: (http://\S+/speak\?stream=demo) \(add &token=", log)
            assert page, log
            url = page.group(1).replace("http", "ws", 1).split("/speak")[0] + "/ws?token=s3cret"
            async with connect(url) as ws:
                messages = await speak_into(ws, pcm, RATE, frame_bytes=3200)
            assert messages[-1]["source_text"] == "i will meet tom at three"
            assert (
                messages[-1]["stable_text"]
                == translator.translate([SENTENCE], STREAMING.decode)[0].text
            )
            assert "s3cret" not in served.text
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(timeout=30) == 0
