"""What it would cost to make int8 rows independent of their batch mates.

The int8 files (`quantize_dynamic`) quantize a matmul's activations with
`DynamicQuantizeLinear`: one scale and zero point for the whole input tensor, batch rows
included, so a row's int8 logits move with the other rows of its step (see
`tests/test_scheduler.py::tolerance`). This builds the OPUS-MT output projection (512 x
65001, the largest matmul of a step) three ways and times B = 1 and 16 rows (one token
each, as a cached step feeds them) on 1 and 2 threads:

- `dynamic`: the files' own `DynamicQuantizeLinear` + `MatMulInteger` (+ Cast, Mul);
- `per-row`: the same arithmetic with one scale and zero point per row (token), as the
  engine runs int8 (`engine.model.passes.per_token.per_token` applied to `dynamic`: standard
  ops, `MatMulInteger` without the first input's zero point, which ONNX Runtime only
  takes as a scalar, and the zero point times the weights' column sums subtracted after);
- `nbits`: `MatMulNBits` with the same int8 weights (one block scale each) and
  `accuracy_level=4`, which quantizes activations per row and block of 32 (other values
  than the files' own).

For each it prints the largest difference between 16 rows run together and each row run
alone through `dynamic` (per-row: 0 means bit for bit what decoding alone gives). Alone,
the projection's 33 MB of weights may stay in a 32 MB L3 between calls, which a real
step's other 22 MB evict: compare the variants with each other, not with step times.

    python examples/benchmarks/int8_rows.py
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

# this checkout's engine, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_anatomy import median_ms

K, N, BLOCK = 512, 65001, 32


def _models() -> dict[str, Any]:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from engine.model.passes.per_token import per_token

    rng = np.random.default_rng(0)
    weights = rng.integers(-127, 128, (K, N)).astype(np.int8)
    scale = np.float32(0.003)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 1, K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    shared = [
        numpy_helper.from_array(weights, "W"),
        numpy_helper.from_array(np.array(0, np.int8), "wz"),
        numpy_helper.from_array(np.array(scale, np.float32), "ws"),
    ]

    def model(nodes: list[Any], inits: list[Any], opset: int, ms: bool = False) -> Any:
        imports = [helper.make_opsetid("", opset)]
        if ms:
            imports.append(helper.make_opsetid("com.microsoft", 1))
        return helper.make_model(
            helper.make_graph(nodes, "g", [x], [y], inits), opset_imports=imports
        )

    node = helper.make_node
    dynamic = model(
        [
            node("DynamicQuantizeLinear", ["x"], ["q", "xs", "xz"]),
            node("MatMulInteger", ["q", "W", "xz", "wz"], ["y32"]),
            node("Cast", ["y32"], ["yf"], to=TensorProto.FLOAT),
            node("Mul", ["xs", "ws"], ["sc"]),
            node("Mul", ["yf", "sc"], ["y"]),
        ],
        shared,
        17,
    )

    # The engine's rewrite (what `MarianOnnx` runs for int8), applied to the files' graph.
    per_row = onnx.ModelProto()
    per_row.CopyFrom(dynamic)
    per_token(per_row)
    shifted = (weights.T.astype(np.int16) + 128).astype(np.uint8).reshape(N, K // BLOCK, BLOCK)
    nbits = model(
        [
            node(
                "MatMulNBits",
                ["x", "B", "scales", "zeros"],
                ["y"],
                domain="com.microsoft",
                K=K,
                N=N,
                bits=8,
                block_size=BLOCK,
                accuracy_level=4,
            )
        ],
        [
            numpy_helper.from_array(shifted, "B"),
            numpy_helper.from_array(np.full(N * K // BLOCK, scale, np.float32), "scales"),
            numpy_helper.from_array(np.full(N * K // BLOCK, 128, np.uint8), "zeros"),
        ],
        17,
        ms=True,
    )
    return {"dynamic": dynamic, "per-row": per_row, "nbits": nbits}


def main() -> int:
    import onnxruntime as ort

    models = _models()
    rows = np.random.default_rng(1).standard_normal((16, 1, K)).astype(np.float32)
    print(f"onnxruntime {ort.__version__}; projection {K} x {N}; medians of 40 calls")
    print(f"{'threads':>7} {'variant':>8} {'B=1 ms':>8} {'B=16 ms':>8} {'vs alone':>9}")
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        sessions = {
            name: ort.InferenceSession(
                m.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
            for name, m in models.items()
        }
        reference = sessions["dynamic"]
        alone = np.concatenate([reference.run(None, {"x": rows[i : i + 1]})[0] for i in range(16)])
        for name, session in sessions.items():
            together = session.run(None, {"x": rows})[0]
            one = median_ms(partial(session.run, None, {"x": rows[:1]}), 40, warmup=1)
            many = median_ms(partial(session.run, None, {"x": rows}), 40, warmup=1)
            diff = float(np.abs(together - alone).max())
            print(f"{threads:>7} {name:>8} {one:>8.3f} {many:>8.3f} {diff:>9.3g}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
