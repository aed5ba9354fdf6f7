"""Utterances end in noise (`engine.asr.levels`): WebRTC-style voice activity calls steady
noise speech, so without a fallback a recording 10 dB over white noise gave one final for
all its sentences; the level cut ends each at the pause after it, against the audio's own
noise floor, and at `max_utterance_s` wherever it is."""

from __future__ import annotations

import itertools
import json
import wave

import numpy as np
import pytest

from engine.asr.levels import QUIET_DB, SILENT_DB, LevelCut, level_db
from tests.conftest import ROOT

SPEECH = ROOT / "examples" / "speech"
RATE = 16_000
FRAME = 480  # 30 ms, the endpointer's frame


def noise(samples: int, rms: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, rms, samples)


def pcm(x: np.ndarray) -> bytes:
    return np.clip(np.round(x), -32768, 32767).astype("<i2").tobytes()


def cut(**kw: float) -> LevelCut:
    return LevelCut(frame_s=0.03, window_s=0.3, ratio=0.9, **kw)


# -- the level rule on its own -----------------------------------------------------------


def test_levels_of_silence_and_of_a_full_scale_square() -> None:
    assert level_db(b"") == SILENT_DB
    assert level_db(bytes(2 * FRAME)) == SILENT_DB
    square = pcm(np.where(np.arange(FRAME) % 2, 32767.0, -32767.0))
    assert level_db(square) == pytest.approx(20 * np.log10(32767), abs=1e-3)


def test_noise_is_quiet_against_its_floor_and_speech_ten_db_over_it_is_not() -> None:
    levels = cut(long_s=1.0, max_s=20.0)
    assert not levels.quiet(pcm(noise(FRAME, 300.0, 0)))  # no floor heard yet
    for seed in range(30):
        levels.hear(pcm(noise(FRAME, 300.0, seed)))
    assert all(levels.quiet(pcm(noise(FRAME, 300.0, 100 + s))) for s in range(30))
    louder = 300.0 * 10 ** (10 / 20)
    assert not any(levels.quiet(pcm(noise(FRAME, louder, 200 + s))) for s in range(30))


def test_the_floor_falls_at_once_and_rises_slowly() -> None:
    levels = cut(long_s=1.0, max_s=20.0)
    loud, soft = pcm(noise(FRAME, 3000.0, 1)), pcm(noise(FRAME, 300.0, 2))
    levels.hear(loud)
    levels.hear(soft)
    assert levels.floor == pytest.approx(level_db(soft))
    for _ in range(100):  # 3 s of the louder noise: the floor rises 1 dB a second
        levels.hear(loud)
    assert levels.floor == pytest.approx(level_db(soft) + 3.0, abs=0.01)
    assert levels.floor is not None
    assert level_db(loud) - levels.floor > QUIET_DB  # so that speech there is not a pause


def test_a_pause_ends_an_utterance_only_once_it_is_long_and_any_length_ends_at_max() -> None:
    levels = cut(long_s=1.0, max_s=4.0)
    quiet, loud = pcm(noise(FRAME, 300.0, 3)), pcm(noise(FRAME, 3000.0, 4))
    for _ in range(20):
        levels.hear(quiet)
    # A pause 0.6 s into the utterance does not end it; the same pause after 1 s does.
    assert not any(levels.ends(quiet, 0.3 + 0.03 * i) for i in range(10))
    levels.restart()
    assert not any(levels.ends(loud, 1.0 + 0.03 * i) for i in range(20))
    ends = [levels.ends(quiet, 1.6 + 0.03 * i) for i in range(10)]
    assert ends.index(True) == 8  # 90% of the 0.3 s window (9 of 10 frames) quiet
    levels.restart()
    assert not levels.ends(loud, 3.99)
    assert levels.ends(loud, 4.0)


def test_its_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="long_s"):
        cut(long_s=5.0, max_s=4.0)
    from engine.asr.sphinx import SphinxOptions

    with pytest.raises(ValueError, match="max_utterance_s"):
        SphinxOptions(max_utterance_s=0.5)


# -- pocketsphinx over noisy speech ------------------------------------------------------


def sentences(count: int) -> list[tuple[str, np.ndarray]]:
    lines = (SPEECH / "manifest.jsonl").read_text().splitlines()[:count]
    out = []
    for line in lines:
        item = json.loads(line)
        with wave.open(str(SPEECH / item["file"])) as w:
            assert w.getframerate() == RATE
            out.append((item["text"], np.frombuffer(w.readframes(w.getnframes()), "<i2")))
    return out


def noisy_talk(snr_db: float, gap_s: float) -> tuple[bytes, list[tuple[float, float]]]:
    """Four committed sentences `gap_s` apart after a second of noise, white noise
    `snr_db` under the speech's mean power; each sentence's (start, end) of speech, s."""
    pieces: list[np.ndarray] = [np.zeros(RATE)]
    spans = []
    at = RATE
    for _, audio in sentences(4):
        voiced = np.flatnonzero(audio)
        spans.append(((at + voiced[0]) / RATE, (at + voiced[-1]) / RATE))
        pieces += [audio.astype(np.float64), np.zeros(int(gap_s * RATE))]
        at += len(audio) + int(gap_s * RATE)
    speech = np.concatenate(pieces)
    power = float(np.mean(speech[speech != 0] ** 2))
    mixed = speech + noise(len(speech), float(np.sqrt(power / 10 ** (snr_db / 10))), 7)
    return pcm(mixed), spans


def recognize(audio: bytes, **options: float) -> list[tuple[float, float, str]]:
    pytest.importorskip("pocketsphinx")
    from engine.asr.sphinx import SphinxOptions, SphinxRecognizer

    recognizer = SphinxRecognizer(
        SphinxOptions(
            language_model=SPEECH / "fixture.lm.gz",
            dictionary=SPEECH / "fixture.dict",
            **options,  # type: ignore[arg-type]
        )
    )
    hyps = []
    try:
        for start in range(0, len(audio), 3200):
            hyps += recognizer.accept(audio[start : start + 3200])
        hyps += recognizer.flush()
    finally:
        recognizer.close()
    return [(h.start_ms / 1000, h.end_ms / 1000, h.text) for h in hyps if h.is_final]


@pytest.mark.parametrize("snr_db", [10.0, 5.0])
def test_each_sentence_ends_in_its_own_final_in_noise(snr_db: float) -> None:
    audio, spans = noisy_talk(snr_db, gap_s=1.5)
    finals = recognize(audio)
    for i, (start, end) in enumerate(spans):
        mine = [f for f in finals if f[0] < end and f[1] > start]
        assert len(mine) == 1, (i, spans, finals)
        f_start, f_end, text = mine[0]
        assert text
        assert f_start <= start + 0.3 and end - 0.1 <= f_end <= end + 1.0, (i, spans, finals)


def test_talk_without_a_pause_ends_at_the_longest_utterance() -> None:
    # Noise loud and soft by turns every 120 ms, like syllables: never a pause.
    envelope = np.where((np.arange(12 * RATE) // (4 * FRAME)) % 2, 3000.0, 300.0)
    audio = pcm(noise(12 * RATE, 1.0, 11) * envelope)
    finals = recognize(audio, max_utterance_s=3.0)
    lengths = [end - start for start, end, _ in finals]
    assert len(finals) >= 3, finals
    assert all(length <= 3.0 + 0.05 for length in lengths), finals
    # Back to back: each utterance starts where the one before it was cut, or at the
    # first loud frame after (the soft ones between are not decoded).
    for before, after in itertools.pairwise(finals):
        assert before[1] - 0.01 <= after[0] <= before[1] + 0.13, finals


def test_clean_speech_is_cut_as_the_endpointer_cuts_it() -> None:
    audio, spans = noisy_talk(60.0, gap_s=1.0)
    finals = recognize(audio)
    assert len(finals) == len(spans), finals
