"""How much of a partial's model time is int8 matrix products with the weights.

Under load a lane's time goes to what each partial runs (`capacity.py`; py-spy of its
lanes): the encoder over the source, the prefill body over start token + committed prefix
+ draft, and the output projection of the draft's positions, which the search reads to
verify it; the steps after the draft come last. This script times each of those pieces as
the engine runs it (int8 per token, one thread), then runs the same pieces once with ONNX
Runtime's profiler on to read every int8 product's shapes (`MatMulInteger`,
`DynamicQuantizeMatMul`, `MatMulIntegerToFloat`: activations [M, K] by weights [K, N]),
and times those products alone, at those shapes, in a graph of nothing else: the part of
each piece that no rewrite of the graph around the products can remove. The rest is
attention, layer norms, the per-token quantization and dequantization, and ONNX
Runtime's own work between kernels.

The products alone run warm, each graph on its own; the engine's projection is timed right
after a body, as a lane runs it, so the weights it reads come from memory. The defaults
are a partial of `capacity.py`'s: 30 source tokens, and 23 draft positions read a prefill
(47,785 read in 2,033 prefills, N=32, 2026-11-27).

Why: a larger capacity needs less CPU per partial, and the products are the floor of what
a partial costs with these kernels: what a rewrite can win is the rest.

    HF_HUB_OFFLINE=1 python models/build_benchmark_model.py     # once
    python examples/benchmarks/gemm_share.py [--source 30] [--positions 25] [--read 23]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one
DEFAULT_MODEL = ROOT / ".cache" / "benchmark-model" / "onnx"

from step_anatomy import cpu_name, seconds  # noqa: E402

PRODUCTS = ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat")


def last_products(profile: str, runs: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of each int8 product in the last `runs` runs of a session's ONNX Runtime
    profile (activations [..., K] flattened to M rows; N, the output's last axis)."""
    with open(profile) as f:
        events = json.load(f)
    starts = [e["ts"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    if len(starts) < runs:
        return []
    begin = starts[-runs]
    shapes = []
    for event in events:
        args = event.get("args", {})
        if (
            event.get("cat") != "Node"
            or not event.get("name", "").endswith("_kernel_time")
            or args.get("op_name") not in PRODUCTS
            or event["ts"] < begin
        ):
            continue
        # The weights are prepacked constants, shown without a shape: N is the output's.
        a = next(iter(args["input_type_shape"][0].values()))
        out = next(iter(args["output_type_shape"][0].values()))
        shapes.append((int(np.prod(a[:-1])), int(a[-1]), int(out[-1])))
    return shapes


def products_alone(shapes: list[tuple[int, int, int]]) -> Callable[[], Any]:
    """One call of a graph that runs these products and nothing else (one thread)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inputs, outputs, weights, feed = [], [], [], [], {}
    for i, (m, k, n) in enumerate(shapes):
        inputs.append(helper.make_tensor_value_info(f"a{i}", TensorProto.UINT8, [m, k]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.INT32, [m, n]))
        w = rng.integers(-127, 128, size=(k, n), dtype=np.int8)
        weights.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMulInteger", [f"a{i}", f"w{i}"], [f"y{i}"]))
        feed[f"a{i}"] = rng.integers(0, 256, size=(m, k), dtype=np.uint8)
    graph = helper.make_graph(nodes, "products", inputs, outputs, weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return partial(session.run, None, feed)


def timed_ms(run: Callable[[], float], reps: int) -> float:
    """Median of `reps` results of `run`, which times itself (seconds), in ms."""
    run()
    return statistics.median(run() for _ in range(reps)) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rows", type=int, default=1, help="prefill rows (streams joining)")
    parser.add_argument("--source", type=int, default=30, help="source tokens a row")
    parser.add_argument(
        "--positions", type=int, default=25, help="start token + prefix + draft a row"
    )
    parser.add_argument("--read", type=int, default=23, help="draft positions read a row")
    parser.add_argument("--reps", type=int, default=20, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not 1 <= args.read <= args.positions:
        parser.error("--read must be 1 to --positions")
    if not (args.model / "config.json").exists():
        print(f"no model at {args.model}: run models/build_benchmark_model.py", file=sys.stderr)
        return 2

    from engine import Translator
    from engine.decoding.scheduler import SchedulerOptions
    from engine.model.layouts import EncoderOutput
    from engine.model.logits import HEAD_POSITIONS, RowLogits
    from engine.model.marian import MarianOnnx
    from engine.model.masked import MaskedDecoder

    one = SchedulerOptions(lanes=1, threads_per_lane=1, head_threads=1)
    translator = Translator.from_dir(args.model, quantized=True, scheduler=one)
    rng = np.random.default_rng(0)
    source = rng.integers(5, 60000, size=(1, args.source))
    ids = rng.integers(5, 60000, size=(args.rows, args.positions))
    mask = np.ones_like(ids)
    needed = np.full(args.rows, args.positions - args.read)

    def pieces(model: MarianOnnx) -> dict[str, Callable[[], Any]]:
        decoder = model.masked
        assert isinstance(decoder, MaskedDecoder)
        one_source = model.encode(source, np.ones_like(source))
        enc = EncoderOutput(
            np.repeat(one_source.hidden_states, args.rows, axis=0),
            np.ones((args.rows, args.source), dtype=np.int64),
        )

        def body() -> RowLogits:
            return decoder.prefill(enc, ids, mask, needed)[0]

        return {
            "encoder, one source": partial(model.encode, source, np.ones_like(source)),
            "prefill body": body,
        }

    def read(logits: RowLogits) -> None:
        """Read each row's draft positions in order, as a search verifying it does."""
        for r in range(args.rows):
            positions = logits.row(r, args.positions - args.read)
            for i in range(len(positions)):
                positions[i]

    run = pieces(translator.model)

    def projection() -> float:
        """The draft's positions projected as the searches read them, right after the
        body (as in a lane: the body's weights pass through the caches first)."""
        logits = run["prefill body"]()
        began = time.perf_counter()
        read(logits)
        return time.perf_counter() - began

    with tempfile.TemporaryDirectory() as tmp:
        options = replace(translator.model.options, profile=str(Path(tmp) / "ort"))
        profiled = MarianOnnx(translator.model.model_dir, translator.config, options)
        runs = pieces(profiled)
        masked = profiled.masked
        assert isinstance(masked, MaskedDecoder) and masked.prefills.head is not None
        runs["encoder, one source"]()
        read(runs["prefill body"]())  # the body's last run, then the head's calls
        calls = -(-args.rows * args.read // HEAD_POSITIONS)
        shapes = {
            "encoder, one source": last_products(profiled.encoder.end_profiling(), 1),
            "prefill body": last_products(masked.prefills.session.end_profiling(), 1),
            "projection": last_products(masked.prefills.head[0].end_profiling(), calls),
        }
        del profiled, runs, masked

    engine: dict[str, Callable[[], float]] = {
        "encoder, one source": partial(seconds, run["encoder, one source"]),
        "prefill body": partial(seconds, run["prefill body"]),
        "projection": projection,
    }
    alone = {name: partial(seconds, products_alone(s)) for name, s in shapes.items()}
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in engine}
    for _ in range(args.rounds):  # alternated: the machine's speed drifts
        for name in engine:
            rounds[name].append(
                (timed_ms(engine[name], args.reps), timed_ms(alone[name], args.reps))
            )
    translator.close()

    print(f"CPU: {cpu_name()}; one thread; int8 per token")
    print(
        f"{args.rows} row(s): source {args.source} tokens, {args.positions} positions, "
        f"{args.read} read; medians of {args.rounds} rounds of {args.reps} calls"
    )
    print(f"  {'piece':22s} {'engine ms':>9s} {'products ms':>11s} {'share':>6s} {'GMAC/s':>7s}")
    total = [0.0, 0.0]
    for name, pairs in rounds.items():
        ms = statistics.median(p[0] for p in pairs)
        products = statistics.median(p[1] for p in pairs)
        macs = sum(m * k * n for m, k, n in shapes[name])
        total[0] += ms
        total[1] += products
        print(
            f"  {name:22s} {ms:9.2f} {products:11.2f} {products / ms:6.0%} "
            f"{macs / products / 1e6:7.0f}"
        )
    print(f"  {'together':22s} {total[0]:9.2f} {total[1]:11.2f} {total[1] / total[0]:6.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
