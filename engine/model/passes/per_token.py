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

The rewrite runs on the flattened tokens [M, K] (`Flatten`; the results get their shape
back with `Reshape`): ONNX's per-axis `QuantizeLinear` and `DequantizeLinear` take a scale
per row only as a 1-D tensor along one axis. Each token's range, step and zero point come
from a few ops on [M] tensors; its values from one per-axis `QuantizeLinear` (divide by the
step, round half to even, add the zero point, saturate: `DynamicQuantizeLinear`'s own
arithmetic, bit for bit in ONNX Runtime, which the tests check), where an elementwise chain
would make five passes over the activations.

`MatMulInteger` takes the activations' zero point only as a scalar in ONNX Runtime, so the
rewritten matmul runs without it and corrects for it, exactly in int32:
`sum_k (q - zp) (w - wz) = sum_k q (w - wz) - zp * colsum(w - wz)`. The correction is done
inside the matmul where it can be (`correction_rows`): the values get a few more columns,
each the token's zero point (the activations padded with zeros, which quantize to it), and
the weights as many rows, which hold `-colsum(w - wz)` cut into pieces of the weights' type
(a few percent more rows: docs/performance.md#figures-behind-the-codes-choices). A multiply and a
subtraction over the whole output (two more passes per matmul) become part of the matmul.
Where the pieces cannot fit (uint8 weights with zero point 0), the column sums are an int32
initializer and the correction is subtracted after.

The files turn the int32 result into floats with `Mul(Cast(result), Mul(scale, w_scale))`;
with a scalar weight scale that is one per-axis `DequantizeLinear` of the flat result by
the token's product (int32, no zero point: `float(result) * product`, the same two
roundings), one pass instead of two. Any other reader of the result or of the scale gets
it as before, in the shape it had. Sessions of these graphs are opened without ONNX
Runtime's `MatMulIntegerToFloat` fusion (`engine.model.sessions.PER_TOKEN_FUSIONS_OFF`),
which would round differently where the files' `Cast -> Mul` stays.

What it changes: the values of a call with several tokens differ from the files' (each
token on its own scale, which is closer to fp32, not farther); a call of one token gives the
files' values, so the loader keeps the files' graph, with its fused kernels, for one-row
one-token steps. A quantization whose outputs feed anything but `MatMulInteger` (values and
zero point) and `Mul` (scale), or a matmul whose weights are not a 2-D constant, leaves the
graph alone and is reported: the caller then knows the graph is not per token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
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


def activation_source(producer: Mapping[str, onnx.NodeProto], values: str) -> str | None:
    """The float tensor whose quantization `values` (a `MatMulInteger` input) is, under
    either scheme (`DynamicQuantizeLinear` or `per_token`'s `QuantizeLinear` of its
    flattened, maybe padded view); None if neither."""
    node = producer.get(values)
    if node is not None and node.op_type == "DynamicQuantizeLinear":
        return str(node.input[0])
    if node is None or node.op_type != "QuantizeLinear":
        return None
    node = producer.get(str(node.input[0]))
    if node is not None and node.op_type == "Pad":  # zero columns for the correction rows
        node = producer.get(str(node.input[0]))
    if node is None or node.op_type != "Flatten":
        return None
    return str(node.input[0])


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


@dataclass(frozen=True)
class _Scaled:
    """A matmul's float output as `quantize_dynamic` writes it, `Mul(Cast(int32),
    Mul(scale, weight_scale))`, with a scalar weight scale: the three nodes (by index)
    that one `DequantizeLinear` replaces."""

    cast: int
    product: int
    mul: int
    weight_scale: str


class _Links:
    """Who reads and who writes each name in one graph, to find what `_Scaled` replaces."""

    def __init__(self, graph: onnx.GraphProto, outer: set[str]) -> None:
        self.graph, self.outer = graph, outer  # outer: names read by the other graphs
        self.consumers: dict[str, list[int]] = {}
        self.producer: dict[str, int] = {}
        for i, node in enumerate(graph.node):
            for name in node.input:
                self.consumers.setdefault(name, []).append(i)
            for name in node.output:
                self.producer[name] = i
        self.outputs = {o.name for o in graph.output}

    def sole(self, name: str, op_type: str) -> int | None:
        """The one node that reads `name`, if it is an `op_type` and nothing else (no
        other graph, no graph output) reads `name`."""
        users = self.consumers.get(name, [])
        if len(users) != 1 or name in self.outputs or name in self.outer:
            return None
        return users[0] if self.graph.node[users[0]].op_type == op_type else None

    def scaled(
        self,
        matmul: onnx.NodeProto,
        scale: str,
        constant: Callable[[str], np.ndarray[Any, Any] | None],
    ) -> _Scaled | None:
        """Whether `matmul`'s result is only `Mul(Cast(it), Mul(scale, w))` with a scalar
        float constant `w` (`quantize_dynamic`'s form), and which nodes those are."""
        nodes = self.graph.node
        cast = self.sole(str(matmul.output[0]), "Cast")
        if cast is None or helper.get_node_attr_value(nodes[cast], "to") != TensorProto.FLOAT:
            return None
        floats = str(nodes[cast].output[0])
        mul = self.sole(floats, "Mul")
        others = [] if mul is None else [n for n in nodes[mul].input if n != floats]
        if mul is None or len(others) != 1 or self.sole(others[0], "Mul") != mul:
            return None
        at = self.producer.get(others[0])
        factors = [] if at is None else list(nodes[at].input)
        if at is None or nodes[at].op_type != "Mul" or len(factors) != 2:
            return None
        if factors.count(scale) != 1:
            return None
        weight_scale = factors[1 - factors.index(scale)]
        value = constant(weight_scale)
        if value is None or value.size != 1 or value.ndim > 1 or value.dtype != np.float32:
            return None  # [1, 1] would make the product 2-D, not a per-axis scale
        return _Scaled(cast, at, mul, weight_scale)


class _Emitter:
    """The nodes and constants that replace one quantization and its matmuls, all named
    under one tag (the outputs the rest of the graph reads keep their names and shapes).

    Everything big runs on the flattened view [M, K] of the activations (M tokens): a
    per-axis `QuantizeLinear` and `DequantizeLinear` take their per-token scale only as a
    1-D tensor along one axis."""

    def __init__(self, tag: str, x: str, version: int) -> None:
        self.tag, self.x, self.version = tag, x, version
        self.nodes: list[onnx.NodeProto] = []  # placed where the quantization was
        self.initializers: list[onnx.TensorProto] = []
        self.flat = self.op("Flatten", [x], "flat", axis=-1)
        self.step = self.point = self.point_uint8 = ""  # set by `quantize`
        self._lead: str | None = None
        self._shapes: dict[int, str] = {}
        self._columns: str | None = None
        self._point_int32: str | None = None

    def const(self, suffix: str, value: np.ndarray[Any, Any]) -> str:
        name = f"{self.tag}/{suffix}"
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def op(
        self,
        kind: str,
        inputs: list[str],
        out: str,
        into: list[onnx.NodeProto] | None = None,
        **attrs: Any,
    ) -> str:
        """One node writing `{tag}/{out}` (or `out` itself where it starts with "=":
        a name the rest of the graph reads), appended to `into` (default: `nodes`)."""
        name = out[1:] if out.startswith("=") else f"{self.tag}/{out}"
        node = helper.make_node(kind, inputs, [name], name=f"{self.tag}/{out.lstrip('=')}", **attrs)
        (self.nodes if into is None else into).append(node)
        return name

    def quantize(self, width: int) -> str:
        """`DynamicQuantizeLinear`'s arithmetic per token: the step (scale) and zero point
        [M] of each row of the flattened activations, and their uint8 values [M, K + width]
        (returned) from one `QuantizeLinear`, which divides, rounds half to even, adds
        the zero point and saturates as the files' kernel does (checked bit for bit by the
        tests). The activations get `width` more columns of zeros first (`Pad`), which
        quantize to the zero point (the columns `correction_rows` needs) and put 0 in
        each token's range as the files' arithmetic does (0 < x or x < 0: the sign of a
        zero bound changes no bit of the step, zero point or values)."""
        levels = self.const("levels", np.array(255.0, dtype=np.float32))
        # Smallest normal float: an all-zero token gets values 0 instead of 0 / 0.
        tiny = self.const("tiny", np.array(np.finfo(np.float32).tiny, dtype=np.float32))
        source = self.flat
        if width:
            pads = self.const("pads", np.array([0, 0, 0, width], dtype=np.int64))
            source = self.op("Pad", [self.flat, pads], "padded")
        if self.version >= 18:
            axes = self.const("axes", np.array([1], dtype=np.int64))
            top = self.op("ReduceMax", [source, axes], "max", keepdims=0)
            bottom = self.op("ReduceMin", [source, axes], "min", keepdims=0)
        else:
            top = self.op("ReduceMax", [source], "max", keepdims=0, axes=[1])
            bottom = self.op("ReduceMin", [source], "min", keepdims=0, axes=[1])
        if not width:
            zero = self.const("zero", np.array(0.0, dtype=np.float32))
            top = self.op("Max", [top, zero], "high")
            bottom = self.op("Min", [bottom, zero], "low")
        spread = self.op("Div", [self.op("Sub", [top, bottom], "range"), levels], "spread")
        self.step = self.op("Max", [spread, tiny], "step")
        below = self.op("Neg", [self.op("Div", [bottom, self.step], "low_steps")], "neg")
        self.point = self.op("Round", [below], "zp")
        self.point_uint8 = self.op("Cast", [self.point], "zp_uint8", to=TensorProto.UINT8)
        return self.op("QuantizeLinear", [source, self.step, self.point_uint8], "values", axis=0)

    def shape(self, last: int) -> str:
        """The activations' shape with `last` for its last axis (int64 [rank]): what a
        flat [M, last] result is reshaped to for the rest of the graph."""
        if self._lead is None:
            if self.version >= 15:
                self._lead = self.op("Shape", [self.x], "lead", end=-1)
            else:
                whole = self.op("Shape", [self.x], "shape")
                starts = self.const("lead_start", np.array([0], dtype=np.int64))
                ends = self.const("lead_end", np.array([-1], dtype=np.int64))
                self._lead = self.op("Slice", [whole, starts, ends], "lead")
        if last not in self._shapes:
            tail = self.const(f"last{last}", np.array([last], dtype=np.int64))
            self._shapes[last] = self.op("Concat", [self._lead, tail], f"shape{last}", axis=0)
        return self._shapes[last]

    def scale(self, name: str) -> None:
        """The files' scale tensor [..., 1] under its name, for readers other than the
        products `dequantize` replaces."""
        self.op("Reshape", [self.step, self.shape(1)], f"={name}")

    def columns(self) -> str:
        """The zero point as a column [M, 1] (uint8)."""
        if self._columns is None:
            axis = self.const("column_axis", np.array([1], dtype=np.int64))
            self._columns = self.op("Unsqueeze", [self.point_uint8, axis], "zp_column")
        return self._columns

    def matmul(
        self,
        index: int,
        matmul: onnx.NodeProto,
        values: str,
        weights: str,
        sums: np.ndarray[Any, Any] | None,
        into: list[onnx.NodeProto],
    ) -> str:
        """`matmul` on the flat values and `weights` (its own, or a copy with rows for the
        values' added columns), int32 [M, N] (returned). Without `sums` those rows subtract
        the zero point's share (`correction_rows`); else the matmul runs without the
        activations' zero point and `zp * sums` (`colsum(w - wz)`) is subtracted after,
        exact in int32 either way."""
        inputs = [values, weights, "", *matmul.input[3:4]]
        raw = self.op("MatMulInteger", inputs, f"matmul{index}", into)
        if sums is None:
            return raw
        total = self.const(f"colsum{index}", sums)
        if self._point_int32 is None:
            self._point_int32 = self.op("Cast", [self.columns()], "zp_int32", to=TensorProto.INT32)
        correction = self.op("Mul", [self._point_int32, total], f"correction{index}", into)
        return self.op("Sub", [raw, correction], f"corrected{index}", into)

    def dequantize(
        self,
        index: int,
        weight_scale: str,
        raw: str,
        out: str,
        columns: int,
        into: list[onnx.NodeProto],
    ) -> None:
        """`out` = `Mul(Cast(raw), Mul(scale, weight_scale))` in one pass: a per-axis
        `DequantizeLinear` of int32 without a zero point multiplies `float(raw)` by the
        token's product, the same two roundings (checked bit for bit by the tests)."""
        scaled = self.op("Mul", [self.step, weight_scale], f"product{index}", into)
        flat = self.op("DequantizeLinear", [raw, scaled], f"dequantized{index}", into, axis=0)
        self.op("Reshape", [flat, self.shape(columns)], f"={out}", into)

    def unflatten(self, raw: str, out: str, columns: int, into: list[onnx.NodeProto]) -> None:
        """The int32 result [M, N] under the matmul's own name and shape, for readers
        other than `Cast -> Mul` by a scalar weight scale."""
        self.op("Reshape", [raw, self.shape(columns)], f"={out}", into)


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
    one of them feeds something else or a weight is not a 2-D constant. A graph without
    int8 activations (fp32) comes back unchanged with zero counts."""
    if opset(model) < 13:
        raise NotPerToken(f"opset {opset(model)} < 13")
    graphs = _graphs(model.graph)
    weights: dict[str, onnx.TensorProto] = {}
    for graph in graphs:
        weights.update({i.name: i for i in graph.initializer})
    # Names each graph reads or outputs: a node this pass removes must have no reader
    # outside its own graph (a branch reads outer names by scope).
    reads = {
        id(g): {n for node in g.node for n in node.input} | {o.name for o in g.output}
        for g in graphs
    }

    def constant(name: str) -> np.ndarray[Any, Any] | None:
        if name in weights:
            return np.asarray(numpy_helper.to_array(weights[name]))
        return None

    # Plan everything before editing, so that a refusal leaves the graph as it was.
    plans: list[tuple[onnx.GraphProto, int, list[int], dict[int, _Scaled], bool]] = []
    for graph in graphs:
        links = _Links(graph, set().union(*(reads[id(g)] for g in graphs if g is not graph)))
        consumers, outputs = links.consumers, links.outputs
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
                w = constant(user.input[1])
                if w is None or w.ndim != 2:
                    raise NotPerToken(f"{user.name}: weight {user.input[1]} is not a 2-D constant")
                if len(user.input) > 3 and user.input[3] and constant(user.input[3]) is None:
                    raise NotPerToken(f"{user.name}: weight zero point is not a constant")
            if set(consumers.get(zero, [])) - set(matmuls):
                raise NotPerToken(f"{node.name}: zero point feeds more than MatMulInteger")
            for j in consumers.get(scale, []):
                if graph.node[j].op_type != "Mul":
                    raise NotPerToken(f"{node.name}: scale feeds {graph.node[j].op_type}")
            found = {j: links.scaled(graph.node[j], scale, constant) for j in matmuls}
            outs = {j: s for j, s in found.items() if s is not None}
            products = {s.product for s in outs.values()}
            # The files' scale [..., 1] stays for any other reader.
            keep_scale = bool(set(consumers.get(scale, [])) - products)
            plans.append((graph, i, matmuls, outs, keep_scale or scale in outputs | links.outer))

    # id(graph) -> node index -> what replaces that node; a matmul's replacement stays
    # where the matmul was (after its quantization), so the order stays topological.
    edits: dict[int, dict[int, list[onnx.NodeProto]]] = {}
    added: dict[int, list[onnx.TensorProto]] = {}
    replaced: set[str] = set()  # weights a widened copy took the place of
    for index, (graph, at, matmuls, outs, keep_scale) in enumerate(plans):
        node = graph.node[at]
        scale = str(node.output[1])
        emit = _Emitter(f"{_PREFIX}/{index}", str(node.input[0]), opset(model))
        mine = edits.setdefault(id(graph), {})
        parts = []  # each matmul, its weights and zero point, its correction rows or None
        for j in matmuls:
            matmul = graph.node[j]
            w = constant(matmul.input[1])
            assert w is not None  # planned
            wz = constant(matmul.input[3]) if len(matmul.input) > 3 else None
            rows = correction_rows(w, wz)
            parts.append((j, matmul, w, wz, rows if rows is not None and len(rows) else None))
        # Every matmul reads the same values: each one's rows are padded to the widest with
        # rows of its zero point, which add nothing.
        width = max((len(rows) for *_, rows in parts if rows is not None), default=0)
        values = emit.quantize(width)
        for m, (j, matmul, w, wz, rows) in enumerate(parts):
            into: list[onnx.NodeProto] = []
            zero = np.zeros((), w.dtype) if wz is None else wz.astype(w.dtype)
            sums = None
            if rows is None:
                rows = w[:0]
                centred = w.astype(np.int32) - zero.astype(np.int32)
                sums = centred.sum(axis=-2).astype(np.int32)
            name = str(matmul.input[1])
            if width:
                pad = np.broadcast_to(zero, (width - len(rows), w.shape[-1]))
                name = emit.const(f"weights{m}", np.concatenate([w, rows, pad]))
                replaced.add(str(matmul.input[1]))
            raw = emit.matmul(m, matmul, values, name, sums, into)
            out = outs.get(j)
            if out is None:
                emit.unflatten(raw, str(matmul.output[0]), w.shape[-1], into)
            else:
                result = str(graph.node[out.mul].output[0])
                emit.dequantize(m, out.weight_scale, raw, result, w.shape[-1], into)
                for gone in (out.cast, out.product, out.mul):
                    mine[gone] = []
            mine[j] = into
        if keep_scale:
            emit.scale(scale)
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
    # the serialised graph carries both (a third more bytes: docs/performance.md).
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
    return PerToken(len(plans), sum(len(m) for _, _, m, *_ in plans))
