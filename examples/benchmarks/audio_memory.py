"""A recognition process's resident memory against the audio streams open in it.

Starts a `RecognizerPool` of one process with pocketsphinx (its general en-US model, or
`--domain` the fixture's domain language model), then opens streams in steps (`--steps`,
default 0, 8, 16, 32 open at once), each having heard `--seconds` of a spoken fixture
file, and prints the worker's RSS at each step; then ends every stream (flushed, as
`end_audio` ends one) and prints the RSS once they are gone, and again after a second
round of the largest step (memory given back and taken again, not grown).

    python examples/benchmarks/audio_memory.py [--steps 0,8,16,32] [--seconds 1] [--domain]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import wave
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one

from engine.asr.pool import PooledStream, RecognizerPool  # noqa: E402
from engine.asr.sphinx import SphinxOptions, SphinxRecognizer  # noqa: E402

SPEECH = ROOT / "examples" / "speech"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def settle(pool: RecognizerPool, probe: PooledStream | None = None) -> float:
    """The worker's RSS once what was sent to it is answered (a flush of a probe stream
    goes through the same pipe, behind every `Drop`)."""
    if probe is not None:
        probe.flush()
        probe.close()
    time.sleep(0.2)
    return rss_mb(pool.pids[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default="0,8,16,32")
    p.add_argument("--seconds", type=float, default=1.0, help="audio each stream hears")
    p.add_argument("--domain", action="store_true", help="the fixture's domain model")
    args = p.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    options = (
        SphinxOptions(language_model=SPEECH / "fixture.lm.gz", dictionary=SPEECH / "fixture.dict")
        if args.domain
        else SphinxOptions()
    )
    wav = sorted((SPEECH / "wav").glob("*.wav"))[0]
    with wave.open(str(wav)) as w:
        pcm = w.readframes(w.getnframes())[: int(args.seconds * 16000) * 2]
    factory = functools.partial(SphinxRecognizer, options)
    model = "domain model" if args.domain else "general en-US model"
    print(f"pocketsphinx, {model}, one recognition process, {args.seconds:g} s heard per stream")
    with RecognizerPool(factory, 1) as pool:
        warm = pool.open("warm")  # the worker's imports done
        base = settle(pool, warm)
        print(f"open streams {0:>3}: worker RSS {base:7.0f} MB")

        def round_of(label: str) -> None:
            streams: list[PooledStream] = []
            for n in steps:
                while len(streams) < n:
                    stream = pool.open(f"s{len(streams)}")
                    stream.accept(pcm)
                    streams.append(stream)
                if n:
                    rss = settle(pool)
                    print(f"open streams {n:>3}: worker RSS {rss:7.0f} MB")
            for stream in streams:
                stream.flush()
                stream.close()
            rss = settle(pool, pool.open("probe"))
            print(f"{label:>16}: worker RSS {rss:7.0f} MB")

        round_of("all ended")
        round_of("all ended again")


if __name__ == "__main__":
    main()
