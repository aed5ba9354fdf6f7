"""Make the spoken test set: fixture sentences spoken by espeak-ng, as 16 kHz mono WAVs.

    python examples/speech/make_set.py [--count 32] [--out examples/speech]

Takes the first `--count` English sentences of the fixture's held-out set
(models/fixture/heldout.tsv: the fixture's grammar, sentences it was not trained on) and
speaks each with one of `VOICES` in turn. Every third sentence long enough has a 700 ms
pause between two clauses (SSML `<break time="700ms"/>` before its first time, place or
companion phrase), so a recognizer that ends utterances at pauses cuts it in two, as
it would cut a speaker who stops to think. Each file gets 250 ms of silence before the
speech and 600 ms after it (more than the recognizer's 300 ms end-of-utterance window, so
the last final comes from the endpointer, as it would live). espeak-ng writes 22050 Hz;
the engine's resampler (`engine.asr.audio.resample`) makes it 16 kHz.

Writes into `--out`:
- `wav/NN-VOICE.wav` and `manifest.jsonl` (one line per file: `file`, `text` as the
  fixture writes it, `voice`, `pause_ms`, `duration_ms`);
- `fixture.lm.gz` and `fixture.dict`: the recognizer's model of the fixture's domain
  (`engine.asr.build_domain_model`), from the fixture's training sentences (the first
  `LM_SENTENCES` of `corpus.generate(TRAIN_SEED, ...)`) and its fragments ("with Lucy",
  "at three tomorrow": what a clause after a pause starts with), never from the held-out
  ones spoken here. With the default `--out`, copied into each fixture's model directory
  too, which names them in its `recognizer.json` (a model directory's recognizer data
  must lie inside it).

The voices were chosen for how pocketsphinx's en-US acoustic model hears espeak-ng
(word error rate of the streaming recognizer with the domain model on held-out sentences
0-19 / 20-39): en-us+klatt2 6% / 6%, en-gb-x-rp+klatt2 6% / 9%, en-us+klatt3 6% / 8%,
en-us+f5 12% / 25%; others it hears badly: en-us+f2 25%, en-gb-x-rp+f2 45%, espeak-ng's
default en-us 64% and en-gb-x-rp 70% (a formant synthesizer is far from the speech the
model was trained on).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "models" / "fixture"))

from engine.asr.audio import resample  # noqa: E402
from engine.asr.domain import build_domain_model  # noqa: E402

HERE = Path(__file__).resolve().parent
HELDOUT = ROOT / "models" / "fixture" / "heldout.tsv"
VOICES = ("en-us+klatt2", "en-gb-x-rp+klatt2", "en-us+f5", "en-us+klatt3")
RATE = 16_000
LEAD_MS = 250
TAIL_MS = 600
PAUSE_MS = 700
PAUSE_EVERY = 3
LM_SENTENCES = 20_000
# Words that start a time, place or companion phrase: where a speaker may pause.
CLAUSE_STARTS = {
    "at", "in", "on", "with", "every", "this", "last", "next", "yesterday", "tomorrow",
    "today", "tonight", "now",
}  # fmt: skip


@dataclass(frozen=True)
class Item:
    file: str
    text: str
    voice: str
    pause_ms: int
    duration_ms: float


def heldout_sentences(count: int) -> list[str]:
    lines = HELDOUT.read_text(encoding="utf-8").splitlines()
    return [line.split("\t")[0] for line in lines[:count]]


def pause_point(words: list[str]) -> int | None:
    """Where a pause goes: before the first clause-starting word after the verb phrase's
    first three words, leaving at least two words after it."""
    for i in range(3, len(words) - 1):
        if words[i].lower() in CLAUSE_STARTS:
            return i
    return None


def speak(text: str, voice: str, pause_at: int | None) -> bytes:
    """16 kHz mono 16-bit PCM of espeak-ng speaking `text` (with a pause before word
    `pause_at`), padded with silence."""
    words = text.split()
    ssml = text
    if pause_at is not None:
        ssml = (
            f'<speak>{" ".join(words[:pause_at])} <break time="{PAUSE_MS}ms"/> '
            f"{' '.join(words[pause_at:])}</speak>"
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speech.wav"
        command = ["espeak-ng", "-v", voice, "-w", str(out)]
        if pause_at is not None:
            command.append("-m")  # SSML
        subprocess.run([*command, ssml], check=True, capture_output=True)
        with wave.open(str(out)) as w:
            if w.getnchannels() != 1 or w.getsampwidth() != 2:
                raise RuntimeError(
                    f"espeak-ng wrote {w.getnchannels()} channels, {8 * w.getsampwidth()} bits"
                )
            rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    speech = resample(pcm, rate, RATE)
    lead = b"\0\0" * (RATE * LEAD_MS // 1000)
    tail = b"\0\0" * (RATE * TAIL_MS // 1000)
    return lead + speech + tail


def write_wav(path: Path, pcm: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)


def make_set(out: Path, count: int) -> list[Item]:
    items = []
    for n, text in enumerate(heldout_sentences(count)):
        voice = VOICES[n % len(VOICES)]
        at = pause_point(text.split()) if n % PAUSE_EVERY == PAUSE_EVERY - 1 else None
        pcm = speak(text, voice, at)
        name = f"wav/{n + 1:02d}-{voice.replace('+', '-')}.wav"
        write_wav(out / name, pcm)
        items.append(
            Item(name, text, voice, PAUSE_MS if at is not None else 0, len(pcm) / 2 / RATE * 1000)
        )
    with open(out / "manifest.jsonl", "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item.__dict__, ensure_ascii=False) + "\n")
    return items


def domain_sentences() -> list[str]:
    """The fixture's training sentences (the first `LM_SENTENCES`) and its fragments
    (`corpus` and `styles` are models/fixture/, put on the path above)."""
    import corpus  # type: ignore[import-not-found]
    import styles  # type: ignore[import-not-found]

    sentences = [en for en, _ in corpus.generate(corpus.TRAIN_SEED, LM_SENTENCES)]
    return sentences + [en for en, _ in styles.fragments()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=32, help="sentences (default 32)")
    parser.add_argument("--out", type=Path, default=HERE, help="where to write (default: here)")
    args = parser.parse_args()
    items = make_set(args.out, args.count)
    domain = domain_sentences()
    model = build_domain_model(domain, args.out, name="fixture", compress=True)
    if args.out == HERE:
        for folder in sorted(HERE.parent.parent.glob("models/*/model")):
            if (folder / "recognizer.json").is_file():
                shutil.copy(model.language_model, folder)
                shutil.copy(model.dictionary, folder)
    spoken = {item.text.lower() for item in items}
    sizes = sum((args.out / item.file).stat().st_size for item in items)
    print(
        f"{len(items)} files ({sizes / 1e6:.1f} MB, "
        f"{sum(i.duration_ms for i in items) / 1000:.0f} s, "
        f"{sum(1 for i in items if i.pause_ms)} with a pause), voices {', '.join(VOICES)}; "
        f"domain model: {model.sentences} sentences, {len(model.words)} words"
        + (f", unknown {model.unknown}" if model.unknown else "")
        + f"; spoken sentences in it: {len(spoken & {s.lower() for s in domain})}"
    )


if __name__ == "__main__":
    main()
