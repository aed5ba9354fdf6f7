"""The recognizer seam (`engine.asr.recognizer`) with scripted recognizers, its
resampler, and pocketsphinx (`engine.asr`) on sentences spoken by espeak-ng."""

from __future__ import annotations

import io
import itertools
import logging
import math
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import numpy as np
import numpy.typing as npt
import pytest

from engine.asr.audio import Backlog, RawSource, Resampler, check_rate, paced_chunks, resample
from engine.asr.errors import AudioFormatError, RecognizerFailed, StreamFinished
from engine.asr.recognizer import RecognizerStream, SpeechHypothesis
from engine.asr.transcriber import Transcriber
from engine.decoding.translator import Translator
from engine.streaming.controller import IncrementalTranslator
from protocol import ErrorMessage, PartialTranscript, TranslationUpdate
from tests.conftest import ROOT

SPEECH = ROOT / "examples" / "speech"


def pcm(samples: int, value: int = 1000) -> bytes:
    return np.full(samples, value, dtype="<i2").tobytes()


class Scripted:
    """A recognizer that says `plan[i][1]` once it has been given `plan[i][0]` samples,
    and records the audio it got."""

    def __init__(
        self,
        plan: Sequence[tuple[int, SpeechHypothesis]],
        *,
        rate: int = 16_000,
        at_flush: Sequence[SpeechHypothesis] = (),
        fail_at_call: int | None = None,
    ) -> None:
        self.plan = list(plan)
        self.sample_rate = rate
        self.at_flush = list(at_flush)
        self.fail_at_call = fail_at_call
        self.calls = 0
        self.audio = bytearray()
        self.flushed = False

    def accept(self, data: bytes) -> list[SpeechHypothesis]:
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise RuntimeError("decoder exploded")
        assert len(data) % 2 == 0, "the seam hands over whole samples only"
        self.audio += data
        heard = len(self.audio) // 2
        out = [h for at, h in self.plan if at <= heard]
        self.plan = [(at, h) for at, h in self.plan if at > heard]
        return out

    def flush(self) -> list[SpeechHypothesis]:
        self.flushed = True
        return self.at_flush


def hyp(
    text: str, final: bool, start: float, end: float, stable: int | None = None
) -> SpeechHypothesis:
    return SpeechHypothesis(text, final, start, end, stable)


# -- events ---------------------------------------------------------------------------


def test_hypotheses_become_numbered_timed_events() -> None:
    rec = Scripted(
        [
            (1600, hyp("i", False, 100, 300)),
            (3200, hyp("i will", False, 100, 500, stable=1)),
            (4800, hyp(" i  will ", False, 100, 600)),  # the same words again: dropped
            (6400, hyp("i will meet tom", True, 100, 900)),
            (8000, hyp("", False, 1200, 1250)),  # nothing heard yet: no event
            (9600, hyp("tom", False, 1200, 1400)),
            (11200, hyp("tom reads", True, 1200, 1600)),
        ]
    )
    stream = RecognizerStream(rec, "mic", first_segment=5, first_seq=10, offset_ms=1000)
    events: list[PartialTranscript] = []
    for _ in range(7):
        events += stream.accept(pcm(1600))
    events += stream.flush()
    assert [(e.segment_id, e.seq, e.text, e.is_final) for e in events] == [
        (5, 10, "i", False),
        (5, 11, "i will", False),
        (5, 12, "i will meet tom", True),
        (6, 13, "tom", False),
        (6, 14, "tom reads", True),
    ]
    assert all(e.stream_id == "mic" for e in events)
    assert [(e.start_ms, e.end_ms) for e in events] == [
        (1100, 1300), (1100, 1500), (1100, 1900), (2200, 2400), (2200, 2600),
    ]  # fmt: skip
    assert events[1].stable_chars == 1 and events[2].stable_chars is None
    assert stream.heard_ms == 1000 + 7 * 100
    assert rec.flushed and stream.finished


def test_a_shown_segment_always_ends_with_one_final() -> None:
    """An utterance the recognizer ends with no words after showing some keeps the words
    it showed last (a final cannot be empty); one it never showed gives nothing."""
    rec = Scripted(
        [
            (10, hyp("tom", False, 0, 100)),
            (20, hyp("", True, 0, 200)),
            (30, hyp("", True, 300, 400)),
            (40, hyp("mary", False, 500, 600)),
        ]
    )
    stream = RecognizerStream(rec, "s")
    events = [e for _ in range(4) for e in stream.accept(pcm(10))]
    events += stream.flush()  # the recognizer owed a final for "mary": the seam makes it
    assert [(e.segment_id, e.text, e.is_final) for e in events] == [
        (0, "tom", False),
        (0, "tom", True),
        (1, "mary", False),
        (1, "mary", True),
    ]
    assert (events[3].start_ms, events[3].end_ms) == (500, 600)


def test_odd_byte_counts_carry_a_dangling_byte_over() -> None:
    """Audio cut anywhere (a pipe's reads) reaches the recognizer as the same samples."""
    audio = np.arange(-500, 500, dtype="<i2").tobytes()
    rec = Scripted([])
    stream = RecognizerStream(rec, "s")
    cuts = [0, 1, 4, 7, 8, 333, 1001, len(audio)]
    for a, b in itertools.pairwise(cuts):
        stream.accept(audio[a:b])
    stream.accept(b"")
    stream.flush()
    assert bytes(rec.audio) == audio
    assert stream.dropped_bytes == 0


def test_a_dangling_byte_at_the_end_is_dropped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = Scripted([])
    stream = RecognizerStream(rec, "s")
    stream.accept(b"\x01\x02\x03")
    with caplog.at_level(logging.WARNING):
        stream.flush()
    assert bytes(rec.audio) == b"\x01\x02"
    assert stream.dropped_bytes == 1
    assert "ended inside a sample" in caplog.text


@pytest.mark.parametrize(
    ("rate", "says"),
    [
        (0, "outside 8000..192000"),
        (4000, "outside 8000..192000"),
        (1_411_200, "not bytes per second"),
        (16000.5, "whole number"),
        (math.nan, "whole number"),
        ("16000", "number of Hz, got str"),
        (True, "number of Hz, got bool"),
    ],
)
def test_unknown_or_absurd_rates_are_refused(rate: object, says: str) -> None:
    with pytest.raises(AudioFormatError, match=says):
        check_rate(rate)
    with pytest.raises(AudioFormatError, match=says):
        RecognizerStream(Scripted([]), "s", sample_rate=rate)  # type: ignore[arg-type]


def test_audio_after_flush_and_bad_types_are_refused() -> None:
    stream = RecognizerStream(Scripted([]), "s")
    with pytest.raises(AudioFormatError, match="bytes of 16-bit mono PCM, got str"):
        stream.accept("hello")  # type: ignore[arg-type]
    stream.accept(pcm(10))
    stream.flush()
    with pytest.raises(StreamFinished, match="audio after flush"):
        stream.accept(pcm(10))
    with pytest.raises(StreamFinished, match="flushed already"):
        stream.flush()


def test_a_recognizer_that_raises_fails_clearly_and_the_stream_goes_on() -> None:
    rec = Scripted(
        [
            (100, hyp("i will", False, 0, 50)),
            (400, hyp("tom reads", False, 300, 350)),
            (500, hyp("tom reads a book", True, 300, 450)),
        ],
        fail_at_call=2,
    )
    stream = RecognizerStream(rec, "s")
    first = stream.accept(pcm(100))
    with pytest.raises(
        RecognizerFailed, match=r"failed at 0\.01 s of audio; the stream goes on"
    ) as err:
        stream.accept(pcm(100))
    assert isinstance(err.value.__cause__, RuntimeError)
    # What was shown is made final, so no viewer keeps a line that never ends.
    assert [(e.segment_id, e.text, e.is_final) for e in first + err.value.events] == [
        (0, "i will", False),
        (0, "i will", True),
    ]
    later = stream.accept(pcm(400)) + stream.flush()
    assert [(e.segment_id, e.seq, e.text, e.is_final) for e in later] == [
        (1, 2, "tom reads", False),
        (1, 3, "tom reads a book", True),
    ]


def test_a_hypothesis_no_event_can_carry_is_a_recognizer_failure() -> None:
    rec = Scripted([(1, SpeechHypothesis("x", False, -5e20, math.inf))])
    stream = RecognizerStream(rec, "s")
    with pytest.raises(RecognizerFailed) as err:
        stream.accept(pcm(1))
    assert "not a valid event" in str(err.value.__cause__)


# -- resampling -----------------------------------------------------------------------


def sine(
    rate: int, seconds: float, hz: float = 1000.0, amplitude: float = 10_000
) -> npt.NDArray[np.int16]:
    t = np.arange(int(rate * seconds)) / rate
    return np.rint(amplitude * np.sin(2 * np.pi * hz * t)).astype(np.int16)


@pytest.mark.parametrize(
    ("rate_in", "rate_out"), [(44_100, 16_000), (48_000, 16_000), (22_050, 16_000), (8_000, 16_000)]
)
def test_the_resampler_keeps_a_tone_and_its_timing(rate_in: int, rate_out: int) -> None:
    tone = sine(rate_in, 0.5)
    out = np.frombuffer(resample(tone.astype("<i2").tobytes(), rate_in, rate_out), "<i2")
    assert len(out) == (len(tone) - 1) * rate_out // rate_in + 1
    expected = sine(rate_out, 0.5)[: len(out)].astype(float)
    inner = slice(200, len(out) - 200)  # the filter starts and ends on silence
    error = np.abs(out[inner] - expected[inner]).max()
    assert error <= 2, error  # within two steps of 16 bits: in place, in time


def test_the_resampler_folds_nothing_above_the_new_band_into_speech() -> None:
    """12 kHz at 48 kHz is above 16 kHz's Nyquist frequency: it must vanish, not come back
    as a 4 kHz tone (which plain linear interpolation would make)."""
    tone = sine(48_000, 0.5, hz=12_000)
    out = np.frombuffer(resample(tone.astype("<i2").tobytes(), 48_000, 16_000), "<i2")
    assert np.abs(out[200:-200]).max() < 0.01 * 10_000


def test_resampling_in_chunks_equals_resampling_at_once() -> None:
    rng = np.random.default_rng(7)
    audio = rng.integers(-20_000, 20_000, 44_100, dtype=np.int16)
    whole = np.frombuffer(resample(audio.astype("<i2").tobytes(), 44_100, 16_000), "<i2")
    resampler = Resampler(44_100, 16_000)
    parts = []
    start = 0
    for size in [1, 2, 5, 100, 441, 1000, 3, 20_000, 44_100]:
        parts.append(resampler.process(audio[start : start + size]))
        start += size
    parts.append(resampler.flush())
    chunked = np.concatenate(parts)
    assert np.array_equal(chunked, whole)  # each output from the same inputs and kernel


def test_the_stream_resamples_to_the_recognizer_rate_and_keeps_times() -> None:
    rec = Scripted([(16_000, hyp("tom", False, 900, 1000))])
    stream = RecognizerStream(rec, "s", sample_rate=48_000)
    events = []
    for _ in range(10):
        events += stream.accept(pcm(4_800))  # 100 ms at 48 kHz
    assert stream.heard_ms == pytest.approx(1000)
    events += stream.flush()
    assert len(rec.audio) // 2 == (48_000 - 1) // 3 + 1  # one second at 16 kHz
    assert [(e.text, e.start_ms, e.end_ms) for e in events] == [
        ("tom", 900, 1000),
        ("tom", 900, 1000),
    ]


# -- audio sources ----------------------------------------------------------------------


def test_a_backlog_refuses_frames_past_its_bound_until_taken() -> None:
    backlog = Backlog(16_000, 0.25)  # 4000 samples
    assert not backlog and backlog.seconds(pcm(1600)) == pytest.approx(0.1)
    assert backlog.put(pcm(3000)) and backlog.put(pcm(1000))
    assert not backlog.put(pcm(1))  # past the bound: dropped, the rest kept
    assert backlog.take() == pcm(4000) and not backlog
    assert backlog.put(pcm(4000))  # room again once taken


@pytest.mark.anyio
async def test_paced_chunks_are_whole_samples_and_wait_for_their_time() -> None:
    source = RawSource(io.BytesIO(pcm(1601) + b"\x01"), 16_000)
    started = time.monotonic()
    chunks = [chunk async for chunk in paced_chunks(source, 800, speed=2.0)]
    assert [len(c) for c in chunks] == [1600, 1600, 2]  # the dangling byte left out
    assert time.monotonic() - started >= 1600 / 16_000 / 2.0  # the last one's start


# -- the async pipeline ----------------------------------------------------------------


def sentence_plan(start: int, words: str, start_ms: float) -> list[tuple[int, SpeechHypothesis]]:
    """One partial per word (every 1600 samples), then the final."""
    parts = words.split()
    plan = []
    for n in range(1, len(parts) + 1):
        end = start_ms + 100 * n
        plan.append((start + 1600 * n, hyp(" ".join(parts[:n]), False, start_ms, end)))
    plan.append((start + 1600 * (len(parts) + 1), hyp(words, True, start_ms, end + 50)))
    return plan


async def collect(sub: object, into: list[TranslationUpdate | ErrorMessage]) -> None:
    async for reply in sub:  # type: ignore[attr-defined]
        into.append(reply)


@pytest.mark.anyio
async def test_the_transcriber_translates_what_is_heard_and_survives_a_failure(
    translator: Translator,
) -> None:
    plan = sentence_plan(0, "i will meet tom at three", 0) + sentence_plan(
        20_000, "tom reads a book", 1250
    )
    rec = Scripted(plan, fail_at_call=4)  # after "i will meet": that chunk is lost
    replies: list[TranslationUpdate | ErrorMessage] = []
    async with IncrementalTranslator(translator) as nmt:
        sub = nmt.updates("mic")
        listener = Transcriber(nmt, rec, "mic")
        failures = 0
        async with anyio.create_task_group() as group:
            group.start_soon(collect, sub, replies)
            for _ in range(20):
                try:
                    await listener.feed(pcm(1600))
                except RecognizerFailed:
                    failures += 1
            await listener.finish()  # closes the stream: `collect` ends
    assert failures == 1 and listener.failures == 1
    updates = [r for r in replies if isinstance(r, TranslationUpdate)]
    finals = [u for u in updates if u.is_final]
    assert [u.segment_id for u in finals] == [0, 1, 2]  # one final per segment
    # What was shown when the recognizer failed became final; the recognizer went on
    # with the same utterance, which the stream heard as a new segment.
    assert [u.source_text for u in finals] == [
        "i will meet", "i will meet tom at three", "tom reads a book",
    ]  # fmt: skip
    assert finals[2].stable_text == translator.translate(["tom reads a book"])[0].text
    assert (finals[2].start_ms, finals[2].end_ms) == (1250, 1700)
    assert listener.pushed >= 4 and not listener.refused


class Slow(Scripted):
    """Holds its thread as a heavy decoder would."""

    def accept(self, data: bytes) -> list[SpeechHypothesis]:
        time.sleep(0.2)
        return super().accept(data)


@pytest.mark.anyio
async def test_recognition_runs_off_the_event_loop(translator: Translator) -> None:
    """While two streams' recognizers hold their threads, the event loop keeps ticking."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with IncrementalTranslator(translator) as nmt:
        listeners = [Transcriber(nmt, Slow([]), f"s{n}") for n in range(2)]
        async with anyio.create_task_group() as group:
            group.start_soon(tick)
            started = time.perf_counter()
            async with anyio.create_task_group() as feeds:
                for listener in listeners:
                    feeds.start_soon(listener.feed, pcm(160))
            took = time.perf_counter() - started
            group.cancel_scope.cancel()
        for listener in listeners:
            await listener.finish()  # nothing was heard: no stream to close
    assert took < 0.38  # the two ran side by side, not one after the other
    assert ticks >= 8


# -- pocketsphinx ----------------------------------------------------------------------


def needs_speech() -> None:
    pytest.importorskip("pocketsphinx")
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")


def spoken(text: str, voice: str) -> bytes:
    """`text` spoken by espeak-ng as the test set makes it (16 kHz, silence around)."""
    sys.path.insert(0, str(SPEECH))
    import make_set

    return make_set.speak(text, voice, None)


def word_error_rate(reference: str, heard: str) -> float:
    """Word-level Levenshtein distance over the reference's words."""
    ref, got = reference.lower().split(), heard.split()
    row = list(range(len(got) + 1))
    for i, r in enumerate(ref, start=1):
        diagonal, row[0] = row[0], i
        for j, h in enumerate(got, start=1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (r != h))
    return row[len(got)] / len(ref)


@pytest.mark.parametrize(
    ("text", "voice"),
    [
        ("Frank can clean the room", "en-us+klatt2"),
        ("David will not buy an umbrella in London on Wednesday", "en-us+f5"),
        ("Lucy wants to meet Jack on the train", "en-gb-x-rp+klatt2"),
    ],
)
def test_pocketsphinx_hears_fixture_sentences(text: str, voice: str) -> None:
    needs_speech()
    from engine.asr.sphinx import SphinxOptions, SphinxRecognizer

    audio = spoken(text, voice)
    options = SphinxOptions(
        language_model=SPEECH / "fixture.lm.gz", dictionary=SPEECH / "fixture.dict"
    )
    stream = RecognizerStream(SphinxRecognizer(options), "s")
    events = []
    for start in range(0, len(audio), 3200):
        events += stream.accept(audio[start : start + 3200])
    events += stream.flush()
    finals = [e for e in events if e.is_final]
    assert len(finals) == 1, events
    final = finals[0]
    # Most words right (here, with this espeak-ng: all of them, or all but one or two).
    assert word_error_rate(text, final.text) <= 0.34, final.text
    assert any(not e.is_final for e in events)  # it showed partials first
    duration_ms = len(audio) / 32
    assert final.start_ms is not None and final.end_ms is not None
    assert 150 <= final.start_ms <= 400  # 250 ms of silence lead in
    assert final.start_ms < final.end_ms <= duration_ms


def test_pocketsphinx_without_its_extra_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.asr.errors import RecognizerUnavailable
    from engine.asr.sphinx import SphinxRecognizer

    monkeypatch.setitem(sys.modules, "pocketsphinx", None)  # import fails
    with pytest.raises(RecognizerUnavailable, match=r"pip install -e '\.\[asr\]'"):
        SphinxRecognizer()


def test_a_domain_model_is_built_from_sentences(tmp_path: Path) -> None:
    pytest.importorskip("pocketsphinx")
    from engine.asr.domain import build_domain_model
    from engine.asr.sphinx import SphinxOptions, SphinxRecognizer

    model = build_domain_model(
        ["Tom reads a book.", "Mary reads a letter", "Tom meets Zorblax"], tmp_path
    )
    assert model.unknown == ("zorblax",) and model.sentences == 2
    assert model.words == ("a", "book", "letter", "mary", "reads", "tom")
    assert "\\3-grams:" in model.language_model.read_text()
    SphinxRecognizer(
        SphinxOptions(language_model=model.language_model, dictionary=model.dictionary)
    )


def test_pocketsphinx_takes_a_grammar_instead_of_a_language_model(tmp_path: Path) -> None:
    needs_speech()
    from engine.asr.sphinx import SphinxOptions, SphinxRecognizer

    grammar = tmp_path / "chores.jsgf"
    grammar.write_text(
        "#JSGF V1.0;\ngrammar chores;\n"
        "public <chore> = <name> (can clean | cleans) (the room | the kitchen);\n"
        "<name> = frank | jack | mary;\n"
    )
    options = SphinxOptions(grammar=grammar, dictionary=SPEECH / "fixture.dict")
    stream = RecognizerStream(SphinxRecognizer(options), "s")
    events = stream.accept(spoken("Frank can clean the room", "en-us+klatt2")) + stream.flush()
    assert [e.text for e in events if e.is_final] == ["frank can clean the room"]


def test_stopping_mid_sentence_on_a_frame_boundary_still_ends_the_utterance() -> None:
    """Stop pressed mid-sentence with no partial frame pending: pocketsphinx's
    `Endpointer.end_stream` refuses empty input, so the recognizer must not hand it any;
    the utterance ends with a final all the same."""
    needs_speech()
    from engine.asr.sphinx import SphinxOptions, SphinxRecognizer

    audio = spoken("Lucy wants to meet Jack on the train", "en-gb-x-rp+klatt2")
    recognizer = SphinxRecognizer(
        SphinxOptions(language_model=SPEECH / "fixture.lm.gz", dictionary=SPEECH / "fixture.dict")
    )
    frame = recognizer._frame_bytes
    cut = (len(audio) * 2 // 3) // frame * frame  # mid-sentence, a whole number of frames
    stream = RecognizerStream(recognizer, "s")
    events = stream.accept(audio[:cut])
    assert events and not events[-1].is_final  # speaking when stopped
    events += stream.flush()
    assert events[-1].is_final and events[-1].text
