"""Cost of the batched-decoder rewrite (`engine.model.passes.masks`) on one cached step.

Prints the median time of one with-past decoder step for the original graph and for its
rewrite (the extra `decoder_attention_mask` / `decoder_position_ids` inputs) at batch 1,
so that the rewrite's overhead is visible, and what it buys: one rewritten call for
`--batch` rows of different cache lengths against that many batch-1 calls of the original.
Each round runs the variants in a shuffled order, so that load drift and cache warmth
hit all alike.

    python examples/benchmarks/batched_step.py                        # the fixture model
    python examples/benchmarks/batched_step.py --model .cache/benchmark-model --quantized
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from engine.model.checks import probe_feed  # noqa: E402
from engine.model.load import load_batched_decoder  # noqa: E402
from engine.model.names import MASK_INPUT, POSITIONS_INPUT, onnx_dir  # noqa: E402
from engine.model.passes.merged_split import split_merged  # noqa: E402


def session(model: Path | bytes, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    source = str(model) if isinstance(model, Path) else model
    return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])


def original_step(model_dir: Path, quantized: bool) -> Path | bytes:
    files = onnx_dir(model_dir)
    q = "_quantized" if quantized else ""
    split = files / f"decoder_with_past_model{q}.onnx"
    if split.is_file():
        return split
    parts = split_merged(files / f"decoder_model_merged{q}.onnx")
    if parts is None:
        raise SystemExit(f"{model_dir}: no with-past decoder")
    return parts[1]


def feed_for(sess: ort.InferenceSession, batch: int, past: int) -> dict[str, Any]:
    names = {i.name for i in sess.get_inputs()}
    feed = probe_feed(sess.get_inputs(), past_len=past, cur_len=1, batch=batch, source_len=20)
    return {k: v for k, v in feed.items() if k in names}


def timed(sess: ort.InferenceSession, feed: dict[str, Any]) -> float:
    start = time.perf_counter()
    sess.run(["logits"], feed)
    return (time.perf_counter() - start) * 1000


def measure(calls: dict[str, Callable[[], float]], runs: int) -> dict[str, list[float]]:
    """Times of each call over `runs` rounds, after 10 warm-up rounds; each round runs the
    calls in a shuffled order so that no variant always follows another."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for run in range(runs + 10):
        random.shuffle(order)
        for name in order:
            elapsed = calls[name]()
            if run >= 10:
                times[name].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=REPO_ROOT / "models/fixture/model")
    parser.add_argument("--quantized", action="store_true")
    parser.add_argument("--past", type=int, default=20, help="cached tokens (batch 1)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    rewritten = load_batched_decoder(args.model, quantized=args.quantized)
    if rewritten is None:
        raise SystemExit("no rewrite for this model (see the log)")
    original = session(original_step(args.model, args.quantized), args.threads)
    new = session(rewritten.with_past, args.threads)
    base_feed, new_feed = feed_for(original, 1, args.past), feed_for(new, 1, args.past)

    # `--batch` rows whose real cache lengths spread over 1..2*past, right-padded.
    lengths = np.linspace(1, 2 * args.past, args.batch).astype(int)
    width = int(lengths.max())
    batch_feed = feed_for(new, args.batch, width)
    mask = (np.arange(width + 1)[None, :] < lengths[:, None]).astype(np.int64)
    mask[:, -1] = 1
    batch_feed[MASK_INPUT] = mask
    batch_feed[POSITIONS_INPUT] = lengths[:, None].astype(np.int64)
    row_feeds = [feed_for(original, 1, int(n)) for n in lengths]

    # Two phases, each interleaving only its own pair: the batch-1 original would otherwise
    # often run right after the 8 original calls, on weights still in cache (measured: the
    # int8 OPUS-MT-size step looked 35% cheaper than the rewrite that way).
    times = measure(
        {"original": lambda: timed(original, base_feed), "rewritten": lambda: timed(new, new_feed)},
        args.runs,
    )
    times |= measure(
        {
            "batch": lambda: timed(new, batch_feed),
            "rows": lambda: sum(timed(original, f) for f in row_feeds),
        },
        args.runs,
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    kind = "int8" if args.quantized else "fp32"
    print(f"{args.model} ({kind}, {args.threads} thread(s), {args.runs} runs, medians)")
    print(
        f"  one step, batch 1, past {args.past}: original {med['original']:.3f} ms, "
        f"rewritten {med['rewritten']:.3f} ms ({med['rewritten'] / med['original'] - 1:+.1%})"
    )
    print(
        f"  {args.batch} rows, cache lengths {lengths.min()}..{lengths.max()}: one rewritten "
        f"call {med['batch']:.3f} ms vs {args.batch} original calls {med['rows']:.3f} ms "
        f"({med['rows'] / med['batch']:.1f}x)"
    )


if __name__ == "__main__":
    main()
