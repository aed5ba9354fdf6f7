"""Recognition in worker processes: `RecognizerPool` runs each audio stream's
`RecognizerStream` in one of N spawned processes, and its cores come off the models'
share of the machine (`engine.cli.args.translation_cores`, `serve --asr-workers`).

First the budget and the command line; then the pool with scripted recognizers (no
pocketsphinx needed: the classes below are pickled to the workers); then pocketsphinx on
the committed espeak-ng WAVs (skipped without it): the same events as in a thread, two
streams in two workers at once, a worker killed mid-stream, close; last a real server.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
import wave
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import ClientConnection, connect

from engine.asr.errors import (
    AudioFormatError,
    PoolClosed,
    RecognizerFailed,
    RemoteError,
    StreamFinished,
    WorkerDied,
)
from engine.asr.pool import PooledStream, RecognizerPool
from engine.asr.recognizer import RecognizerStream, SpeechHypothesis
from engine.decoding.scheduler import SchedulerOptions, Threads
from engine.decoding.targets import Targets, model_share
from protocol import PartialTranscript
from tests.conftest import ROOT

SPEECH = ROOT / "examples" / "speech"
RATE = 16_000
CHUNK = 3200  # 100 ms


# --- the core budget ----------------------------------------------------------------------


def test_recognition_cores_come_off_the_models_share() -> None:
    from engine.cli.args import translation_cores

    assert SchedulerOptions(cores=translation_cores(0, machine=4)).resolved() == Threads(2, 2, 2, 4)
    assert SchedulerOptions(cores=translation_cores(1, machine=4)).resolved() == Threads(2, 1, 1, 3)
    assert SchedulerOptions(cores=translation_cores(1, machine=2)).resolved() == Threads(1, 1, 1, 1)
    # Two models share what recognition leaves: 8 - 2 = 6 cores, 3 each.
    share = model_share(translation_cores(2, machine=8), 2)
    assert SchedulerOptions(cores=share).resolved() == Threads(2, 1, 1, 3)
    assert SchedulerOptions(cores=share, lanes=1).resolved() == Threads(1, 3, 3, 3)
    # The models always keep a core, however many recognizers are asked for.
    assert translation_cores(4, machine=2) == 1
    with pytest.raises(ValueError, match="recognizers must be >= 0"):
        translation_cores(-1)


def test_serve_gives_one_recognition_process_per_four_cores() -> None:
    from engine.cli.serve_audio import default_asr_workers

    assert [default_asr_workers(n) for n in (1, 2, 4, 7, 8, 16, 32)] == [1, 1, 1, 1, 2, 4, 8]
    assert default_asr_workers() == max(1, (os.cpu_count() or 1) // 4)


def serve_args(*extra: str) -> argparse.Namespace:
    from engine.cli.main import build_parser

    return build_parser().parse_args(["serve", "--model", "models/fixture/model", *extra])


def test_asr_workers_reach_the_pool_and_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.cli.args
    from engine.cli.serve_audio import audio_input, default_asr_workers

    with contextlib.ExitStack() as stack:
        with pytest.raises(ValueError, match="--asr-workers is a recognizer option"):
            audio_input(serve_args("--asr-workers", "2"), stack)
        assert audio_input(serve_args(), stack) is None
        pytest.importorskip("pocketsphinx")
        lm = ["--lm", str(SPEECH / "fixture.lm.gz"), "--dict", str(SPEECH / "fixture.dict")]
        given = audio_input(serve_args("--asr", "pocketsphinx", *lm, "--asr-workers", "3"), stack)
        assert given is not None and given.workers == 3
        default = audio_input(serve_args("--asr", "pocketsphinx", *lm), stack)
        assert default is not None and default.workers == default_asr_workers()
        threads = audio_input(serve_args("--asr", "pocketsphinx", *lm, "--asr-workers", "0"), stack)
        assert threads is not None and threads.workers == 0
    loaded: dict[str, object] = {}
    monkeypatch.setattr(Targets, "load", lambda specs, **kw: loaded.update(kw))
    engine.cli.args.load_targets(serve_args(), recognizers=3)
    assert loaded["cores"] == engine.cli.args.translation_cores(3)


# --- scripted recognizers in worker processes ---------------------------------------------


class Counting:
    """A recognizer that says how many whole 100 ms it has heard (a partial each time
    that changes), and the count as its final at flush. Module-level: it pickles."""

    sample_rate = RATE

    def __init__(self, word: str = "tick", fail_at: int | None = None) -> None:
        self.word = word
        self.fail_at = fail_at  # raise once, at this many samples
        self.samples = 0

    def accept(self, pcm: bytes) -> list[SpeechHypothesis]:
        self.samples += len(pcm) // 2
        if self.fail_at is not None and self.samples >= self.fail_at:
            self.fail_at = None
            raise RuntimeError("decoder exploded")
        ticks = self.samples // 1600
        return [SpeechHypothesis(" ".join([self.word] * ticks), False, 0.0, ticks * 100.0)]

    def flush(self) -> list[SpeechHypothesis]:
        ticks = self.samples // 1600
        return [SpeechHypothesis(f"{self.word} x{ticks}", True, 0.0, ticks * 100.0)]


class Odd(Exception):
    """An exception that does not load back from a pickle (its __init__ takes two)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a} and {b}")


class Strange(Counting):
    def accept(self, pcm: bytes) -> list[SpeechHypothesis]:
        raise Odd("this", "that")


class Unmakeable(Counting):
    def __init__(self) -> None:
        raise ValueError("no model here")


class Sleepy(Counting):
    """Takes its time: a call in flight when the worker is killed, or the pool closed."""

    def accept(self, pcm: bytes) -> list[SpeechHypothesis]:
        time.sleep(0.3)
        return super().accept(pcm)


class SlowToMake(Counting):
    """Takes a while to make, as a real recognizer loading its model does."""

    def __init__(self) -> None:
        time.sleep(0.3)
        super().__init__()


def run(stream: RecognizerStream | PooledStream, pcm: bytes) -> list[PartialTranscript]:
    events: list[PartialTranscript] = []
    for i in range(0, len(pcm), CHUNK + 1):  # odd cuts: a dangling byte carried over
        events += stream.accept(pcm[i : i + CHUNK + 1])
    return events + stream.flush()


def tone(seconds: float) -> bytes:
    samples = int(seconds * RATE)
    return (bytes(range(256)) * (samples // 128 + 1))[: samples * 2]


def gone(pid: int) -> bool:
    """No such process: neither running nor a zombie left unreaped (signal 0 reaches
    both)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def counting_pool() -> Iterator[RecognizerPool]:
    with RecognizerPool(Counting, 2) as pool:
        yield pool


def test_a_scripted_stream_gives_the_same_events_in_a_process(
    counting_pool: RecognizerPool,
) -> None:
    pcm = tone(1.25)
    local = RecognizerStream(Counting(), "s", first_segment=3, first_seq=7, offset_ms=500.0)
    remote = counting_pool.open("s", first_segment=3, first_seq=7, offset_ms=500.0)
    try:
        assert run(remote, pcm) == run(local, pcm)
        assert (remote.segment_id, remote.seq) == (local.segment_id, local.seq)
        assert remote.heard_ms == local.heard_ms == 500.0 + 1250.0
        assert remote.cpu_s >= 0.0 and remote.busy_s > 0.0
        with pytest.raises(StreamFinished, match="audio after flush"):
            remote.accept(b"\0\0")
        with pytest.raises(StreamFinished, match="flushed already"):
            remote.flush()
    finally:
        remote.close()
    assert counting_pool.loads == [0, 0]


def test_a_raising_recognizer_fails_as_in_a_thread_and_the_stream_goes_on() -> None:
    pcm = tone(0.5)
    with RecognizerPool(functools.partial(Counting, "word", 4800), 1) as pool:
        remote = pool.open("s")
        local = RecognizerStream(Counting("word", 4800), "s")
        outcomes = []
        for stream in (local, remote):
            got: list[Any] = []
            for i in range(0, len(pcm), CHUNK):
                try:
                    got += stream.accept(pcm[i : i + CHUNK])
                except RecognizerFailed as exc:
                    assert isinstance(exc.__cause__, RuntimeError)
                    got.append((str(exc), str(exc.__cause__), exc.events))
            outcomes.append(got + stream.flush())
        assert outcomes[0] == outcomes[1]
        assert any(isinstance(x, tuple) and "decoder exploded" in x[1] for x in outcomes[1])
        remote.close()
        # An exception that cannot come back as itself comes back as its type and text.
        with RecognizerPool(Strange, 1) as strange:
            stream = strange.open("odd")
            with pytest.raises(RecognizerFailed) as failed:
                stream.accept(b"\0\0")
            assert isinstance(failed.value.__cause__, RemoteError)
            assert str(failed.value.__cause__) == "Odd: this and that"
            stream.close()


def test_what_cannot_open_says_why_and_frees_its_slot(counting_pool: RecognizerPool) -> None:
    with pytest.raises(AudioFormatError, match=r"outside 8000\.\.192000"):
        counting_pool.open("s", sample_rate=4000)
    assert counting_pool.loads == [0, 0]
    with RecognizerPool(Unmakeable, 1) as pool:
        with pytest.raises(ValueError, match="no model here"):
            pool.open("s")
        assert pool.loads == [0]
    with pytest.raises(ValueError, match="must pickle"):
        RecognizerPool(lambda: Counting(), 1)
    with pytest.raises(ValueError, match="at least one worker"):
        RecognizerPool(Counting, 0)


def test_streams_go_to_the_least_loaded_worker(counting_pool: RecognizerPool) -> None:
    streams = [counting_pool.open(f"s{i}") for i in range(3)]
    assert counting_pool.loads == [2, 1]
    assert streams[0].worker_pid == streams[2].worker_pid != streams[1].worker_pid
    streams[0].close()
    streams[0].close()  # idempotent
    assert counting_pool.loads == [1, 1]
    # Interleaved on a shared worker, each stream keeps its own recognizer.
    pcm = tone(0.5)
    assert run(streams[2], pcm) == run(RecognizerStream(Counting(), "s2"), pcm)
    for stream in streams[1:]:
        stream.close()
    assert counting_pool.loads == [0, 0]


def test_new_streams_take_turns_with_the_running_streams_audio() -> None:
    """Recognizers are made one at a time per worker, each sent once the one before is
    answered: audio of a running stream sent while five streams wait to open is answered
    behind at most one of them, not behind all five."""
    with RecognizerPool(SlowToMake, 1) as pool:
        running = pool.open("speaker")
        opened: list[PooledStream] = []
        lock = threading.Lock()

        def open_one(i: int) -> None:
            stream = pool.open(f"new{i}")
            with lock:
                opened.append(stream)

        openers = [threading.Thread(target=open_one, args=(i,)) for i in range(5)]
        for opener in openers:
            opener.start()
        deadline = time.monotonic() + 5
        while pool.opening != [5] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.opening == [5]  # one being made, four waiting their turn
        events = running.accept(tone(0.1))
        with lock:
            made_before = len(opened)
        assert events == RecognizerStream(Counting(), "speaker").accept(tone(0.1))
        assert made_before <= 1
        for opener in openers:
            opener.join(10)
        assert len(opened) == 5 and pool.opening == [0]
        for stream in [running, *opened]:
            stream.close()
        assert pool.loads == [0]


def test_open_turns_send_one_open_at_a_time_in_order() -> None:
    from engine.asr.pool import OpenTurns
    from engine.asr.worker import Accept, Open

    turns = OpenTurns()
    opens = [Open(k, f"s{k}", None, 0, 0, 0.0) for k in range(3)]
    assert turns.submit(0, opens[0])  # none in flight: sent
    assert not turns.submit(1, opens[1]) and not turns.submit(2, opens[2])
    assert turns.submit(3, Accept(9, b"\0\0"))  # audio never waits for opens
    assert len(turns) == 3
    assert turns.answered(3) is None  # an answer to audio turns nothing
    assert turns.answered(0) == (1, opens[1])
    assert turns.answered(1) == (2, opens[2])
    assert turns.answered(2) is None and len(turns) == 0


def test_workers_ignore_the_signals_a_terminal_or_service_manager_sends_the_group(
    counting_pool: RecognizerPool,
) -> None:
    """Ctrl-C (SIGINT) and a service manager's SIGTERM reach every process of the group:
    the workers stay, so that a draining server can still flush its streams."""
    streams = [counting_pool.open(f"s{i}") for i in range(2)]  # both workers serving
    for stream in streams:
        assert stream.worker_pid is not None
        os.kill(stream.worker_pid, signal.SIGINT)
        os.kill(stream.worker_pid, signal.SIGTERM)
    time.sleep(0.2)
    pcm = tone(0.3)
    for stream in streams:
        assert run(stream, pcm) == run(RecognizerStream(Counting(), stream.stream_id), pcm)
        stream.close()
    assert counting_pool.alive == 2 and counting_pool.lost == 0


def test_a_closed_pool_ends_calls_in_flight_and_leaves_no_process() -> None:
    pool = RecognizerPool(Sleepy, 2)
    pool.start()
    pids = pool.pids
    assert len(pids) == 2 and all(not gone(pid) for pid in pids)
    stream = pool.open("s")
    result: list[BaseException] = []

    def feed() -> None:
        try:
            for _ in range(50):
                stream.accept(b"\0" * CHUNK)
        except RecognizerFailed as exc:
            result.append(exc)

    caller = threading.Thread(target=feed)
    caller.start()
    time.sleep(0.5)
    pool.close(timeout=0.5)  # the worker answers the call it is in, then stops
    caller.join(10)
    assert not caller.is_alive()
    assert isinstance(result[0].__cause__, WorkerDied)
    assert "stopped: the recognition pool was closed" in str(result[0].__cause__)
    assert all(gone(pid) for pid in pids)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]
    with pytest.raises(PoolClosed):
        pool.open("t")
    pool.close()  # idempotent


# --- pocketsphinx on the spoken test set ---------------------------------------------------


def read_wav(name: str) -> bytes:
    with wave.open(str(SPEECH / "wav" / name)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, RATE)
        pcm: bytes = w.readframes(w.getnframes())
        return pcm


def sphinx_factory() -> Any:
    pytest.importorskip("pocketsphinx", reason="the [asr] extra (pocketsphinx) is missing")
    from engine.asr.sphinx import SphinxOptions, SphinxRecognizer

    options = SphinxOptions(
        language_model=SPEECH / "fixture.lm.gz", dictionary=SPEECH / "fixture.dict"
    )
    return functools.partial(SphinxRecognizer, options)


@pytest.fixture(scope="module")
def sphinx_pool() -> Iterator[RecognizerPool]:
    with RecognizerPool(sphinx_factory(), 2) as pool:
        yield pool


WAVS = ("01-en-us-klatt2.wav", "02-en-gb-x-rp-klatt2.wav")


def in_thread(name: str) -> list[PartialTranscript]:
    return run(RecognizerStream(sphinx_factory()(), name), read_wav(name))


def test_pocketsphinx_in_a_process_gives_the_events_of_a_thread(
    sphinx_pool: RecognizerPool,
) -> None:
    name = WAVS[0]
    expected = in_thread(name)
    assert expected[-1].is_final and expected[-1].text == "does tom draw a horse"
    stream = sphinx_pool.open(name)
    try:
        assert run(stream, read_wav(name)) == expected
        assert stream.cpu_s > 0.0
    finally:
        stream.close()


def test_two_streams_in_two_workers_at_once(sphinx_pool: RecognizerPool) -> None:
    expected = {name: in_thread(name) for name in WAVS}
    streams = {name: sphinx_pool.open(name) for name in WAVS}
    assert len({s.worker_pid for s in streams.values()}) == 2
    got: dict[str, list[PartialTranscript]] = {}

    def speak(name: str) -> None:
        got[name] = run(streams[name], read_wav(name))

    threads = [threading.Thread(target=speak, args=(name,)) for name in WAVS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for stream in streams.values():
        stream.close()
    assert got == expected


def test_a_killed_worker_fails_its_stream_clearly_and_the_others_carry_on() -> None:
    factory = sphinx_factory()
    survivor_wav, victim_wav = read_wav(WAVS[1]), read_wav(WAVS[0])
    expected = in_thread(WAVS[1])
    pool = RecognizerPool(factory, 2)
    pool.start()
    first = pool.pids
    victim, survivor = pool.open("victim"), pool.open(WAVS[1])
    assert victim.worker_pid != survivor.worker_pid
    shown: list[PartialTranscript] = []
    heard: list[PartialTranscript] = []
    at = 0
    while not shown:  # until the victim has shown words
        shown += victim.accept(victim_wav[at : at + CHUNK])
        heard += survivor.accept(survivor_wav[at : at + CHUNK])
        at += CHUNK
    assert victim.worker_pid is not None
    os.kill(victim.worker_pid, signal.SIGKILL)
    with pytest.raises(RecognizerFailed) as failed:
        victim.accept(victim_wav[at : at + CHUNK])
    cause = failed.value.__cause__
    assert isinstance(cause, WorkerDied)
    assert f"pid {victim.worker_pid}) died: killed by SIGKILL" in str(cause)
    # What it showed last is its segment's final, numbered on, as a raising recognizer's.
    last = shown[-1]
    assert [(e.text, e.is_final, e.seq, e.segment_id) for e in failed.value.events] == [
        (last.text, True, last.seq + 1, last.segment_id)
    ]
    assert (victim.segment_id, victim.seq) == (last.segment_id + 1, last.seq + 2)
    with pytest.raises(RecognizerFailed):  # and it stays failed
        victim.flush()
    assert (pool.lost, pool.alive) == (1, 1)
    victim.close()
    # The other worker's stream never noticed.
    for i in range(at, len(survivor_wav), CHUNK):
        heard += survivor.accept(survivor_wav[i : i + CHUNK])
    heard += survivor.flush()
    survivor.close()
    assert heard == expected
    # A new stream gets a replacement worker.
    again = pool.open(WAVS[0])
    assert again.worker_pid not in first and pool.lost == 1
    assert run(again, victim_wav)[-1].text == "does tom draw a horse"
    again.close()
    everyone = {*first, *pool.pids}
    pool.close()
    assert all(gone(pid) for pid in everyone)


@pytest.mark.anyio
async def test_a_dead_workers_streams_log_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    """Streams running and streams still starting on a worker that is killed: its death
    is logged once, then one line per stream, none with a traceback (each would show the
    same wait on the pipe)."""
    from engine.server.audio import AudioInput, AudioService, Clock
    from engine.server.limits import AudioLimits

    service = AudioService(
        AudioInput(SlowToMake, AudioLimits(max_streams=8, max_starting=8), workers=1)
    )
    await service.start()
    assert service.pool is not None

    async def deliver(events: list[PartialTranscript]) -> None:
        pass

    feeds = [service.feed(f"s{i}", RATE, deliver) for i in range(6)]
    try:
        async with anyio.create_task_group() as tg:
            for feed in feeds:
                tg.start_soon(feed.run, Clock())
                feed.put(bytes(3200))
            await wait(lambda: service.pool is not None and service.pool.loads == [6])
            await wait(lambda: service.pool is not None and service.pool.opening[0] <= 4)
            caplog.clear()
            os.kill(service.pool.pids[0], signal.SIGKILL)
            for feed in feeds:
                feed.put(bytes(3200))  # the running ones call their dead worker
    finally:
        await service.aclose()
    assert all(feed.error is not None and feed.error.code == "internal" for feed in feeds)
    records = [r for r in caplog.records if r.levelno >= logging.ERROR]
    died = [r for r in records if r.name == "engine.asr.pool"]
    assert len(died) == 1 and "killed by SIGKILL" in died[0].getMessage()
    per_stream = [r for r in records if r.name == "engine.server.audio"]
    assert sorted(r.getMessage().split("'")[1] for r in per_stream) == [f"s{i}" for i in range(6)]
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]
    started = [r for r in per_stream if "could not start" in r.getMessage()]
    assert started  # some were still waiting for their recognizer


# --- a server recognizing in worker processes ---------------------------------------------


def start(stream: str) -> str:
    return json.dumps({"type": "start_audio", "stream_id": stream, "sample_rate": RATE})


async def messages_until(ws: ClientConnection, done: Any, timeout: float = 30.0) -> list[Any]:
    seen: list[dict[str, Any]] = []
    with anyio.fail_after(timeout):
        while not seen or not done(seen[-1]):
            seen.append(json.loads(await ws.recv()))
    return seen


def final_update(stream: str) -> Any:
    return lambda m: (
        m["type"] == "translation_update" and m["stream_id"] == stream and m["is_final"]
    )


@pytest.mark.anyio
async def test_a_server_recognizes_in_worker_processes_and_survives_a_killed_one() -> None:
    from engine.asr.sphinx import SphinxOptions
    from engine.decoding.translator import Translator
    from engine.server.audio import pocketsphinx_input
    from tests.conftest import FIXTURE_MODEL, needs_fixture
    from tests.live_server import http_get, serving

    needs_fixture()
    sphinx_factory()
    options = SphinxOptions(
        language_model=SPEECH / "fixture.lm.gz", dictionary=SPEECH / "fixture.dict"
    )
    translator = Translator.from_dir(FIXTURE_MODEL)
    a_wav, b_wav = read_wav(WAVS[0]), read_wav(WAVS[1])
    audio = pocketsphinx_input(options, workers=2)
    async with serving(translator, audio=audio) as server:
        assert server.audio is not None and server.audio.pool is not None
        pool = server.audio.pool
        pids = pool.pids
        assert len(pids) == 2
        url = f"ws://127.0.0.1:{server.port}/ws"
        async with connect(url) as a, connect(url) as b:
            await a.send(start("a"))  # the first stream: worker 0
            at = 0
            seen_a: list[dict[str, Any]] = []
            while not any(m["type"] == "partial_transcript" for m in seen_a):
                await a.send(a_wav[at : at + CHUNK])
                at += CHUNK
                with anyio.move_on_after(0.2):
                    seen_a.append(json.loads(await a.recv()))
            await b.send(start("b"))  # the second: worker 1, the least loaded
            await b.send(b_wav[: len(b_wav) // 2])
            await wait(lambda: pool.loads == [1, 1])
            os.kill(pids[0], signal.SIGKILL)
            await a.send(a_wav[at : at + CHUNK])
            failed = await messages_until(a, lambda m: m["type"] == "error")
            error = failed[-1]
            assert (error["code"], error["stream_id"]) == ("internal", "a")
            assert (
                f"WorkerDied: recognition worker 0 (pid {pids[0]}) died: killed by SIGKILL"
                in (error["message"])
            )
            assert "send start_audio to go on" in error["message"]
            # B, on the other worker, goes on to its translation.
            await b.send(b_wav[len(b_wav) // 2 :])
            await b.send(json.dumps({"type": "end_audio", "stream_id": "b"}))
            got_b = await messages_until(b, final_update("b"))
            assert got_b[-1]["source_text"] == in_thread(WAVS[1])[-1].text
            assert not [m for m in got_b if m["type"] == "error"]
            # A starts again, on a new worker, and its numbering goes on.
            await a.send(start("a"))
            for i in range(0, len(a_wav), CHUNK):
                await a.send(a_wav[i : i + CHUNK])
            await a.send(json.dumps({"type": "end_audio", "stream_id": "a"}))
            got_a = await messages_until(
                a, lambda m: final_update("a")(m) and m["source_text"] == "does tom draw a horse"
            )
            assert not [m for m in got_a if m["type"] == "error"]
            assert got_a[-1]["segment_id"] >= 1
        metrics = (await http_get(server, "/metrics")).body
        assert "nmt_audio_recognizer_processes 2.0" in metrics
        assert 'nmt_audio_events_total{kind="recognizer_processes_lost"} 1.0' in metrics
        everyone = {*pids, *pool.pids}
    assert all(gone(pid) for pid in everyone)  # the server's shutdown stopped them all


async def wait(condition: Any, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.01)
