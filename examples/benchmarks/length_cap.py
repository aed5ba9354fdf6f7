"""What the guards against a translation that never ends change (docs/streaming.md, "A
translation that never ends"): `DecodeOptions`' source length cap and repeat limit, on
against off.

1. Held-out fixture sets (every committed fixture's heldout.tsv), greedy and beam 4: how
   many translations the model ended by itself, and how many of those the guards changed
   (must be 0), with the longest output against its cap.
2. `listen` of noisy speech: out-of-domain English spoken by espeak-ng in several voices,
   mixed with white noise, recognized with the fixture's domain language model (which
   maps what it cannot place onto the fixture's words, "on we you you do"), translated
   with and without the guards: finals, the longest, those that ran to the model's limit.

    python examples/benchmarks/length_cap.py [--snr 20] [--no-speech]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.decoding.search import DecodeOptions  # noqa: E402
from engine.decoding.translator import Translator  # noqa: E402

FIXTURES = ["fixture", "fixture_offline", "fixture_de"]
OFF = DecodeOptions(max_length_factor=None, repeat_limit=None)
NOISY = [
    ("The weather was cold and grey all through the winter", "en-us+klatt2"),
    ("Please remember to switch off the lights before you leave", "en-gb-x-rp"),
    ("Our neighbours bought an old boat last summer", "en-us"),
    ("Nobody expected the meeting to end so quickly", "en-gb+klatt2"),
    ("Seventeen orange umbrellas were found under the bridge", "en-us+klatt4"),
    ("You know what I mean, do you not", "en-gb-x-rp"),
    ("Why would we ever want to do that again", "en-us"),
    ("On we go, up the hill and over the river", "en-us+klatt2"),
    ("Do you think they will come back tomorrow", "en-gb"),
    ("I really do not know what you are talking about", "en-us+klatt4"),
    ("The children were laughing in the garden", "en-gb-x-rp"),
    ("Can you hear me now, can you hear me", "en-us"),
    ("We ought to have left an hour ago", "en-gb+klatt2"),
    ("Thank you very much, thank you, thank you", "en-us+klatt2"),
    ("Um, well, you see, it is a bit complicated", "en-gb"),
    ("Going going gone, sold to the lady at the back", "en-us+klatt4"),
]


def heldout() -> None:
    print("held-out sets: translations the model ended by itself, changed by the guards")
    print(
        f"{'model':<16} {'search':<7} {'sources':>7} {'ended':>6} {'changed':>8} "
        f"{'of ended':>8} {'longest/cap':>11}"
    )
    for name in FIXTURES:
        model = ROOT / "models" / name / "model"
        rows = (ROOT / "models" / name / "heldout.tsv").read_text(encoding="utf-8").splitlines()
        sources = [r.split("\t")[0] for r in rows if r.strip()]
        translator = Translator.from_dir(model)
        for beam in (1, 4):
            on = DecodeOptions(beam_size=beam)
            off = DecodeOptions(beam_size=beam, max_length_factor=None, repeat_limit=None)
            guarded = translator.translate(sources, on)
            free = translator.translate(sources, off)
            ended = [i for i, r in enumerate(free) if r.finished]
            changed = sum(g.token_ids != f.token_ids for g, f in zip(guarded, free, strict=True))
            changed_ended = sum(guarded[i].token_ids != free[i].token_ids for i in ended)
            ratio = max(
                len(f.token_ids) / (on.source_cap(len(translator.source_ids(s))) or 1)
                for s, f in zip(sources, free, strict=True)
            )
            search = "greedy" if beam == 1 else f"beam {beam}"
            print(
                f"{name:<16} {search:<7} {len(sources):>7} {len(ended):>6} {changed:>8} "
                f"{changed_ended:>8} {ratio:>11.2f}"
            )
        translator.close()


def noisy_wav(folder: Path, snr_db: float, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    pieces = []
    rate = 22050
    for n, (text, voice) in enumerate(NOISY):
        path = folder / f"{n}.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-w", str(path), text], check=True)
        with wave.open(str(path)) as w:
            rate = w.getframerate()
            pieces.append(np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16))
    silence = np.zeros(2 * rate, dtype=np.int16)
    speech = np.concatenate([x for p in pieces for x in (silence, p)] + [silence]).astype(
        np.float64
    )
    power = float(np.mean(speech[speech != 0] ** 2))
    noise = rng.normal(0.0, math.sqrt(power / 10 ** (snr_db / 10)), speech.shape)
    mixed = np.clip(speech + noise, -32768, 32767).astype(np.int16)
    out = folder / "noisy.wav"
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(mixed.tobytes())
    return out


def listen(wav: Path, *options: str) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-m", "engine.cli", "listen", str(wav), *options],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=600,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    if done.returncode != 0:
        raise SystemExit(f"listen failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return [u for u in lines if u.get("is_final")]


def speech(snr_db: float) -> None:
    if shutil.which("espeak-ng") is None:
        print("listen of noisy speech: skipped (espeak-ng is not installed)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        wav = noisy_wav(Path(tmp), snr_db, seed=1)
        runs = {
            "guards on": listen(wav),
            "guards off": listen(wav, "--max-length-factor", "0", "--repeat-limit", "0"),
        }
    print(
        f"\nlisten of noisy speech ({len(NOISY)} out-of-domain sentences, white noise at "
        f"{snr_db:g} dB SNR, the fixture's domain language model)"
    )
    for name, finals in runs.items():
        texts = [str(u.get("stable_text", "")) for u in finals]
        longest = max(map(len, texts), default=0)
        print(
            f"  {name:<10}: {len(finals)} finals, {sum(map(len, texts))} characters, "
            f"longest {longest}, over 60 characters {sum(len(t) > 60 for t in texts)}"
        )
    print("  finals that differ (heard -> guards on | guards off):")
    same = 0
    for on, off in zip(runs["guards on"], runs["guards off"], strict=False):
        a, b = str(on.get("stable_text")), str(off.get("stable_text"))
        if a == b:
            same += 1
            continue
        shown = b if len(b) <= 40 else f"{b[:20]}...({len(b)} characters)"
        print(f"    {on.get('source_text')!r} -> {a!r} | {shown!r}")
    print(f"  finals the same: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snr", type=float, default=20.0, help="speech to noise, dB")
    parser.add_argument("--no-speech", action="store_true", help="held-out sets only")
    args = parser.parse_args()
    heldout()
    if not args.no_speech:
        speech(args.snr)


if __name__ == "__main__":
    main()
