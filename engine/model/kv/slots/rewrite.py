"""KV slots: rewrite the batchable decoder's step so that its keys and values stay in
preallocated buffers, written in place, and only ids cross the call's boundary.

The masks rewrite (`passes.masks`) gives a with-past graph that takes each row's past
keys and values as inputs and returns them grown by the new positions (`Concat`): every
step copies the whole batch's state out and back, allocates it anew, and returns the whole
logits. `rewrite_step` replaces that with buffers of fixed size, one per layer and kind:

- self-attention: `[slots * heads * capacity, head_dim]` (a slot's rows, head by head,
  position by position). The step's new keys and values are written at each row's own
  positions (`ScatterND`, whose output the caller binds to the input's own memory, so
  ONNX Runtime writes in place), then the row's first `W` positions are read (`Gather`),
  `W` being the width of `decoder_attention_mask`;
- cross-attention: the same shape with the source capacity, written once by the prefill
  (`rewrite_prefill`, which writes the row's first positions too, and projects only the
  positions a search reads) and only read by the step;
- the self-attention mask: a position is seen where the row's mask says it is real and it
  is not after the query's own position (positions are absolute in a slot, so a row's new
  tokens are not the buffer's last columns and the causal mask is rebuilt from positions);
- outputs: the updated buffers, `logits` as before (for searches that need them), and
  for greedy rows the argmax and its log-probability under the model's banned tokens
  (`NEXT_IDS`, `NEXT_SCORES`), computed where the model runs.

Found by input and output names and the masks rewrite's own nodes, never by node names
of the exporter; a graph of another shape gives None and a logged reason (the model then
batches with its state copied per step).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engine.model.names import (
    BAN_EOS,
    COPY_POSITIONS,
    COPY_TARGETS,
    ENCODER_ATTENTION_MASK,
    ENCODER_HIDDEN_STATES,
    LOGITS,
    MASK_INPUT,
    NEXT_IDS,
    NEXT_SCORES,
    POSITIONS_INPUT,
    PREFILL_READS,
    PRESENT,
    SLOT_ROWS,
    SLOT_SOURCES,
    kv_names,
    slot_names,
)
from engine.model.passes.graph import (
    GraphView,
    UnsortableGraph,
    live_nodes,
    opset,
    reads,
    sorted_nodes,
)
from engine.model.passes.head import projection_input

log = logging.getLogger(__name__)

_PREFIX = "kv_slots"


class _Unsupported(Exception):
    """The graph does not have the structure this pass knows (message says why)."""


@dataclass(frozen=True)
class SlotShape:
    """The buffers' geometry: `capacity` decoder positions and `source_capacity` source
    positions per slot, `heads` x `head_dim` per position, `layers` layers."""

    layers: int
    heads: int
    head_dim: int
    capacity: int
    source_capacity: int


class _Builder:
    """New nodes and initializers, named under one prefix."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        version: int,
        constants: onnx.GraphProto | None = None,
        float_type: int = TensorProto.FLOAT,
        prefix: str = _PREFIX,
    ) -> None:
        self.prefix = prefix
        self.graph = graph
        self.version = version
        self.float_type = float_type
        self._constants = constants if constants is not None else graph  # initializers
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}/{hint}_{self._count}"

    def const(self, hint: str, value: Any) -> str:
        name = self.name(hint)
        self._constants.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], hint: str, **attrs: Any) -> str:
        out = self.name(hint)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def unsqueeze(self, source: str, axes: list[int]) -> str:
        if self.version >= 13:
            return self.op("Unsqueeze", [source, self.const("axes", np.array(axes))], "unsq")
        return self.op("Unsqueeze", [source], "unsq", axes=axes)

    def squeeze_last(self, source: str, hint: str) -> str:
        if self.version >= 13:
            return self.op("Squeeze", [source, self.const("axes", np.array([-1]))], hint)
        return self.op("Squeeze", [source], hint, axes=[-1])

    def reduce(self, op_type: str, source: str, hint: str) -> str:
        """`op_type` over the last axis, that axis dropped."""
        if (op_type == "ReduceSum" and self.version >= 13) or self.version >= 18:
            axes = self.const("axes", np.array([-1]))
            return self.op(op_type, [source, axes], hint, keepdims=0)
        return self.op(op_type, [source], hint, axes=[-1], keepdims=0)


def _range(b: _Builder, size: str) -> str:
    zero, one = b.const("zero", np.array(0)), b.const("one", np.array(1))
    return b.op("Range", [zero, size, one], "range")


def _width(b: _Builder, tensor: str) -> str:
    """The size of `tensor`'s axis 1, as a scalar."""
    shape = b.op("Shape", [tensor], "shape")
    return b.op("Gather", [shape, b.const("one", np.array(1))], "width", axis=0)


def _bases(b: _Builder, shape: SlotShape, slots: str = SLOT_ROWS) -> tuple[str, str]:
    """Each of `slots`' first buffer row per head, [B, H]: self and cross buffers."""
    heads = b.const("heads", np.array(shape.heads))
    per_head = b.op(
        "Add",
        [b.op("Mul", [b.unsqueeze(slots, [1]), heads], "slot_heads"), _range(b, heads)],
        "row_heads",
    )
    own = b.op("Mul", [per_head, b.const("capacity", np.array(shape.capacity))], "self_base")
    source = b.const("source_capacity", np.array(shape.source_capacity))
    return own, b.op("Mul", [per_head, source], "cross_base")


def _reads(b: _Builder, base: str, columns: str) -> str:
    """Buffer rows [B, H, W] of positions `columns` [W] (0..W-1)."""
    return b.op("Add", [b.unsqueeze(base, [2]), columns], "read_rows")


def _self_mask(b: _Builder, negative: onnx.TensorProto, columns: str) -> str:
    """[B, 1, T, W]: NEG where the mask marks padding or the column (`columns` [W],
    0..W-1) is after the query's own position, else 0."""
    padding = b.unsqueeze(b.op("Equal", [MASK_INPUT, b.const("zero", np.array(0))], "pad"), [1])
    future = b.op(
        "Greater", [b.unsqueeze(columns, [0, 1]), b.unsqueeze(POSITIONS_INPUT, [2])], "future"
    )
    blocked = b.unsqueeze(b.op("Or", [padding, future], "blocked"), [1])
    value = numpy_helper.to_array(negative)
    zero = b.const("zero_float", np.zeros((), value.dtype))
    return b.op("Where", [blocked, negative.name, zero], "self_mask")


ARGMAX_CHUNK = 256
"""Positions of the vocabulary one first-stage reduction covers (`_choose`)."""


def _choose(b: _Builder, scores: str, ids: str, best: str, vocab: int) -> None:
    """`ids` and `best` [B, T]: the argmax of `scores` [B, T, V] (the first on ties, as
    numpy's) and its log-probability, in the float32 operations of
    `engine.decoding.search._greedy_choice`.

    The maximum and its position are taken in two stages, over chunks of
    `ARGMAX_CHUNK` positions and then over the chunks: ONNX Runtime's CUDA `ArgMax`
    and `ReduceMax` over a whole vocabulary run in cuDNN, which reduced each row of 65k
    logits serially, most of a step's time on a GPU (docs/performance.md). A maximum
    is exact, so the two stages give the same maximum; the first chunk holding it and
    the first position in that chunk are its first position."""
    chunks = -(-vocab // ARGMAX_CHUNK)
    pads = np.zeros(6, dtype=np.int64)
    pads[5] = chunks * ARGMAX_CHUNK - vocab
    padded = b.op(
        "Pad", [scores, b.const("pads", pads), b.const("ninf", np.float32(-np.inf))], "padded"
    )
    shape = b.const("chunked", np.array([0, 0, chunks, ARGMAX_CHUNK], dtype=np.int64))
    blocks = b.op("Reshape", [padded, shape], "blocks")
    local_top = b.reduce("ReduceMax", blocks, "chunk_top")  # [B, T, chunks]
    local_at = b.op("ArgMax", [blocks], "chunk_at", axis=-1, keepdims=0)  # [B, T, chunks]
    chunk = b.op("ArgMax", [local_top], "top_chunk", axis=-1, keepdims=1)  # [B, T, 1]
    within = b.op("GatherElements", [local_at, chunk], "within", axis=-1)
    first = b.op("Mul", [chunk, b.const("chunk", np.array(ARGMAX_CHUNK))], "chunk_start")
    at = b.squeeze_last(b.op("Add", [first, within], "at"), "chosen")
    b.nodes.append(helper.make_node("Identity", [at], [ids]))
    top = b.unsqueeze(b.reduce("ReduceMax", local_top, "top"), [-1])
    total = b.reduce("ReduceSum", b.op("Exp", [b.op("Sub", [scores, top], "shift")], "exp"), "sum")
    b.nodes.append(helper.make_node("Neg", [b.op("Log", [total], "log")], [best]))


def _greedy_outputs(
    b: _Builder,
    logits: str,
    vocab: int,
    bans: Sequence[int],
    eos: int,
    branch_free: bool = False,
) -> None:
    """`NEXT_IDS` [B, T] and `NEXT_SCORES` [B, T]: the greedy choice (`_choose`) with the
    model's banned tokens at -inf, and eos too where `BAN_EOS` [B, T] says (a row short of
    its minimum length). The eos penalty is a branch of its own (`If`), taken only when
    some row is short: each pass over the vocabulary counts at many rows. It is a finite
    -1e30 rather than -inf (0 x -inf is NaN); its exponential is 0 all the same.

    `branch_free`: the penalty on every call, without the `If` (a graph that CUDA graphs
    capture has no control flow). A row not short adds -0 x 1e30 = -0 to its logits,
    which leaves them as they are: the choices are those of the `If`'s branches, bit
    for bit."""
    bias = np.zeros(vocab, dtype=np.float32)
    bias[list(bans)] = -np.inf
    source = logits
    if b.float_type != TensorProto.FLOAT:
        source = b.op("Cast", [logits], "logits_f32", to=TensorProto.FLOAT)
    allowed = b.op("Add", [source, b.const("bans", bias)], "allowed")
    penalties = np.zeros(vocab, dtype=np.float32)
    penalties[eos] = -1e30
    no_eos = b.const("no_eos", penalties)
    if branch_free:
        _choose(b, _eos_banned(b, allowed, no_eos), NEXT_IDS, NEXT_SCORES, vocab)
        return
    as_int = b.op("Cast", [BAN_EOS], "ban_i32", to=TensorProto.INT32)
    any_short = b.op("ReduceMax", [as_int], "any_ban", keepdims=0)
    short = b.op("Cast", [any_short], "short", to=TensorProto.BOOL)
    branches = {}
    for branch, penalised in (("then_branch", True), ("else_branch", False)):
        inner = _Builder(
            helper.make_graph([], branch, [], []),
            b.version,
            b.graph,
            prefix=f"{_PREFIX}/{branch}",
        )
        scores = _eos_banned(inner, allowed, no_eos) if penalised else allowed
        ids, best = f"{inner.prefix}/ids", f"{inner.prefix}/scores"
        _choose(inner, scores, ids, best, vocab)
        branches[branch] = helper.make_graph(
            inner.nodes,
            branch,
            [],
            [
                helper.make_tensor_value_info(ids, TensorProto.INT64, None),
                helper.make_tensor_value_info(best, TensorProto.FLOAT, None),
            ],
        )
    b.nodes.append(
        helper.make_node(
            "If", [short], [NEXT_IDS, NEXT_SCORES], name=f"{_PREFIX}/greedy", **branches
        )
    )


def _eos_banned(b: _Builder, allowed: str, no_eos: str) -> str:
    """`allowed` [B, T, V] plus `no_eos` [V] (-1e30 at eos, 0 elsewhere) where `BAN_EOS`
    [B, T] says, and plus 0 x `no_eos` elsewhere."""
    banned = b.unsqueeze(b.op("Cast", [BAN_EOS], "ban_f32", to=TensorProto.FLOAT), [2])
    penalty = b.op("Mul", [banned, no_eos], "eos_penalty")
    return b.op("Add", [allowed, penalty], "eos_banned")


@dataclass
class _Edit:
    """One graph being rewritten: the copy, its builder, consumers of each tensor and its
    float type (that of the masks rewrite's negative constant)."""

    model: onnx.ModelProto
    b: _Builder
    consumers: dict[str, list[onnx.NodeProto]]
    wheres: list[onnx.NodeProto]
    negative: onnx.TensorProto

    @property
    def graph(self) -> onnx.GraphProto:
        return self.model.graph


def _edit(model: onnx.ModelProto, shape: SlotShape) -> _Edit:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    declared = {i.name for i in graph.input}
    if MASK_INPUT not in declared or POSITIONS_INPUT not in declared:
        raise _Unsupported("not a masks-rewritten decoder")
    if LOGITS not in {o.name for o in graph.output}:
        raise _Unsupported("no logits output")
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    wheres = [n for n in graph.node if n.op_type == "Where" and "/self_mask_" in n.name]
    if len(wheres) != shape.layers:
        raise _Unsupported(f"{len(wheres)} self-attention masks for {shape.layers} layers")
    initializers = {i.name: i for i in graph.initializer}
    negative = initializers.get(wheres[0].input[1])
    if negative is None:
        raise _Unsupported("the mask's negative value is not a constant")
    b = _Builder(graph, opset(out), float_type=int(negative.data_type))
    return _Edit(out, b, consumers, wheres, negative)


def _finish(
    edit: _Edit,
    shape: SlotShape,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    gone: set[str],
    logits: bool = True,
) -> bytes:
    """The graph with the builder's nodes, `inputs` added and `gone` inputs dropped, only
    `outputs` (and `LOGITS` where `logits`), sorted, and without what no output needs."""
    graph, b = edit.graph, edit.b
    dims: list[str | int] = ["slot_rows", shape.head_dim]
    kept = [o for o in graph.output if o.name == LOGITS and logits]
    del graph.output[:]
    graph.output.extend([*kept, *outputs])
    graph.output.extend(
        [
            helper.make_tensor_value_info(NEXT_IDS, TensorProto.INT64, None),
            helper.make_tensor_value_info(NEXT_SCORES, TensorProto.FLOAT, None),
        ]
    )
    declared = [i for i in graph.input if i.name not in gone]
    declared.append(helper.make_tensor_value_info(SLOT_ROWS, TensorProto.INT64, ["slots"]))
    declared.append(helper.make_tensor_value_info(BAN_EOS, TensorProto.BOOL, ["rows", "new"]))
    declared.extend(inputs)
    for side in ("decoder", "encoder"):
        for name in slot_names(shape.layers, side):
            declared.append(helper.make_tensor_value_info(name, b.float_type, dims))
    del graph.input[:]
    graph.input.extend(declared)
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    try:
        nodes = sorted_nodes(
            live_nodes([*graph.node, *b.nodes], {o.name for o in graph.output}), known
        )
    except UnsortableGraph as exc:
        raise _Unsupported(str(exc)) from exc
    used = {name for n in nodes for name in reads(n)}
    if used & gone:
        raise _Unsupported(f"{sorted(used & gone)[0]} is read other than as rewritten")
    del graph.node[:]
    graph.node.extend(nodes)
    kept_inputs = [i for i in graph.input if i.name in used]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    live = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(live)
    return bytes(edit.model.SerializeToString())


def _rewrite(
    model: onnx.ModelProto,
    shape: SlotShape,
    vocab: int,
    bans: Sequence[int],
    eos: int,
    graphed: bool = False,
) -> bytes:
    edit = _edit(model, shape)
    graph, b = edit.graph, edit.b
    past_self = kv_names(shape.layers, "decoder")
    past_cross = kv_names(shape.layers, "encoder")
    if not set(past_self + past_cross) <= {i.name for i in graph.input}:
        raise _Unsupported("no self and cross KV inputs")
    if ENCODER_HIDDEN_STATES in edit.consumers:
        raise _Unsupported("the step reads the encoder states, not only their KV")
    self_base, cross_base = _bases(b, shape)
    columns = _range(b, _width(b, MASK_INPUT))  # the self-attention positions read
    self_rows = _reads(b, self_base, columns)
    cross_rows = _reads(b, cross_base, _range(b, _width(b, ENCODER_ATTENTION_MASK)))
    writes = b.unsqueeze(
        b.op("Add", [b.unsqueeze(self_base, [2]), b.unsqueeze(POSITIONS_INPUT, [1])], "write"),
        [3],
    )
    mask = _self_mask(b, edit.negative, columns)
    renamed: dict[str, str] = {where.output[0]: mask for where in edit.wheres}
    outputs: list[onnx.ValueInfoProto] = []
    buffers = zip(
        past_self,
        slot_names(shape.layers, "decoder"),
        slot_names(shape.layers, "decoder", out=True),
        strict=True,
    )
    for past, buffer, updated in buffers:
        concat = [n for n in edit.consumers.get(past, []) if n.op_type == "Concat"]
        if len(concat) != 1 or concat[0].input[0] != past:
            raise _Unsupported(f"{past} is not concatenated with the new positions")
        new = concat[0].input[1]
        b.nodes.append(helper.make_node("ScatterND", [buffer, writes, new], [updated]))
        renamed[concat[0].output[0]] = b.op("Gather", [updated, self_rows], "self_kv", axis=0)
        graph.node.remove(concat[0])
        outputs.append(helper.make_tensor_value_info(updated, b.float_type, None))
    for past, buffer in zip(past_cross, slot_names(shape.layers, "encoder"), strict=True):
        renamed[past] = b.op("Gather", [buffer, cross_rows], "cross_kv", axis=0)
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in renamed:
                node.input[index] = renamed[name]
    _greedy_outputs(b, LOGITS, vocab, bans, eos, branch_free=graphed)
    return _finish(edit, shape, [], outputs, set(past_self + past_cross), logits=not graphed)


def _rewrite_prefill(
    model: onnx.ModelProto, shape: SlotShape, vocab: int, bans: Sequence[int], eos: int
) -> bytes:
    edit = _edit(model, shape)
    graph, b = edit.graph, edit.b
    presents = {o.name for o in graph.output}
    self_kv = kv_names(shape.layers, "decoder", PRESENT)
    cross_kv = kv_names(shape.layers, "encoder", PRESENT)
    if not set(self_kv + cross_kv) <= presents:
        raise _Unsupported("no self and cross KV outputs")
    hidden = projection_input(GraphView(graph, {}), vocab)
    if hidden is None:
        raise _Unsupported("no single vocabulary projection")
    # Only the positions a search reads are projected (`PREFILL_READS`, flat over B x T):
    # a forced prefix is often longer than what follows it, and the projection is most of
    # a position's cost.
    flat = b.op(
        "Reshape",
        [hidden, b.const("rows_by_d", np.array([-1, shape.heads * shape.head_dim]))],
        "flat",
    )
    picked = b.unsqueeze(b.op("Gather", [flat, PREFILL_READS], "picked", axis=0), [0])
    projecting = [n for n in graph.node if hidden in n.input]
    for node in projecting:
        node.input[:] = [picked if name == hidden else name for name in node.input]
    outputs: list[onnx.ValueInfoProto] = []
    self_base, cross_base = _bases(b, shape)
    for side, base, names in (("decoder", self_base, self_kv), ("encoder", cross_base, cross_kv)):
        buffers = zip(
            names,
            slot_names(shape.layers, side),
            slot_names(shape.layers, side, out=True),
            strict=True,
        )
        # One side's presents all have its length (the positions fed, or the source's).
        dims = b.op("Shape", [names[0]], "shape")
        length = b.op("Gather", [dims, b.const("two", np.array(2))], "length", axis=0)
        rows = b.op("Add", [b.unsqueeze(base, [2]), _range(b, length)], "rows")
        writes = b.unsqueeze(rows, [3])
        for present, buffer, updated in buffers:
            values = b.op("Gather", [present, SLOT_SOURCES], "values", axis=0)
            b.nodes.append(helper.make_node("ScatterND", [buffer, writes, values], [updated]))
            outputs.append(helper.make_tensor_value_info(updated, b.float_type, None))
    _greedy_outputs(b, LOGITS, vocab, bans, eos)
    inputs = [
        helper.make_tensor_value_info(SLOT_SOURCES, TensorProto.INT64, ["slots"]),
        helper.make_tensor_value_info(PREFILL_READS, TensorProto.INT64, ["reads"]),
    ]
    return _finish(edit, shape, inputs, outputs, set())


def _guarded(
    rewrite: Any, data: bytes, shape: SlotShape, facts: tuple[int, Sequence[int], int], name: str
) -> bytes | None:
    try:
        result: bytes = rewrite(onnx.load_from_string(data), shape, *facts)
        return result
    except _Unsupported as exc:
        reason = str(exc)
    except Exception as exc:  # a malformed graph: falling back is always safe
        reason = f"unexpected graph: {exc!r}"
    log.warning("%s: no KV-slot rewrite (%s): the state is copied per step", name, reason)
    return None


def rewrite_step(
    data: bytes,
    shape: SlotShape,
    vocab: int,
    bans: Sequence[int],
    eos: int,
    name: str = "decoder",
    *,
    graphed: bool = False,
) -> bytes | None:
    """The masks-rewritten with-past graph `data` reading and writing KV slots, or None
    (the reason logged) when its graph lacks the structure this module knows. `bans`:
    tokens never chosen; `eos`: the token `BAN_EOS` bans per row.

    `graphed`: the graph CUDA graphs replay (`engine.model.kv.slots.graphed`): no control flow
    (the eos ban without its `If`) and no logits output, only the greedy choice, whose
    values are those of the graph without `graphed`, bit for bit."""
    rewrite = partial(_rewrite, graphed=graphed)
    return _guarded(rewrite, data, shape, (vocab, bans, eos), name)


def rewrite_prefill(
    data: bytes,
    shape: SlotShape,
    vocab: int,
    bans: Sequence[int],
    eos: int,
    name: str = "decoder",
) -> bytes | None:
    """The masks-rewritten no-past graph `data` writing its keys and values into KV slots
    (slot `SLOT_ROWS[k]` gets row `SLOT_SOURCES[k]`'s: a beam's rows all start from its
    one prefill row) and projecting only the flat positions `PREFILL_READS` [K] to logits
    [1, K, V], with the greedy choice there (`NEXT_IDS`, `NEXT_SCORES` [1, K]); None (the
    reason logged) when its graph lacks the structure this module knows."""
    return _guarded(_rewrite_prefill, data, shape, (vocab, bans, eos), name)


def copy_graph(shape: SlotShape, float_type: int) -> bytes:
    """Copies the self KV of slots `SLOT_ROWS` [K] to slots `COPY_TARGETS` [K] (a beam's
    rows reordered), positions 0..W-1, W the length of `COPY_POSITIONS`."""
    graph = helper.make_graph([], "slot_copy", [], [])
    b = _Builder(graph, 17)

    def rows(slots: str) -> str:
        base, _ = _bases(b, shape, slots)
        return b.op("Add", [b.unsqueeze(base, [2]), COPY_POSITIONS], "rows")

    source, target = rows(SLOT_ROWS), b.unsqueeze(rows(COPY_TARGETS), [3])
    inputs = [
        helper.make_tensor_value_info(SLOT_ROWS, TensorProto.INT64, ["rows"]),
        helper.make_tensor_value_info(COPY_TARGETS, TensorProto.INT64, ["rows"]),
        helper.make_tensor_value_info(COPY_POSITIONS, TensorProto.INT64, ["positions"]),
    ]
    outputs = []
    for buffer, updated in zip(
        slot_names(shape.layers, "decoder"),
        slot_names(shape.layers, "decoder", out=True),
        strict=True,
    ):
        moved = b.op("Gather", [buffer, source], "moved", axis=0)
        b.nodes.append(helper.make_node("ScatterND", [buffer, target, moved], [updated]))
        inputs.append(helper.make_tensor_value_info(buffer, float_type, None))
        outputs.append(helper.make_tensor_value_info(updated, float_type, None))
    copier = helper.make_graph(b.nodes, "slot_copy", inputs, outputs, list(graph.initializer))
    model = helper.make_model(copier, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())
