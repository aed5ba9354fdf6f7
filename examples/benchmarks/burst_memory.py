"""What a process keeps after a burst of streams has gone: RSS after a burst of long decodes
has ended, and after lone decodes that follow it.

A captioning node sees bursts (a meeting starts, a room fills) and then quiet. Each of
the scheduler's lanes keeps its self- and cross-attention state in buffers updated in
place (`engine/model/kv/inplace/rows.py`): rows that leave give their pages back, so the
buffers' memory comes down to the rows a lane runs once the burst is over (rows past the
most a lane held in the last `RELEASE_AFTER` seconds or two, `engine/model/kv/inplace/rows.py`).
Before that, a lane kept resident every page its rows had written: the most rows it ever
ran, at the most positions any of them reached, for the life of the process. This loads
the model, warms it with one decode, then runs `--burst` decodes of `--tokens` forced
tokens at once (one thread each, as streams would), then five short lone decodes, then
`--quiet` seconds idle, then five more, and prints the RSS growth after each. An idle
lane gives its rows back on its own once the spans have passed (its thread waits for work
no longer than that), so the idle line shows it before any decode follows.

    HF_HUB_OFFLINE=1 python models/build_benchmark_model.py     # once
    python examples/benchmarks/burst_memory.py [--burst 16] [--tokens 200] [--quiet 11]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one
DEFAULT_MODEL = ROOT / ".cache" / "benchmark-model" / "onnx"

from capacity import rss_mib  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--burst", type=int, default=16, help="decodes at once")
    parser.add_argument("--tokens", type=int, default=200, help="forced tokens per decode")
    parser.add_argument("--fp32", action="store_true", help="fp32 (default: int8)")
    parser.add_argument(
        "--quiet",
        type=float,
        default=None,
        help="idle seconds before the last lone decodes "
        "(default: twice the engine's RELEASE_AFTER, and one)",
    )
    args = parser.parse_args(argv)
    if not (args.model / "config.json").exists():
        print(f"no model at {args.model}: run models/build_benchmark_model.py", file=sys.stderr)
        return 2
    if not Path("/proc/self/statm").exists():
        print("needs /proc/self/statm (Linux)", file=sys.stderr)
        return 2

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import engine
    from engine import DecodeOptions, Translator
    from engine.model.kv.inplace.rows import RELEASE_AFTER

    quiet = 2 * RELEASE_AFTER + 1 if args.quiet is None else args.quiet

    translator = Translator.from_dir(args.model, quantized=not args.fp32)
    source = translator.encode([list(range(100, 140))])
    short = DecodeOptions(max_new_tokens=20, min_new_tokens=20)
    translator.decode(source, short)
    base = rss_mib()
    long = DecodeOptions(max_new_tokens=args.tokens, min_new_tokens=args.tokens, scores=False)
    with ThreadPoolExecutor(args.burst) as pool:
        list(pool.map(lambda _: translator.decode(source, long), range(args.burst)))
    burst = rss_mib() - base
    for _ in range(5):
        translator.decode(source, short)
    after = rss_mib() - base
    time.sleep(quiet)
    idle = rss_mib() - base
    for _ in range(5):
        translator.decode(source, short)
    later = rss_mib() - base
    translator.close()
    print(f"engine {Path(engine.__file__).parent}, model {args.model}")
    print(f"RSS after load and one decode: {base:.0f} MiB")
    print(f"growth after {args.burst} decodes of {args.tokens} tokens at once: {burst:.0f} MiB")
    print(f"growth after five lone decodes that follow: {after:.0f} MiB")
    print(f"growth after {quiet:.0f} s idle: {idle:.0f} MiB")
    print(f"growth after five more: {later:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
