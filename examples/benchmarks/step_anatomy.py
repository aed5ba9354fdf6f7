"""Where one decoder step's time goes at one row: the layers, the output projection, memory.

At one row a step of the OPUS-MT-sized int8 decoder reads every weight once (about 22 MB
for the six layers and 33 MB for the 512 x 65001 output projection) and does little
arithmetic with each byte, so its speed is set by how fast the machine streams weights,
not by its int8 kernels. This script measures the pieces on the rewritten with-past step
(`engine.model.passes.masks`), cut at the output projection (`split_output_projection`):

- the body alone and the head alone, each run back to back: their weights stay in the
  last-level cache if they fit;
- body then head, as a step runs them: the two together do not fit a 32 MB L3, so each
  step streams most weights from memory again;
- each on one and on all `--threads`;
- the machine's copy bandwidth (numpy, one thread) and the time reading the step's
  weights would take at that speed.

    python examples/benchmarks/step_anatomy.py [--model .cache/benchmark-model] [--past 20]

Prints medians in ms. Compare the "step" rows with `decode_speed.py`'s per-token figures
(those add the Python side of a step, about 0.3 ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / ".cache" / "benchmark-model"


def median_ms(run: Callable[[], Any], reps: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def copy_bandwidth(size: int = 256 << 20) -> float:
    """Bytes read per second by one thread copying an array far larger than any cache."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    best = min(seconds(lambda: np.copyto(dst, src)) for _ in range(8))
    return size / best


def seconds(run: Callable[[], Any]) -> float:
    """Wall seconds of one call of `run`."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def weight_bytes(model: bytes) -> int:
    """Bytes of the matrices a one-row step multiplies with: each is read whole. (Tables
    that are only looked up, the embeddings, give one row per step and are left out.)"""
    import onnx

    graph = onnx.load_from_string(model).graph
    read = {
        name
        for node in graph.node
        if node.op_type in ("MatMul", "MatMulInteger", "Gemm")
        for name in node.input
    }
    return sum(
        len(i.raw_data) or int(np.prod(i.dims, dtype=np.int64)) * 4
        for i in graph.initializer
        if i.name in read
    )


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "?"
    for line in out.splitlines():
        if line.startswith(("Model name:", "L3 cache:")):
            print(f"  {line}")
        if line.startswith("Model name:"):
            name = line.split(":", 1)[1].strip()
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--past", type=int, default=20, help="cached tokens (decoder length)")
    parser.add_argument("--source", type=int, default=26, help="source tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--fp32", action="store_true", help="the fp32 files (default: int8)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    import onnxruntime as ort

    from engine.model.checks import probe_feed
    from engine.model.config import ModelConfig
    from engine.model.load import load_batched_decoder
    from engine.model.passes.head import split_output_projection

    onnx_dir = args.model / "onnx"
    if not onnx_dir.is_dir():
        print(f"no model at {onnx_dir}: run models/build_benchmark_model.py", file=sys.stderr)
        return 2
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores")
    pair = load_batched_decoder(onnx_dir, quantized=not args.fp32, check=False)
    if pair is None:
        print("the decoder could not be rewritten", file=sys.stderr)
        return 2
    split = split_output_projection(pair.with_past, ModelConfig.from_dir(onnx_dir).vocab_size)
    if split is None:
        print("the step could not be cut at its output projection", file=sys.stderr)
        return 2

    def session(model: bytes, threads: int) -> Any:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.log_severity_level = 3
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])

    counts = sorted({1, args.threads})
    whole = {t: session(pair.with_past, t) for t in counts}
    body = {t: session(split.body, t) for t in counts}
    head = {t: session(split.head, t) for t in counts}
    feed = probe_feed(whole[1].get_inputs(), past_len=args.past, cur_len=1, source_len=args.source)
    feed = {k: v for k, v in feed.items() if k in {i.name for i in body[1].get_inputs()}}
    hidden = {split.hidden: body[1].run([split.hidden], feed)[0]}
    body_mb, head_mb = weight_bytes(split.body) / 1e6, weight_bytes(split.head) / 1e6
    print(f"matrices read per step: layers {body_mb:.1f} MB, output projection {head_mb:.1f} MB")

    def body_then_head(b: Any, h: Any) -> Callable[[], Any]:
        def run() -> Any:
            out = b.run([split.hidden], feed)[0]
            return h.run(None, {split.hidden: out})

        return run

    rows: list[tuple[str, float]] = []
    for t in counts:
        rows.append(
            (
                f"layers alone, {t} thread(s), cached",
                median_ms(partial(body[t].run, [split.hidden], feed), args.reps),
            )
        )
        rows.append(
            (
                f"projection alone, {t} thread(s), cached",
                median_ms(partial(head[t].run, None, hidden), args.reps),
            )
        )
    for t in counts:
        rows.append(
            (
                f"step whole, {t} thread(s)",
                median_ms(partial(whole[t].run, None, feed), args.reps),
            )
        )
    rows.append(
        (
            f"step cut: layers 1 thread, projection {args.threads}",
            median_ms(body_then_head(body[1], head[args.threads]), args.reps),
        )
    )
    bandwidth = copy_bandwidth()
    floor = (body_mb + head_mb) * 1e6 / bandwidth * 1000
    for name, ms in rows:
        print(f"  {name:48s} {ms:6.2f} ms")
    print(f"copy bandwidth (one thread, 256 MB): {bandwidth / 1e9:.1f} GB/s")
    print(f"reading {body_mb + head_mb:.0f} MB at that speed: {floor:.2f} ms per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
