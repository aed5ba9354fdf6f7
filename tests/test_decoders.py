"""A process's pocketsphinx decoders (`engine.asr.sphinx.Decoders`): shared and reused
across audio streams, so that the memory a recognition process holds follows its open
streams, and a decoder reused or sharing its language model hears what a fresh one
hears."""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Any

import pytest

from engine.asr import worker
from engine.asr.recognizer import RecognizerStream, SpeechHypothesis
from engine.asr.worker import Accept, Drop, Flush, Open

ROOT = Path(__file__).resolve().parents[1]
WAVS = sorted((ROOT / "examples" / "speech" / "wav").glob("*.wav"))


def pcm(index: int, seconds: float | None = None) -> bytes:
    with wave.open(str(WAVS[index])) as w:
        data: bytes = w.readframes(w.getnframes())
    return data if seconds is None else data[: int(seconds * 16000) * 2]


def heard(recognizer: Any, audio: bytes) -> list[tuple[str, bool]]:
    """Every hypothesis, fed in 100 ms chunks, then the flush's."""
    out: list[SpeechHypothesis] = []
    for at in range(0, len(audio), 3200):
        out += recognizer.accept(audio[at : at + 3200])
    out += recognizer.flush()
    return [(h.text, h.is_final) for h in out]


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        pytest.skip("no /proc here")
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_decoders_sharing_a_model_or_reused_hear_what_fresh_ones_hear() -> None:
    pytest.importorskip("pocketsphinx")
    from engine.asr.sphinx import Decoders, SphinxOptions, SphinxRecognizer

    options = SphinxOptions()  # the general en-US model: its language model is shared
    first, second = pcm(0), pcm(2)
    fresh = [heard(SphinxRecognizer(options, Decoders()), audio) for audio in (first, second)]
    assert all(any(final for _, final in h) for h in fresh)

    decoders = Decoders()
    a, b = SphinxRecognizer(options, decoders), SphinxRecognizer(options, decoders)
    assert decoders.made == 2
    got: dict[int, list[SpeechHypothesis]] = {0: [], 1: []}
    for at in range(0, max(len(first), len(second)), 3200):  # in turns, as a worker serves
        got[0] += a.accept(first[at : at + 3200])
        got[1] += b.accept(second[at : at + 3200])
    got[0] += a.flush()
    got[1] += b.flush()
    assert [[(h.text, h.is_final) for h in got[i]] for i in (0, 1)] == fresh

    a.close()  # its decoder, having heard a speaker, goes to the next stream
    again = SphinxRecognizer(options, decoders)
    assert decoders.made == 2 and decoders.idle() == 0
    assert heard(again, second) == fresh[1]


def test_ended_streams_give_their_memory_back() -> None:
    pytest.importorskip("pocketsphinx")
    from engine.asr.memory import release_memory
    from engine.asr.sphinx import Decoders, SphinxOptions, SphinxRecognizer

    options = SphinxOptions()
    decoders = Decoders(keep_idle=1)
    SphinxRecognizer(options, decoders).close()  # the shared model loaded, one idle
    release_memory()
    before = rss_mb()
    recognizers = [SphinxRecognizer(options, decoders) for _ in range(5)]
    for recognizer in recognizers:
        recognizer.accept(pcm(1, 1.0))
    during = rss_mb() - before
    assert decoders.made == 5  # four new, one reused
    for recognizer in recognizers:
        recognizer.close()  # mid-utterance or not: it leaves it
    after = rss_mb() - before
    assert decoders.idle() == 1
    assert during > 4 * 30  # tens of MB per decoder
    assert after < during / 4, (during, after)  # four decoders' memory went back


class Closing:
    """A recognizer that says when it is closed."""

    sample_rate = 16_000
    closed = 0

    def accept(self, pcm: bytes) -> list[SpeechHypothesis]:
        return [SpeechHypothesis("hello", False, 0.0, 100.0)]

    def flush(self) -> list[SpeechHypothesis]:
        return []

    def close(self) -> None:
        Closing.closed += 1


def test_a_worker_closes_the_recognizer_of_a_stream_flushed_or_dropped() -> None:
    Closing.closed = 0
    streams: dict[int, RecognizerStream] = {}
    for key in (1, 2):
        worker.handle(streams, Closing, Open(key, f"s{key}", None, 0, 0, 0.0))
        worker.handle(streams, Closing, Accept(key, b"\0" * 3200))
    assert Closing.closed == 0
    worker.handle(streams, Closing, Flush(1))
    assert Closing.closed == 1
    worker.handle(streams, Closing, Drop(2))
    assert Closing.closed == 2 and not streams
    stream = RecognizerStream(Closing(), "s")
    stream.close()
    stream.close()
    assert Closing.closed == 3  # once


class Hog:
    """A recognizer that holds 40 MB (touched) while its stream is open; module-level:
    it pickles, for `measure`'s process."""

    sample_rate = 16_000

    def __init__(self) -> None:
        self.held = bytearray(b"x" * (40 * 2**20))

    def accept(self, pcm: bytes) -> list[SpeechHypothesis]:
        return []

    def flush(self) -> list[SpeechHypothesis]:
        return []


def test_a_recognizers_memory_is_measured_and_caps_a_process_streams() -> None:
    from engine.asr.memory import StreamMemory, measure

    cost = measure(Hog)
    if cost is None:
        pytest.skip("no /proc here")
    assert 38 <= cost.per_stream <= 44, cost
    assert cost.base < 200 and cost.shared < 10, cost
    made_up = StreamMemory(base=60.0, shared=40.0, per_stream=80.0)
    assert made_up.streams_within(1000) == 11  # (1000 - 100) / 80
    assert made_up.streams_within(1000, idle=2) == 9
    assert made_up.streams_within(150) == 0
    assert made_up.needs(1, idle=2) == 340.0


def test_asr_memory_caps_the_audio_streams_per_process(tmp_path: Path) -> None:
    import argparse
    import contextlib

    from engine.cli.main import build_parser
    from engine.cli.serve_audio import audio_input
    from engine.server.limits import AUDIO_STREAMS_PER_WORKER

    def args(*extra: str) -> argparse.Namespace:
        # A model directory that names no recognizer data of its own (the fixture's
        # recognizer.json names its small domain model): the general model is measured.
        return build_parser().parse_args(["serve", "--model", str(tmp_path), *extra])

    with contextlib.ExitStack() as stack:
        with pytest.raises(ValueError, match="--asr-memory is a recognizer option"):
            audio_input(args("--asr-memory", "500"), stack)
        pytest.importorskip("pocketsphinx")
        general = ["--asr", "pocketsphinx", "--asr-workers", "2"]
        with pytest.raises(ValueError, match=r"one audio stream needs [0-9]+ MB"):
            audio_input(args(*general, "--asr-memory", "100"), stack)
        # About 80 MB a stream with the general model: 600 MB hold a few, not 12.
        capped = audio_input(args(*general, "--asr-memory", "600"), stack)
        assert capped is not None
        assert 2 * 2 <= capped.limits.max_streams <= 2 * 6, capped.limits
        speech = ROOT / "examples" / "speech"
        domain = ["--lm", str(speech / "fixture.lm.gz"), "--dict", str(speech / "fixture.dict")]
        small = audio_input(args(*general, *domain, "--asr-memory", "600"), stack)
        assert small is not None and small.limits.max_streams == 2 * AUDIO_STREAMS_PER_WORKER


class Tracked:
    """A recognizer that notes whether it is closed, and whether a call was running then."""

    sample_rate = 16_000

    def __init__(self, call_s: float = 0.0) -> None:
        self.call_s = call_s
        self.calling = False
        self.closed = False
        self.closed_mid_call = False

    def accept(self, pcm: bytes) -> list[SpeechHypothesis]:
        import time

        self.calling = True
        time.sleep(self.call_s)
        self.calling = False
        return [SpeechHypothesis("hello", False, 0.0, 100.0)]

    def flush(self) -> list[SpeechHypothesis]:
        return [SpeechHypothesis("hello there", True, 0.0, 200.0)]

    def close(self) -> None:
        self.closed = True
        self.closed_mid_call = self.calling


@pytest.mark.anyio
async def test_a_feed_closes_its_recognizer_when_done_but_never_under_a_running_call() -> None:
    import anyio

    from engine.server.audio import AudioInput, AudioService, Clock
    from protocol import PartialTranscript

    made: list[Tracked] = []

    def make() -> Tracked:
        made.append(Tracked(call_s=0.0 if not made else 0.5))
        return made[-1]

    service = AudioService(AudioInput(make))

    async def deliver(events: list[PartialTranscript]) -> None:
        pass

    ended = service.feed("a", 16_000, deliver)
    ended.put(bytes(3200))
    ended.finish()
    await ended.run(Clock())
    assert made[0].closed and not made[0].closed_mid_call

    cut = service.feed("b", 16_000, deliver)
    async with anyio.create_task_group() as tg:
        tg.start_soon(cut.run, Clock())
        cut.put(bytes(3200))
        while not (len(made) == 2 and made[1].calling):
            await anyio.sleep(0.01)
        cut.cut()  # the call is abandoned: its recognizer is left to it
    assert not made[1].closed
    await anyio.sleep(0.7)
    assert not made[1].closed_mid_call and not made[1].closed


class Exploding:
    """A decoder that raises while it decodes (the rest is the real one's)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def process_raw(self, *args: Any) -> None:
        raise RuntimeError("decoder exploded")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_decoder_that_raised_is_not_given_to_another_stream() -> None:
    pytest.importorskip("pocketsphinx")
    from engine.asr.sphinx import Decoders, SphinxOptions, SphinxRecognizer

    speech = ROOT / "examples" / "speech"
    options = SphinxOptions(
        language_model=speech / "fixture.lm.gz", dictionary=speech / "fixture.dict"
    )
    decoders = Decoders()
    healthy, broken = SphinxRecognizer(options, decoders), SphinxRecognizer(options, decoders)
    broken._decoder = Exploding(broken._decoder)
    with pytest.raises(RuntimeError, match="exploded"):
        broken.accept(pcm(0))
    healthy.accept(pcm(0, 1.0))
    broken.close()
    assert decoders.idle() == 0
    healthy.close()
    assert decoders.idle() == 1
