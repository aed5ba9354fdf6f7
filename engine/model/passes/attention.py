"""Attention cores fused: each head-split attention of the export as one ONNX `Attention`
(opset 23, which ONNX Runtime runs on the CPU).

Why: a call costs what its nodes cost (~0.7 us each at one row, docs/performance.md), and
after `passes.shapes` the attention cores are the largest group of small nodes left: per
attention, the query's and key's scaling `Mul`s, `Reshape` and `Transpose` into heads of
the query, key and value, the scores `MatMul`, the mask `Add`, `Softmax`, the `MatMul`
over the values, and `Transpose` and `Reshape` back; about 14 nodes become one. Which
operator matters: ONNX Runtime's contrib `MultiHeadAttention` cost, at one row, what the
nodes it replaced cost; `Attention` about half (docs/performance.md, attention fused).

Found by structure, never by node names, from each `Softmax` over the last axis:

    Softmax(Add(MatMul(q heads [x s], k heads transposed [x s]), mask))
      -> MatMul(., v heads) -> Transpose(0, 2, 1, 3) -> Reshape [rows, tokens, hidden]

- heads are `Transpose(0, 2, 1, 3)` of a `Reshape` of a packed [rows, tokens, hidden]
  tensor to [rows, tokens, heads, head_dim] (proved on the symbolic shapes of
  `passes.symbolic`), which gives the number of heads; the keys' transpose for the scores
  is `Transpose(0, 2, 3, 1)` of that `Reshape` or `Transpose(0, 1, 3, 2)` of the heads;
- the query, keys and values go to the operator packed, and it gives the packed output:
  every split and merge goes; heads that something else reads (the decoder's `present`
  outputs) come from the operator's `present_key` / `present_value` under the same names
  (the same values: a copy, no past);
- keys and values that come in heads only (a step's cross-attention keys fed to the
  graph, a past `Concat`) are not fused: ONNX Runtime then wants the query in heads too,
  what would go (`FusedMatMul`, the mask `Add`, `Softmax`, `MatMul`: ONNX Runtime
  already folds the transposes and scales) is about what the mask's expansion adds, and
  the in-place step fused so ran no faster (docs/performance.md);
- scaling `Mul`s by constant scalars on either side become its `scale`;
- the mask, added to the scores, becomes its `attn_mask`, which ONNX Runtime broadcasts
  over rows and heads but not over query positions: a mask of one query position over
  several (the source padding mask of the encoder and of cross-attention) is expanded to
  the tokens once per graph and mask (`Shape`, `Concat`, `Expand`).

Where anything else reads the values of an intermediate of the core, the core stays as
it is; where only a `Shape` reads one (the unfolded graph's `Reshape` targets and mask
`Slice`s), the nodes that make it stay for that `Shape` (and a present whose shape the
mask reads stays the graph's own, so that the operator never reads its own output). The
graph's default opset becomes 23 (the ops this engine's graphs use only gained types
since 18; ONNX Runtime optimises the encoder to the same nodes at either). The fused
kernel may round apart from `MatMul` and `Softmax` (on the fixture's and the benchmark
model's probes it did not), so the loader checks each fused graph against the one it came
from (`engine.model.fused`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from engine.model.passes.graph import (
    SHAPE_ONLY,
    GraphView,
    UnsortableGraph,
    attribute,
    live_nodes,
    load_model,
    reads,
    sorted_nodes,
)
from engine.model.passes.symbolic import Dim, Shapes

log = logging.getLogger(__name__)

OPSET = 23
"""The default-domain opset of a fused graph: the first with `Attention`."""
_PREFIX = "fused_attention"
_HEADS = [0, 2, 1, 3]  # [rows, tokens, heads, dim] <-> [rows, heads, tokens, dim]
_KEYS_T = [0, 2, 3, 1]  # [rows, keys, heads, dim] -> [rows, heads, dim, keys]
_SWAP = [0, 1, 3, 2]  # heads -> their transpose


class _Unsupported(Exception):
    """A core (or the graph) is not of the shape this pass knows (message says why)."""


@dataclass
class _Side:
    """Keys or values as the operator takes them, packed [rows, keys, hidden], with the
    nodes that go and `present`, the heads' name where something else reads them."""

    packed: str
    present: str | None = None
    replaced: list[onnx.NodeProto] = field(default_factory=list)


@dataclass
class _Core:
    """One attention core: the operator's inputs and outputs, and the nodes that go."""

    inputs: list[str]  # query, key, value, packed
    outputs: list[str]  # output, present key, present value ("" where not read)
    mask: str | None
    tokens: Dim | None  # the query's tokens, where the mask has one position to expand
    scale: float
    heads: int
    replaced: list[onnx.NodeProto]


def fuse_attention(
    source: Path | bytes | onnx.ModelProto, name: str, *, in_place: bool = False
) -> onnx.ModelProto | None:
    """`source` with its attention cores fused (module docstring), or None (logged with
    the reason, under `name`) where the graph has subgraphs or no core this pass knows.
    A `ModelProto` given is copied first, unless `in_place` (left as it was where the
    result is None)."""
    model = source if in_place and isinstance(source, onnx.ModelProto) else load_model(source)
    try:
        fused, kept = _fuse(model)
    except _Unsupported as exc:
        log.info("%s: attention kept as exported (%s)", name, exc)
        return None
    log.info("%s: %d attention cores fused%s", name, fused, f" ({kept})" if kept else "")
    return model


def _fuse(model: onnx.ModelProto) -> tuple[int, str]:
    graph = model.graph
    if any(a.type in (a.GRAPH, a.GRAPHS) for n in graph.node for a in n.attribute):
        raise _Unsupported("a graph with subgraphs")
    if any(n.op_type == "Attention" and n.domain in ("", "ai.onnx") for n in graph.node):
        raise _Unsupported("fused already")
    view = GraphView(graph, {})
    shapes = Shapes(graph)
    outputs = view.outputs
    cores: list[_Core] = []
    refused: list[str] = []
    for node in graph.node:
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
            continue
        try:
            cores.append(_core(view, shapes, outputs, node))
        except _Unsupported as exc:
            refused.append(str(exc))
    if not cores:
        raise _Unsupported(refused[0] if refused else "no Softmax")
    taken: set[int] = set()
    for core in cores:
        mine = {id(n) for n in core.replaced}
        if mine & taken or len(mine) != len(core.replaced):
            raise _Unsupported("two cores share nodes")
        taken |= mine
    added: list[onnx.TensorProto] = []
    made: list[onnx.NodeProto] = []
    expanded: dict[tuple[str, Dim], str] = {}
    for index, core in enumerate(cores):
        prefix = f"{_PREFIX}/{index}"
        mask = core.mask
        if mask is not None and core.tokens is not None:
            key = (mask, core.tokens)
            if key not in expanded:
                expanded[key] = _expand_mask(mask, core.inputs[0], prefix, added, made)
            mask = expanded[key]
        outs = list(core.outputs)
        while outs[-1] == "":
            outs.pop()
        made.append(
            helper.make_node(
                "Attention",
                core.inputs + ([mask] if mask else []),
                outs,
                name=prefix,
                scale=core.scale,
                q_num_heads=core.heads,
                kv_num_heads=core.heads,
            )
        )
    # Only the nodes whose outputs the operators now make go here; the rest of each core
    # goes with `live_nodes` where nothing else reads it (a shape computation of the
    # unfolded graph may read a split: that node then stays, and so do its values).
    made_names = {name for node in made for name in node.output}
    nodes = [n for n in graph.node if not made_names.intersection(n.output)] + made
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    known |= {t.name for t in added}
    try:
        kept = sorted_nodes(live_nodes(nodes, outputs), known)
    except UnsortableGraph as exc:
        raise _Unsupported(str(exc)) from exc
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(added)
    used = {name for node in graph.node for name in reads(node)}
    initializers = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, OPSET)
    needed = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    model.ir_version = max(model.ir_version, needed)
    return len(cores), "; ".join(f"kept: {r}" for r in sorted(set(refused)))


# -- finding a core -------------------------------------------------------------------------


def _core(view: GraphView, shapes: Shapes, outputs: set[str], softmax: onnx.NodeProto) -> _Core:
    where = softmax.output[0]
    if attribute(softmax, "axis", -1) not in (-1, 3):
        raise _Unsupported(f"{where}: not a Softmax over the last axis")
    core = [softmax]
    scores_name, mask = softmax.input[0], None
    added = view.producer.get(scores_name)
    if added is not None and added.op_type == "Add":
        _only_read_by(view, outputs, scores_name, softmax)
        first = view.producer.get(added.input[0])
        scores_name, mask = (
            (added.input[0], added.input[1])
            if first is not None and first.op_type == "MatMul"
            else (added.input[1], added.input[0])
        )
        core.append(added)
    scores = view.producer.get(scores_name)
    if scores is None or scores.op_type != "MatMul":
        raise _Unsupported(f"{where}: the scores are not one MatMul")
    _only_read_by(view, outputs, scores_name, core[-1])
    core.append(scores)
    scores_shape = shapes.shape(scores_name)
    if scores_shape is None or len(scores_shape) != 4:
        raise _Unsupported(f"{where}: the scores are not 4-D")
    query_heads, query_scale, query_reader = _unscaled(view, outputs, scores, 0, core)
    key_side, key_scale, _ = _unscaled(view, outputs, scores, 1, core)
    split = _split(view, shapes, query_heads)
    if split is None:
        raise _Unsupported(f"{where}: the query is not split into heads from [B, T, D]")
    query_transpose, query_reshape, heads, head_dim = split
    _only_read_by(view, outputs, query_heads, query_reader)
    key = _key(view, shapes, outputs, key_side, heads, head_dim)
    core.append(view.producer[key_side])  # the keys' transpose
    weighted = view.consumers.get(where, [])
    if len(weighted) != 1 or weighted[0].op_type != "MatMul" or weighted[0].input[0] != where:
        raise _Unsupported(f"{where}: the probabilities are not read by one MatMul")
    _only_read_by(view, outputs, where, weighted[0])
    core.append(weighted[0])
    value = _from_heads(view, shapes, outputs, weighted[0].input[1], weighted[0], heads, head_dim)
    back = _single(view, outputs, weighted[0].output[0], "Transpose")
    if attribute(back, "perm", []) != _HEADS:
        raise _Unsupported(f"{where}: the output's Transpose is not back to tokens")
    merge = _single(view, outputs, back.output[0], "Reshape")
    packed_query = query_reshape.input[0]
    if shapes.shape(merge.output[0]) != shapes.shape(packed_query):
        raise _Unsupported(f"{where}: the output is not of the query's packed shape")
    scale = query_scale * key_scale
    tokens = None if mask is None else _mask_fits(shapes, mask, scores_shape, where)
    mask = None if mask is None else _through_identities(view, mask)
    if mask is not None:
        # A mask computed from a present's shape (the unfolded graph's mask `Slice`) would
        # read the operator's own output: that present stays the graph's `Transpose`.
        upstream = _upstream(view, mask)
        for side in (key, value):
            if side.present in upstream:
                side.present = None
    _only_read_by(view, outputs, query_reshape.output[0], query_transpose)
    return _Core(
        [packed_query, key.packed, value.packed],
        [merge.output[0], key.present or "", value.present or ""],
        mask,
        tokens,
        scale,
        heads,
        [*core, query_transpose, query_reshape, back, merge, *key.replaced, *value.replaced],
    )


def _mask_fits(shapes: Shapes, mask: str, scores: tuple[Dim, ...], where: str) -> Dim | None:
    """None where `mask` is an `attn_mask` as it is ([rows or 1, heads or 1, tokens,
    keys]); the tokens where it has one query position to expand to them."""
    shape = shapes.shape(mask)
    one = Dim.of(1)
    if shape is None or len(shape) != 4:
        raise _Unsupported(f"{where}: the mask's shape is not known 4-D")
    rows, heads, tokens, keys = scores
    # Keys: the same size, or two sizes no number names (the prefill's mask is [rows,
    # past + tokens] with no past: another input's size). Where they differ at run time
    # the graph's own Add fails too, unless the mask's is 1: the operator then refuses
    # what the Add broadcast, an error where no caller feeds that.
    same_keys = shape[3] == keys or (shape[3].constant is None and keys.constant is None)
    if shape[0] not in (one, rows) or shape[1] not in (one, heads) or not same_keys:
        raise _Unsupported(f"{where}: the mask is not [rows or 1, heads or 1, ., keys]")
    if shape[2] == tokens:
        return None
    if shape[2] == one:
        return tokens
    raise _Unsupported(f"{where}: the mask's query axis is neither the tokens nor 1")


def _unscaled(
    view: GraphView,
    outputs: set[str],
    scores: onnx.NodeProto,
    index: int,
    core: list[onnx.NodeProto],
) -> tuple[str, float, onnx.NodeProto]:
    """The scores' input `index` without its scaling `Mul` by a constant scalar (read by
    the scores alone; it joins `core`), the factor, and the node that reads the result."""
    name = scores.input[index]
    node = view.producer.get(name)
    if node is None or node.op_type != "Mul":
        return name, 1.0, scores
    constant = next((i for i in node.input if view.is_constant(i)), None)
    value = None if constant is None else view.constant(constant)
    if value is None or value.size != 1:
        return name, 1.0, scores
    _only_read_by(view, outputs, name, scores)
    core.append(node)
    other = node.input[1] if node.input[0] == constant else node.input[0]
    return other, float(np.asarray(value, dtype=np.float64).reshape(-1)[0]), node


def _key(
    view: GraphView, shapes: Shapes, outputs: set[str], side: str, heads: int, head_dim: int
) -> _Side:
    """The keys, from the scores' right-hand side (their transpose [rows, heads,
    head_dim, keys], read by the scores alone): `Transpose(0, 2, 3, 1)` of the packed
    keys' split, or `Transpose(0, 1, 3, 2)` of key heads."""
    node = view.producer.get(side)
    if node is None or node.op_type != "Transpose":
        raise _Unsupported(f"{side}: the keys are not transposed for the scores")
    if len(view.consumers.get(side, [])) != 1 or side in outputs:
        raise _Unsupported(f"{side}: the keys' transpose is read elsewhere")
    if attribute(node, "perm", []) == _KEYS_T:
        reshape = view.producer.get(node.input[0])
        found = _split(view, shapes, side, (_KEYS_T,))
        if reshape is None or found is None or found[2:] != (heads, head_dim):
            raise _Unsupported(f"{side}: the keys are not split into heads from [B, T, D]")
        return _packed(view, outputs, reshape, node)
    if attribute(node, "perm", []) == _SWAP:
        return _from_heads(view, shapes, outputs, node.input[0], node, heads, head_dim)
    raise _Unsupported(f"{side}: the keys' transpose is not one this pass knows")


def _from_heads(
    view: GraphView,
    shapes: Shapes,
    outputs: set[str],
    name: str,
    reader: onnx.NodeProto,
    heads: int,
    head_dim: int,
) -> _Side:
    """Keys or values in heads [rows, heads, keys, head_dim] read by `reader`, packed:
    where they are the split of packed ones (their heads the operator's present where
    something else reads them)."""
    found = _split(view, shapes, name)
    if found is None or found[2:] != (heads, head_dim):
        raise _Unsupported(f"{name}: keys or values not split from [B, T, D] (in heads only)")
    transpose, reshape = found[0], found[1]
    if _values_read(view, outputs, reshape.output[0], transpose):
        raise _Unsupported(f"{reshape.output[0]}: the split keys or values are read elsewhere")
    present = name if _values_read(view, outputs, name, reader) else None
    return _Side(reshape.input[0], present, [transpose, reshape])


def _packed(
    view: GraphView, outputs: set[str], reshape: onnx.NodeProto, reader: onnx.NodeProto
) -> _Side:
    """Packed keys from their split `reshape`, read by the scores' transpose `reader` and
    by at most one heads `Transpose(0, 2, 1, 3)` besides (the decoder's present keys,
    which the operator then gives); no heads: the keys only come packed."""
    split = reshape.output[0]
    side = _Side(reshape.input[0], replaced=[reshape])
    readers = view.consumers.get(split, [])
    heads = [n for n in readers if n.op_type == "Transpose" and attribute(n, "perm", []) == _HEADS]
    read = [n for n in heads if _values_read(view, outputs, n.output[0])]
    if len(read) > 1 or _values_read(view, outputs, split, reader, *heads):
        raise _Unsupported(f"{split}: the split keys are read elsewhere")
    if read:
        side.present = read[0].output[0]
        side.replaced.append(read[0])
    return side


def _split(
    view: GraphView, shapes: Shapes, name: str, perms: tuple[list[int], ...] = (_HEADS,)
) -> tuple[onnx.NodeProto, onnx.NodeProto, int, int] | None:
    """The `Transpose` (one of `perms`) of a `Reshape` from [rows, tokens, hidden] to
    [rows, tokens, heads, head_dim] that makes `name`, with heads and head_dim; None
    where it is not that."""
    transpose = view.producer.get(name)
    if transpose is None or transpose.op_type != "Transpose":
        return None
    if attribute(transpose, "perm", []) not in perms:
        return None
    reshape = view.producer.get(transpose.input[0])
    if reshape is None or reshape.op_type != "Reshape":
        return None
    source, split = shapes.shape(reshape.input[0]), shapes.shape(reshape.output[0])
    if source is None or split is None or len(source) != 3 or len(split) != 4:
        return None
    heads, head_dim = split[2].constant, split[3].constant
    if heads is None or head_dim is None or heads < 1 or head_dim < 1:
        return None
    if split[:2] != source[:2] or source[2] != Dim.of(heads * head_dim):
        return None
    return transpose, reshape, heads, head_dim


def _expand_mask(
    mask: str,
    query: str,
    prefix: str,
    added: list[onnx.TensorProto],
    made: list[onnx.NodeProto],
) -> str:
    """`mask` [rows, heads or 1, 1, keys] expanded to the tokens of the packed `query`
    [rows, tokens, hidden]: [.., tokens, keys]."""
    ones = numpy_helper.from_array(np.ones(2, np.int64), f"{prefix}/ones")
    one = numpy_helper.from_array(np.ones(1, np.int64), f"{prefix}/one")
    added += [ones, one]
    tokens, shape, out = f"{prefix}/tokens", f"{prefix}/mask_shape", f"{prefix}/mask"
    made.append(helper.make_node("Shape", [query], [tokens], start=1, end=2))
    made.append(helper.make_node("Concat", [ones.name, tokens, one.name], [shape], axis=0))
    made.append(helper.make_node("Expand", [mask, shape], [out]))
    return out


# -- small readers ---------------------------------------------------------------------------


def _values_read(view: GraphView, outputs: set[str], name: str, *readers: onnx.NodeProto) -> bool:
    """Whether `name` is a graph output or its values are read by a node besides
    `readers` (a `Shape` of it is not: it keeps its producer, not the core, alive)."""
    allowed = {id(r) for r in readers}
    return name in outputs or any(
        id(n) not in allowed and n.op_type not in SHAPE_ONLY for n in view.consumers.get(name, [])
    )


def _only_read_by(view: GraphView, outputs: set[str], name: str, *readers: onnx.NodeProto) -> None:
    """Fail where something besides `readers` reads the values of `name` (`_values_read`)."""
    if _values_read(view, outputs, name, *readers):
        raise _Unsupported(f"{name}: read outside the attention core")


def _upstream(view: GraphView, name: str) -> set[str]:
    """Every tensor `name` is computed from, through shape computations too."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        node = view.producer.get(current)
        if node is not None:
            todo.extend(i for i in node.input if i)
    return seen


def _through_identities(view: GraphView, name: str) -> str:
    """What `name` is an `Identity` (of an `Identity`...) of: the same tensor, so that
    the layers' masks (each its own `Identity` of one mask once `passes.shapes` folded
    their `Slice`s) share one expansion."""
    node = view.producer.get(name)
    while node is not None and node.op_type == "Identity":
        name = node.input[0]
        node = view.producer.get(name)
    return name


def _single(view: GraphView, outputs: set[str], name: str, op: str) -> onnx.NodeProto:
    """The one node (of type `op`) that reads the values of `name`."""
    readers = [n for n in view.consumers.get(name, []) if n.op_type not in SHAPE_ONLY]
    if len(readers) != 1 or readers[0].op_type != op or name in outputs:
        raise _Unsupported(f"{name}: not read by one {op} alone")
    return readers[0]
