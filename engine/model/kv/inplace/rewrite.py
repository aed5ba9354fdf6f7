"""Self-attention in place: rewrite the batchable decoder's step so that each layer's
self-attention reads its past keys and values where they are and writes the new
position there, instead of concatenating them into new arrays.

The masks rewrite (`passes.masks`) gives a with-past graph whose self-attention is the
export's own: `Concat(past, new)` into `present` (a copy of the whole state at every
step), `MatMul`, the mask, `Softmax` and `MatMul`. `rewrite_inplace` replaces that core,
layer by layer, with ONNX Runtime's `GroupQueryAttention` (contrib op; CPU and CUDA):

- its past inputs are buffers of `[rows, heads, capacity, head_dim]`, each row's real
  positions first; `SEQLENS_INPUT` [rows] int32 says where each row's new position goes
  (its length so far) and `TOTAL_INPUT` the longest row's length after the step;
- when the caller binds a layer's `present` outputs to its past buffers, ONNX Runtime
  writes the new position in place and copies nothing (`past_present_share_buffer`);
  unbound, `present` is the past grown by one position, as before;
- the scores are masked by each row's length and causally; the graph's own mask input
  (`MASK_INPUT`) is no longer read by self-attention, so a row's padding is never
  computed at all.

One token per row: `GroupQueryAttention` refuses several new tokens per row with a past
and more than one row, so lookahead keeps the ordinary step. Its arithmetic is one kernel
instead of `MatMul` and `Softmax`: logits agree with the ordinary step to about 1e-6 in
fp32, and each row's are its own (heads and rows are computed apart), so rows still equal
decoding alone over the same graphs.

Found by structure, never by node names: per layer, the `Concat` of the past key and of
the past value into their `present` outputs, the new keys and values before their split
into heads (`Transpose` of a `Reshape`), the scores `MatMul` that reads the present key's
transpose (through an optional scaling `Mul`) and the query's heads (the same), and the
`MatMul` over the present value followed by a `Transpose` and a `Reshape` back to
`[rows, tokens, hidden]`. A graph of any other shape gives None and a logged reason.
What the replaced cores leave unread is dropped (`passes.graph.live_nodes`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from engine.model.names import MASK_INPUT, PAST, PRESENT, SEQLENS_INPUT, TOTAL_INPUT
from engine.model.passes.graph import (
    GraphView,
    UnsortableGraph,
    attribute,
    live_nodes,
    load_model,
    reads,
    sorted_nodes,
)

log = logging.getLogger(__name__)

_PREFIX = "inplace_attention"
_CONTRIB = "com.microsoft"


class _Unsupported(Exception):
    """The graph does not have the structure this pass knows (message says why)."""


@dataclass(frozen=True)
class _Layer:
    """What one layer's self-attention core is replaced with: the packed query, key and
    value [rows, tokens, hidden], the scale of the scores, the tensor the core's output
    had, and the nodes that go (the rest of the core is dead once they do)."""

    index: int
    query: str
    key: str
    value: str
    scale: float
    output: str
    replaced: tuple[onnx.NodeProto, ...]


def rewrite_inplace(source: bytes | onnx.ModelProto, name: str) -> bytes | None:
    """The masked with-past graph `source` with its self-attention cores replaced by
    `GroupQueryAttention` (module docstring), serialised; None when the graph is not of
    the shape this pass knows (logged with the reason, under `name`)."""
    model = load_model(source)
    try:
        _rewrite(model)
    except _Unsupported as exc:
        log.info("%s: self-attention stays as exported (%s)", name, exc)
        return None
    serialised: bytes = model.SerializeToString()
    return serialised


def _rewrite(model: onnx.ModelProto) -> None:
    graph = model.graph
    view = GraphView(graph, {})
    layers = sorted(
        int(i.name.split(".")[1])
        for i in graph.input
        if i.name.startswith(f"{PAST}.") and i.name.endswith(".decoder.key")
    )
    if not layers:
        raise _Unsupported("no self-attention past inputs")
    found = [_find(view, layer) for layer in layers]
    heads = _heads(graph)
    gone = {id(node) for layer in found for node in layer.replaced}
    nodes = [node for node in graph.node if id(node) not in gone]
    for layer in found:
        nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [
                    layer.query,
                    layer.key,
                    layer.value,
                    f"{PAST}.{layer.index}.decoder.key",
                    f"{PAST}.{layer.index}.decoder.value",
                    SEQLENS_INPUT,
                    TOTAL_INPUT,
                ],
                [
                    layer.output,
                    f"{PRESENT}.{layer.index}.decoder.key",
                    f"{PRESENT}.{layer.index}.decoder.value",
                ],
                name=f"{_PREFIX}/layer_{layer.index}",
                domain=_CONTRIB,
                num_heads=heads,
                kv_num_heads=heads,
                scale=layer.scale,
            )
        )
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    known |= {SEQLENS_INPUT, TOTAL_INPUT}
    try:
        kept = sorted_nodes(live_nodes(nodes, {o.name for o in graph.output}), known)
    except UnsortableGraph as exc:
        raise _Unsupported(str(exc)) from exc
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in graph.node for name in reads(node)}
    kept_inputs = [i for i in graph.input if i.name in used]
    if any(i.name == MASK_INPUT for i in kept_inputs):
        raise _Unsupported(f"{MASK_INPUT} still read after the rewrite")
    del graph.input[:]
    graph.input.extend(kept_inputs)
    graph.input.extend(
        [
            helper.make_tensor_value_info(SEQLENS_INPUT, TensorProto.INT32, ["batch_size"]),
            helper.make_tensor_value_info(TOTAL_INPUT, TensorProto.INT32, []),
        ]
    )
    kept_initializers = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept_initializers)
    if not any(o.domain == _CONTRIB for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_CONTRIB, 1))


def _heads(graph: onnx.GraphProto) -> int:
    for value in graph.input:
        if value.name.startswith(f"{PAST}.") and value.name.endswith(".decoder.key"):
            dims = value.type.tensor_type.shape.dim
            if len(dims) == 4 and dims[1].HasField("dim_value"):
                return int(dims[1].dim_value)
    raise _Unsupported("the past keys do not say their number of heads")


def _find(view: GraphView, layer: int) -> _Layer:
    present = {}
    for kind in ("key", "value"):
        past = f"{PAST}.{layer}.decoder.{kind}"
        concats = [n for n in view.consumers.get(past, []) if n.op_type == "Concat"]
        if len(concats) != 1 or concats[0].output[0] != f"{PRESENT}.{layer}.decoder.{kind}":
            raise _Unsupported(f"{past} does not go through one Concat into its present")
        concat = concats[0]
        if len(concat.input) != 2 or concat.input[0] != past:
            raise _Unsupported(f"layer {layer}: the {kind} Concat is not past then new")
        present[kind] = concat
    key = _packed(view, present["key"].input[1])
    value = _packed(view, present["value"].input[1])
    # Scores: MatMul(query heads [x scale], Transpose(present key) [x scale]).
    transposes = [
        n for n in view.consumers.get(present["key"].output[0], []) if n.op_type == "Transpose"
    ]
    if len(transposes) != 1 or attribute(transposes[0], "perm", []) != [0, 1, 3, 2]:
        raise _Unsupported(f"layer {layer}: the present key is not transposed once for scores")
    scale = 1.0
    side = transposes[0].output[0]
    after = view.consumers.get(side, [])
    if len(after) == 1 and after[0].op_type == "Mul":
        factor, side = _scaled(view, after[0], side)
        scale *= factor
    scores = [n for n in view.consumers.get(side, []) if n.op_type == "MatMul"]
    if len(scores) != 1 or scores[0].input[1] != side:
        raise _Unsupported(f"layer {layer}: no single scores MatMul")
    query_side = scores[0].input[0]
    scaling = view.producer.get(query_side)
    if scaling is not None and scaling.op_type == "Mul":
        operands = list(scaling.input)
        heads_in = next(
            (x for x in operands if not view.is_constant(x)),
            None,
        )
        if heads_in is None:
            raise _Unsupported(f"layer {layer}: the query's scaling has no tensor operand")
        factor, _ = _scaled(view, scaling, heads_in)
        scale *= factor
        query_side = heads_in
    query = _packed(view, query_side)
    # Output: MatMul(probabilities, present value) -> Transpose -> Reshape [B, T, hidden].
    weighted = [
        n for n in view.consumers.get(present["value"].output[0], []) if n.op_type == "MatMul"
    ]
    if len(weighted) != 1 or weighted[0].input[1] != present["value"].output[0]:
        raise _Unsupported(f"layer {layer}: no single MatMul over the present value")
    transposed = view.consumers.get(weighted[0].output[0], [])
    if len(transposed) != 1 or transposed[0].op_type != "Transpose":
        raise _Unsupported(f"layer {layer}: the attention output is not transposed")
    if attribute(transposed[0], "perm", []) != [0, 2, 1, 3]:
        raise _Unsupported(f"layer {layer}: the attention output's transpose is not to tokens")
    reshaped = view.consumers.get(transposed[0].output[0], [])
    if len(reshaped) != 1 or reshaped[0].op_type != "Reshape":
        raise _Unsupported(f"layer {layer}: the attention output is not reshaped")
    return _Layer(
        index=layer,
        query=query,
        key=key,
        value=value,
        scale=scale,
        output=reshaped[0].output[0],
        replaced=(present["key"], present["value"], reshaped[0]),
    )


def _scaled(view: GraphView, mul: onnx.NodeProto, tensor: str) -> tuple[float, str]:
    """The constant scalar `mul` multiplies `tensor` by, and its output."""
    other = mul.input[1] if mul.input[0] == tensor else mul.input[0]
    value = view.constant(other)
    if value is None or value.size != 1:
        raise _Unsupported(f"{mul.output[0]}: scaled by something other than a constant")
    return float(np.asarray(value, dtype=np.float64).reshape(-1)[0]), mul.output[0]


def _packed(view: GraphView, heads: str) -> str:
    """The [rows, tokens, hidden] tensor a heads layout [rows, heads, tokens, head_dim]
    was made from (a `Transpose` of a `Reshape`)."""
    transpose = view.producer.get(heads)
    if transpose is None or transpose.op_type != "Transpose":
        raise _Unsupported(f"{heads} is not a Transpose")
    if attribute(transpose, "perm", []) != [0, 2, 1, 3]:
        raise _Unsupported(f"{heads} is not split into heads")
    reshape = view.producer.get(transpose.input[0])
    if reshape is None or reshape.op_type != "Reshape":
        raise _Unsupported(f"{transpose.input[0]} is not a Reshape")
    return str(reshape.input[0])
