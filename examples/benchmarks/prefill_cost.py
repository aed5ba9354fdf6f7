"""What a prefill and an encoder call cost, by rows and positions: the cost model behind
the scheduler's prefill grouping (`PREFILL_PADDING`).

One call at a time through the batchable decoder (`MaskedDecoder.prefill`, int8 per token
by default, the output projection on the positions a search reads: the last `read` of
each row), on the benchmark model (OPUS-MT size, random weights); then the encoder by
rows; then two threads each running encoder + prefill calls against one, to see whether
the scheduler's two lanes slow each other down. Medians over `--reps` calls.

    HF_HUB_OFFLINE=1 python models/build_benchmark_model.py     # once
    python examples/benchmarks/prefill_cost.py
    python examples/benchmarks/prefill_cost.py --int8-per-call   # the files' quantization
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one
DEFAULT_MODEL = ROOT / ".cache" / "benchmark-model" / "onnx"
SOURCE_TOKENS = 40

from step_anatomy import median_ms  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--fp32", action="store_true", help="fp32 (default: int8)")
    parser.add_argument(
        "--int8-per-call",
        action="store_true",
        help="int8 activations quantized per call as the files do (default: per token, "
        "rows exact): what the per-token quantization costs, read against the default",
    )
    args = parser.parse_args(argv)
    if not args.model.is_dir():
        print(f"needs {args.model} (models/build_benchmark_model.py)", file=sys.stderr)
        return 2

    from engine import Translator
    from engine.decoding.scheduler import SchedulerOptions

    one = SchedulerOptions(lanes=1, threads_per_lane=1, head_threads=1)
    translator = Translator.from_dir(
        args.model,
        quantized=not args.fp32,
        scheduler=one,
        int8_per_token=not args.int8_per_call,
    )
    model = translator.model
    decoder = model.masked
    if decoder is None:
        print("the model has no batchable decoder", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)

    def source(rows: int) -> Any:
        ids = rng.integers(5, 60000, size=(rows, SOURCE_TOKENS))
        return ids, np.ones_like(ids)

    def prefill(rows: int, positions: int, read: int) -> float:
        enc = model.encode(*source(rows))
        ids = rng.integers(5, 60000, size=(rows, positions))
        mask = np.ones_like(ids)
        needed = np.full(rows, positions - read)
        return median_ms(lambda: decoder.prefill(enc, ids, mask, needed), args.reps, warmup=0)

    print(f"prefill (source {SOURCE_TOKENS} tokens), one thread; median ms of {args.reps}")
    print(f"{'rows':>4} {'positions':>9} {'read':>4} {'ms':>7} {'ms/row':>7}")
    for rows, positions, read in [
        (1, 1, 1), (1, 5, 1), (1, 10, 5), (1, 17, 10), (1, 30, 20), (1, 45, 30),
        (2, 17, 10), (4, 17, 10), (4, 30, 20),
    ]:  # fmt: skip
        ms = prefill(rows, positions, read)
        print(f"{rows:>4} {positions:>9} {read:>4} {ms:>7.2f} {ms / rows:>7.2f}")
    print(f"encoder ({SOURCE_TOKENS} tokens per source)")
    for rows in (1, 2, 4):
        ids, mask = source(rows)
        ms = median_ms(partial(model.encode, ids, mask), args.reps, warmup=0)
        print(f"{rows:>4} rows {ms:>7.2f} ms {ms / rows:>7.2f} per row")

    ids0, mask0 = source(1)
    enc0 = model.encode(ids0, mask0)
    ids = rng.integers(5, 60000, size=(1, 17))
    mask = np.ones_like(ids)
    needed = np.array([7])

    def work(calls: int) -> None:
        for _ in range(calls):
            model.encode(ids0, mask0)
            decoder.prefill(enc0, ids, mask, needed)

    calls = 4 * args.reps
    for threads in (1, 2, 1, 2):
        workers = [threading.Thread(target=work, args=(calls,)) for _ in range(threads)]
        t0 = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        wall = time.perf_counter() - t0
        rate = threads * calls / wall
        print(f"{threads} thread(s) of encoder + 17-position prefill: {rate:.1f} calls/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
