"""What self-attention in place saves a step: the engine's rewritten with-past step
(`engine.model.passes.masks`, int8 per token) against the same graph with its
self-attention in place (`engine.model.kv.inplace.rewrite`), whole graphs, no Python around.

The ordinary step takes every row's past keys and values and returns them one position
longer (`Concat`: the whole state copied into new arrays at every step). The one in place
reads them from buffers of `[rows, heads, positions, head_dim]` bound as both its past
inputs and its present outputs, and writes one position per row. Both run the same
weights on the same threads, a decode of `--tokens` steps from `--past` positions with the
rows in lockstep; the time is per step, medians of alternated rounds (ordinary, in place,
ordinary, ...), and the largest logit difference at the first and at the last step is
printed. One row runs the one-token graph (the files' own int8 kernels), as the engine
does; more rows the per-token graph.

    python examples/benchmarks/inplace_attention.py [--rows 1 16] [--past 1] [--tokens 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / ".cache" / "benchmark-model" / "onnx"

Array = np.ndarray[Any, Any]


def _session(model: bytes, threads: int, per_token: bool) -> ort.InferenceSession:
    """Opened as the engine opens its decoder sessions (`open_session`)."""
    from engine.model.sessions import RuntimeOptions, open_session

    return open_session(model, RuntimeOptions(intra_op_threads=threads), per_token=per_token)


def _measure(
    ordinary: ort.InferenceSession,
    inplace: ort.InferenceSession,
    args: argparse.Namespace,
    rows: int,
) -> tuple[float, float, float]:
    """ms per step of each, medians of alternated rounds, and the largest logit
    difference at the first and the last step."""
    from engine.model.names import (
        ENCODER_ATTENTION_MASK,
        ENCODER_HIDDEN_STATES,
        INPUT_IDS,
        LOGITS,
        MASK_INPUT,
        POSITIONS_INPUT,
        SEQLENS_INPUT,
        TOTAL_INPUT,
    )

    declared = {i.name for i in ordinary.get_inputs()} | {i.name for i in inplace.get_inputs()}
    self_in = [i for i in ordinary.get_inputs() if ".decoder." in i.name]
    heads, head_dim = int(self_in[0].shape[1]), int(self_in[0].shape[3])
    rng = np.random.default_rng(rows)
    fixed: dict[str, Array] = {
        ENCODER_ATTENTION_MASK: np.ones((rows, args.source), dtype=np.int64),
        ENCODER_HIDDEN_STATES: rng.standard_normal((rows, args.source, heads * head_dim)).astype(
            np.float32
        ),
    }
    past0: dict[str, Array] = {}
    for arg in ordinary.get_inputs():
        if ".encoder." in arg.name:
            shape = (rows, heads, args.source, head_dim)
            fixed[arg.name] = rng.standard_normal(shape).astype(np.float32)
        elif ".decoder." in arg.name:
            shape = (rows, heads, args.past, head_dim)
            past0[arg.name] = rng.standard_normal(shape).astype(np.float32)
    fixed = {name: value for name, value in fixed.items() if name in declared}
    tokens = rng.integers(1, 60000, size=(args.tokens, rows, 1), dtype=np.int64)
    presents = [o.name for o in ordinary.get_outputs() if ".decoder." in o.name]

    def run_ordinary() -> list[Array]:
        past = dict(past0)
        kept = []
        for step in range(args.tokens):
            length = args.past + step
            feed = {
                **fixed,
                **past,
                INPUT_IDS: tokens[step],
                MASK_INPUT: np.ones((rows, length + 1), dtype=np.int64),
                POSITIONS_INPUT: np.full((rows, 1), length, dtype=np.int64),
            }
            out = ordinary.run([LOGITS, *presents], feed)
            past = {
                name.replace("present", "past_key_values", 1): value
                for name, value in zip(presents, out[1:], strict=True)
            }
            if step in (0, args.tokens - 1):
                kept.append(out[0])
        return kept

    capacity = args.past + args.tokens + 1
    buffers = {
        name: np.zeros((rows, heads, capacity, head_dim), dtype=np.float32) for name in past0
    }
    binding = inplace.io_binding()
    binding.bind_output(LOGITS)
    for name, value in fixed.items():
        binding.bind_cpu_input(name, value)
    for name, buffer in buffers.items():
        address, dims = buffer.ctypes.data, list(buffer.shape)
        binding.bind_input(name, "cpu", 0, np.float32, dims, address)
        present = name.replace("past_key_values", "present", 1)
        binding.bind_output(present, "cpu", 0, np.float32, dims, address)

    def run_inplace() -> list[Array]:
        for name, buffer in buffers.items():
            buffer[:, :, : args.past] = past0[name]
        kept = []
        for step in range(args.tokens):
            length = args.past + step
            binding.bind_cpu_input(INPUT_IDS, tokens[step])
            binding.bind_cpu_input(POSITIONS_INPUT, np.full((rows, 1), length, dtype=np.int64))
            binding.bind_cpu_input(SEQLENS_INPUT, np.full(rows, length, dtype=np.int32))
            binding.bind_cpu_input(TOTAL_INPUT, np.array(length + 1, dtype=np.int32))
            inplace.run_with_iobinding(binding)
            if step in (0, args.tokens - 1):
                kept.append(binding.get_outputs()[0].numpy().copy())
        return kept

    want, got = run_ordinary(), run_inplace()
    diff = max(float(np.abs(a - b).max()) for a, b in zip(want, got, strict=True))
    times: dict[str, list[float]] = {"ordinary": [], "inplace": []}
    for _ in range(args.rounds):
        for name, run in (("ordinary", run_ordinary), ("inplace", run_inplace)):
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1000 / args.tokens)
    return statistics.median(times["ordinary"]), statistics.median(times["inplace"]), diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--fp32", action="store_true", help="fp32 files (default: int8)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--past", type=int, default=1, help="positions before the first step")
    parser.add_argument("--tokens", type=int, default=40, help="steps per decode")
    parser.add_argument("--source", type=int, default=40, help="source positions")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    from engine.model.kv.inplace.rewrite import rewrite_inplace
    from engine.model.load import load_batched_decoder

    pair = load_batched_decoder(args.model, quantized=not args.fp32, check=False, per_token=True)
    if pair is None:
        print(f"{args.model}: the decoder could not be rewritten (logged)", file=sys.stderr)
        return 1
    cpu = _cpu_name()
    print(
        f"{args.model} ({'fp32' if args.fp32 else 'int8'}), {args.threads} threads; "
        f"{args.tokens} steps from {args.past} past positions, {args.source} source; {cpu}"
    )
    print(f"{'rows':>5} {'ordinary ms/step':>17} {'in place':>9} {'ratio':>6} {'logits diff':>12}")
    for rows in args.rows:
        graph = pair.one_token if rows == 1 and pair.one_token is not None else pair.with_past
        rewritten = rewrite_inplace(graph, str(args.model))
        if rewritten is None:
            print(f"{args.model}: no step in place for this graph (logged)", file=sys.stderr)
            return 1
        per_token = not args.fp32 and graph is pair.with_past
        ordinary = _session(graph, args.threads, per_token)
        inplace = _session(rewritten, args.threads, per_token)
        a, b, diff = _measure(ordinary, inplace, args, rows)
        print(f"{rows:>5} {a:>17.3f} {b:>9.3f} {b / a:>6.2f} {diff:>12.2e}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
