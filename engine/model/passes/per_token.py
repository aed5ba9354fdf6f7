"""int8 graphs whose tokens do not depend on each other: activations quantized per token.

The int8 files (`onnxruntime.quantization.quantize_dynamic`, Xenova's hub files too)
quantize each matmul's input with `DynamicQuantizeLinear`: one scale and zero point over the
whole tensor, batch rows and tokens included. So a token's int8 values depend on whatever
else shares its call: batch mates of other streams, padding, the other tokens of a forced
prefix or of a lookahead. Continuous batching must give each row what decoding it alone
gives, so `per_token` rewrites every such quantization to one scale and zero point per token
(per vector along the matmul's inner axis), with the arithmetic of `DynamicQuantizeLinear`
(range widened to include 0, scale = range / 255, zero point and values rounded half to
even, saturated to uint8), so that a call with one token gives the files' own values.

`MatMulInteger` takes the activations' zero point only as a scalar in ONNX Runtime, so the
rewritten matmul runs without it and corrects for it, exactly in int32:
`sum_k (q - zp) (w - wz) = sum_k q (w - wz) - zp * colsum(w - wz)`. The correction is done
inside the matmul where it can be (`correction_rows`): the values get a few more columns,
each the token's zero point, and the weights as many rows, which hold `-colsum(w - wz)`
cut into pieces of the weights' type (4-6% more rows on the benchmark model: OPUS-MT's
sizes, random weights). A multiply and a subtraction over the whole output (two more
passes per matmul, which would make per-token scales clearly dearer than the files' fused
kernels) become part of the matmul. Where the pieces cannot fit (uint8 weights with zero
point 0), the column sums are an int32 initializer and the correction is subtracted after.
The scale product downstream (`Mul(scale, w_scale)`, then `Mul(product, Cast(int32))`)
already broadcasts a [..., 1] scale. Sessions of these graphs are opened without ONNX
Runtime's `MatMulIntegerToFloat` fusion (`engine.model.sessions.PER_TOKEN_FUSIONS_OFF`),
which would round differently.

What it changes: the values of a call with several tokens differ from the files' (each
token on its own scale, which is closer to fp32, not farther); a call of one token gives the
files' values, so the loader keeps the files' graph, with its fused kernels, for one-row
one-token steps. A quantization whose outputs feed anything but `MatMulInteger` (values and
zero point) and `Mul` (scale) is left alone and reported: the caller then knows the graph is
not per token.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engine.model.names import PER_TOKEN_KEY
from engine.model.passes.graph import load_model, opset

log = logging.getLogger(__name__)

_PREFIX = "per_token"


class NotPerToken(Exception):
    """A graph's int8 activation quantization could not be made per token (why)."""


@dataclass(frozen=True)
class PerToken:
    """What `per_token` did to a graph."""

    quantizations: int  # DynamicQuantizeLinear nodes replaced
    matmuls: int  # MatMulInteger nodes given their zero-point correction


_CHAIN = ("Cast", "Clip", "Add", "Round", "Div")
"""Op types from a per-token quantization's uint8 values back to the float input it divides."""


def activation_source(producer: Mapping[str, onnx.NodeProto], values: str) -> str | None:
    """The float tensor whose quantization `values` (a `MatMulInteger` input) is, under
    either scheme (`DynamicQuantizeLinear` or `per_token`'s chain); None if neither."""
    node = producer.get(values)
    if node is not None and node.op_type == "Concat":  # widened by zero-point columns
        node = producer.get(str(node.input[0]))
    if node is not None and node.op_type == "DynamicQuantizeLinear":
        return str(node.input[0])
    for kind in _CHAIN:
        if node is None or node.op_type != kind:
            return None
        source = str(node.input[0])
        node = producer.get(source)
    return source


def per_token_graph(source: Path | bytes | onnx.ModelProto, name: str) -> bytes | None:
    """`source` (a file, serialised model or model, not modified) with its int8 activations
    quantized per token, serialised for `InferenceSession`; None when it has no
    `DynamicQuantizeLinear` (fp32) or when `per_token` refuses it (logged: the caller runs
    the graph as it is, batch-dependent in int8)."""
    model = load_model(source)
    try:
        done = per_token(model)
    except NotPerToken as exc:
        log.warning("%s: int8 activations stay quantized per call (%s)", name, exc)
        return None
    return model.SerializeToString() if done.quantizations else None


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """`graph` and every subgraph (an `If` branch of a merged decoder), outer first."""
    out = [graph]
    for node in graph.node:
        for attr in node.attribute:
            if attr.g.node:
                out.extend(_graphs(attr.g))
            for sub in attr.graphs:
                out.extend(_graphs(sub))
    return out


class _Emitter:
    """The nodes and constants that replace one quantization and its matmuls, all named
    under one tag (the outputs the rest of the graph reads keep their names)."""

    def __init__(self, tag: str, keep: set[str], axes_input: bool) -> None:
        self.tag, self.keep, self.axes_input = tag, keep, axes_input
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.point_int32: str | None = None  # the zero point as int32, once a matmul needs it

    def const(self, suffix: str, value: np.ndarray[Any, Any]) -> str:
        name = f"{self.tag}/{suffix}"
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def op(self, kind: str, inputs: list[str], out: str, **attrs: Any) -> str:
        name = out if out in self.keep else f"{self.tag}/{out}"
        self.nodes.append(helper.make_node(kind, inputs, [name], name=f"{self.tag}/{out}", **attrs))
        return name

    def quantize(self, x: str, values: str, scale: str) -> str:
        """`DynamicQuantizeLinear`'s arithmetic over the last axis: `values` (uint8) and
        `scale` [..., 1] under their old names; returns the zero point [..., 1] (float,
        a whole number in 0..255)."""
        zero = self.const("zero", np.array(0.0, dtype=np.float32))
        levels = self.const("levels", np.array(255.0, dtype=np.float32))
        # Smallest normal float: an all-zero token gets values 0 instead of 0 / 0.
        tiny = self.const("tiny", np.array(np.finfo(np.float32).tiny, dtype=np.float32))
        if self.axes_input:
            axes = self.const("axes", np.array([-1], dtype=np.int64))
            top = self.op("ReduceMax", [x, axes], "max", keepdims=1)
            bottom = self.op("ReduceMin", [x, axes], "min", keepdims=1)
        else:
            top = self.op("ReduceMax", [x], "max", keepdims=1, axes=[-1])
            bottom = self.op("ReduceMin", [x], "min", keepdims=1, axes=[-1])
        high = self.op("Max", [top, zero], "high")
        low = self.op("Min", [bottom, zero], "low")
        spread = self.op("Div", [self.op("Sub", [high, low], "range"), levels], "spread")
        step = self.op("Max", [spread, tiny], scale)
        below = self.op("Neg", [self.op("Div", [low, step], "low_steps")], "neg")
        point = self.op("Round", [below], "zp")
        rounded = self.op("Round", [self.op("Div", [x, step], "steps")], "rounded")
        shifted = self.op("Add", [rounded, point], "shifted")
        clipped = self.op("Clip", [shifted, zero, levels], "clip")
        self.op("Cast", [clipped], values, to=TensorProto.UINT8)
        return point

    def widen(self, values: str, point: str, columns: int) -> str:
        """`values` with `columns` more columns, each the token's zero point (uint8), for
        the matmuls whose weights `correction_rows` widened."""
        zp = self.op("Cast", [point], "zp_uint8", to=TensorProto.UINT8)
        width = self.const("columns", np.array([columns], dtype=np.int64))
        repeated = self.op("Expand", [zp, width], "zp_columns")
        return self.op("Concat", [values, repeated], "widened", axis=-1)

    def widened_matmul(
        self, index: int, matmul: onnx.NodeProto, widened: str, weights: np.ndarray[Any, Any]
    ) -> list[onnx.NodeProto]:
        """`matmul` on the widened values and weights: its zero-point correction is done
        by the matmul itself, exact in int32, under the matmul's output name."""
        name = self.const(f"weights{index}", weights)
        inputs = [widened, name, "", *matmul.input[3:4]]
        return [
            helper.make_node(
                "MatMulInteger", inputs, [matmul.output[0]], name=f"{self.tag}/matmul{index}"
            )
        ]

    def matmul(
        self,
        index: int,
        matmul: onnx.NodeProto,
        values: str,
        point: str,
        weights: np.ndarray[Any, Any],
        weight_zero: np.ndarray[Any, Any] | None,
    ) -> list[onnx.NodeProto]:
        """`matmul` without the activations' zero point, then minus zero point times the
        weights' column sums, in int32 (exact), under the matmul's output name."""
        centred = weights.astype(np.int32) - (
            0 if weight_zero is None else weight_zero.astype(np.int32)
        )
        sums = self.const(f"colsum{index}", centred.sum(axis=-2).astype(np.int32))
        raw, correction = f"{self.tag}/raw{index}", f"{self.tag}/correction{index}"
        inputs = [values, matmul.input[1], "", *matmul.input[3:4]]
        if self.point_int32 is None:
            self.point_int32 = self.op("Cast", [point], "zp_int32", to=TensorProto.INT32)
        return [
            helper.make_node("MatMulInteger", inputs, [raw], name=f"{self.tag}/matmul{index}"),
            helper.make_node("Mul", [self.point_int32, sums], [correction], name=correction),
            helper.make_node(
                "Sub", [raw, correction], [matmul.output[0]], name=f"{self.tag}/out{index}"
            ),
        ]


MAX_CORRECTION_ROWS = 1 / 4
"""Most rows `correction_rows` adds to a matmul's weights, as a share of their rows: past
that the wider matmul would cost more than the two passes it saves."""


def correction_rows(
    weights: np.ndarray[Any, Any], weight_zero: np.ndarray[Any, Any] | None
) -> np.ndarray[Any, Any] | None:
    """Rows to append to `weights` (their dtype) so that a token's values widened by as
    many columns of its zero point `zp` give `sum_k (q - zp) (w - wz)` in one
    `MatMulInteger`: the rows hold `-colsum(w - wz)` cut into pieces that fit the
    weights' type (stored plus `wz`), so the matmul adds `-zp * colsum`. This replaces a
    multiply and a subtraction over the whole output (the correction) by a few more
    rows, exact in int32 either way. None when the pieces do not fit (`wz` at an end of
    the type) or would take more than `MAX_CORRECTION_ROWS` of the rows."""
    info = np.iinfo(weights.dtype)
    zero = np.zeros(weights.shape[-1], np.int64) if weight_zero is None else weight_zero
    zero = np.broadcast_to(np.asarray(zero, np.int64), (weights.shape[-1],))
    target = -(weights.astype(np.int64) - zero).sum(axis=-2)
    low, high = info.min - zero, info.max - zero  # what one row may hold, per column
    if np.any((target < 0) & (low >= 0)) or np.any((target > 0) & (high <= 0)):
        return None
    step = np.where(target < 0, -low, high).clip(min=1)
    count = int(((np.abs(target) + step - 1) // step).max()) if target.size else 0
    if count > weights.shape[-2] * MAX_CORRECTION_ROWS:
        return None
    rows = np.zeros((count, weights.shape[-1]), np.int64)
    left = target.copy()
    for j in range(count):
        rows[j] = np.clip(left, low, high)
        left -= rows[j]
    assert not left.any()
    stored: np.ndarray[Any, Any] = (rows + zero).astype(weights.dtype)
    return stored


def per_token(model: onnx.ModelProto) -> PerToken:
    """Rewrite `model` in place so that every `DynamicQuantizeLinear` feeding
    `MatMulInteger` quantizes per token. Raises `NotPerToken` (the graph unchanged) when
    one of them feeds something else or a weight is not a constant. A graph without int8
    activations (fp32) comes back unchanged with zero counts."""
    if opset(model) < 13:
        raise NotPerToken(f"opset {opset(model)} < 13")
    graphs = _graphs(model.graph)
    weights: dict[str, onnx.TensorProto] = {}
    for graph in graphs:
        weights.update({i.name: i for i in graph.initializer})

    def constant(name: str) -> np.ndarray[Any, Any] | None:
        if name in weights:
            return np.asarray(numpy_helper.to_array(weights[name]))
        return None

    # Plan everything before editing, so that a refusal leaves the graph as it was.
    plans: list[tuple[onnx.GraphProto, int, list[int]]] = []
    for graph in graphs:
        consumers: dict[str, list[int]] = {}
        for i, node in enumerate(graph.node):
            for name in node.input:
                consumers.setdefault(name, []).append(i)
        for i, node in enumerate(graph.node):
            if node.op_type != "DynamicQuantizeLinear":
                continue
            values, scale, zero = node.output
            matmuls = sorted(set(consumers.get(values, [])))
            for j in matmuls:
                user = graph.node[j]
                if user.op_type != "MatMulInteger" or user.input[0] != values:
                    raise NotPerToken(f"{node.name}: values feed {user.op_type} {user.name}")
                if len(user.input) < 3 or user.input[2] != zero:
                    raise NotPerToken(f"{user.name}: not fed the zero point of {node.name}")
                if constant(user.input[1]) is None:
                    raise NotPerToken(f"{user.name}: weight {user.input[1]} is not a constant")
                if len(user.input) > 3 and user.input[3] and constant(user.input[3]) is None:
                    raise NotPerToken(f"{user.name}: weight zero point is not a constant")
            if set(consumers.get(zero, [])) - set(matmuls):
                raise NotPerToken(f"{node.name}: zero point feeds more than MatMulInteger")
            for j in consumers.get(scale, []):
                if graph.node[j].op_type != "Mul":
                    raise NotPerToken(f"{node.name}: scale feeds {graph.node[j].op_type}")
            plans.append((graph, i, matmuls))

    # id(graph) -> node index -> what replaces that node; a matmul's replacement stays
    # where the matmul was (after its quantization), so the order stays topological.
    edits: dict[int, dict[int, list[onnx.NodeProto]]] = {}
    added: dict[int, list[onnx.TensorProto]] = {}
    replaced: set[str] = set()  # weights a widened copy took the place of
    for index, (graph, at, matmuls) in enumerate(plans):
        node = graph.node[at]
        values, scale, _ = node.output
        emit = _Emitter(f"{_PREFIX}/{index}", {values, scale}, opset(model) >= 18)
        point = emit.quantize(node.input[0], values, scale)
        mine = edits.setdefault(id(graph), {})
        parts = []  # each matmul, its weights and zero point, its correction rows or None
        for j in matmuls:
            matmul = graph.node[j]
            w = constant(matmul.input[1])
            assert w is not None  # planned
            wz = constant(matmul.input[3]) if len(matmul.input) > 3 else None
            rows = correction_rows(w, wz) if w.ndim == 2 else None
            parts.append((j, matmul, w, wz, rows if rows is not None and len(rows) else None))
        # Every widened matmul reads the same values: pad each to the widest.
        width = max((len(rows) for *_, rows in parts if rows is not None), default=0)
        widened = emit.widen(values, point, width) if width else values
        for m, (j, matmul, w, wz, rows) in enumerate(parts):
            if rows is None:
                mine[j] = emit.matmul(m, matmul, values, point, w, wz)
                continue
            zero = np.zeros((), w.dtype) if wz is None else wz.astype(w.dtype)
            pad = np.broadcast_to(zero, (width - len(rows), w.shape[-1]))  # adds nothing
            mine[j] = emit.widened_matmul(m, matmul, widened, np.concatenate([w, rows, pad]))
            replaced.add(str(matmul.input[1]))
        mine[at] = emit.nodes
        added.setdefault(id(graph), []).extend(emit.initializers)
    for graph in graphs:
        if id(graph) not in edits:
            continue
        replace = edits[id(graph)]
        nodes = [new for i, old in enumerate(graph.node) for new in replace.get(i, [old])]
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.extend(added[id(graph)])
    # The widened copies replace their weights: drop those no node reads any more, or
    # the serialised graph carries both (55 of 145 MiB on OPUS-MT's decoder).
    read = {name for graph in graphs for node in graph.node for name in node.input}
    read |= {output.name for graph in graphs for output in graph.output}
    for graph in graphs:
        kept = [i for i in graph.initializer if i.name not in replaced or i.name in read]
        if len(kept) < len(graph.initializer):
            del graph.initializer[:]
            graph.initializer.extend(kept)
    if plans:
        props = {p.key: p for p in model.metadata_props}
        prop = props.get(PER_TOKEN_KEY) or model.metadata_props.add()
        prop.key, prop.value = PER_TOKEN_KEY, "1"
    return PerToken(len(plans), sum(len(m) for _, _, m in plans))
