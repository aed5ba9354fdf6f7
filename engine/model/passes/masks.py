"""Masks and positions: rewrite Marian's ONNX decoder so that rows of one call may have
different lengths (continuous batching).

The Optimum export has neither a decoder attention mask (it builds a causal mask from the
past length) nor position ids (it looks up `embed_positions` at one range for every row).
`rewrite_decoder` adds both inputs (`names.MASK_INPUT`, `names.POSITIONS_INPUT`): every
self-attention score mask becomes `Where(mask == 0, NEG, causal_mask)`, NEG being the
graph's own large negative value, so a padding slot is as invisible as a future token (the
causal mask built from the two lengths, in place of the export's: `_causal_mask`); the
given positions replace the lookup's `Range + past_len`. With an all-ones mask and
consecutive positions the logits are the original graph's.

The subgraphs are found by structure, never by node names (`_find_masks`,
`_find_positions`), in fp32 and int8 files, no-past, with-past and merged (both `If`
branches) decoders; a with-past graph traced without a self-attention mask (exporters before
transformers 4.48) gets the padding mask added to its scores and is marked not causal
(`names.CAUSAL_KEY`). A graph of any other shape gives None and a logged reason: the model
then batches only rows of equal length (lockstep).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from engine.model.names import (
    CAUSAL_KEY,
    ENCODER_ATTENTION_MASK,
    INPUT_IDS,
    MASK_INPUT,
    POSITIONS_INPUT,
    is_self_kv,
)
from engine.model.passes.graph import GraphView, live_nodes, opset

log = logging.getLogger(__name__)

_PREFIX = "batched_decoder"  # the new nodes' and initializers' names start with this
_MATMULS = frozenset(
    {"MatMul", "MatMulInteger", "Gemm", "QLinearMatMul", "MatMulNBits", "DynamicQuantizeMatMul"}
)
_MASK_WRAPPERS = frozenset({"Reshape", "Cast", "Identity"})  # between the mask Add and Softmax
_LOOKUP_CHAIN = frozenset({"Cast", "Identity", "DequantizeLinear", "Mul", "Unsqueeze"})
_NEGATIVE_ENOUGH = -1e4  # a mask constant at or below this is "the large negative value"


class _Unsupported(Exception):
    """The graph does not have the structure the rewrite understands (message says why)."""


@dataclass(frozen=True)
class _Link:
    """One op between the positions `Range` and the lookup: `operand` is the input that
    carries the positions; `keep` is False for what the given position ids replace (an
    added past length, an Unsqueeze to [1, T]), True for what still applies to them (a
    cast, a constant offset such as BART's +2)."""

    node: onnx.NodeProto
    operand: int
    keep: bool


@dataclass
class _Plan:
    """What to change in one graph, found before anything is modified: the self-attention
    mask Adds (node, operand index), the self-attention softmaxes that have no mask at all,
    and the position lookup."""

    self_masks: list[tuple[onnx.NodeProto, int]]
    unmasked: list[onnx.NodeProto]
    negative: npt.NDArray[Any]  # 0-d, the mask's own large negative value and dtype
    gather: onnx.NodeProto
    index_chain: list[_Link]  # Range output -> ... -> Gather indices, in order
    lookup_unsqueeze: onnx.NodeProto | None  # an Unsqueeze(axes 0) after the lookup to drop


def _softmax_mask_add(view: GraphView, softmax: onnx.NodeProto) -> onnx.NodeProto | None:
    """The Add that puts a mask on this softmax's scores (through Reshape/Cast), or None."""
    name = softmax.input[0]
    for _ in range(4):
        node = view.producer.get(name)
        if node is None:
            return None
        if node.op_type == "Add":
            return node
        if node.op_type not in _MASK_WRAPPERS:
            return None
        name = node.input[0]
    return None


def _mask_operand(view: GraphView, add: onnx.NodeProto) -> int | None:
    """Which input of `add` is the mask: the one no matmul flows into (the other one holds
    the scores)."""
    operands = []
    for index, name in enumerate(add.input):
        nodes, _ = view.ancestry(name, stop_at=_MATMULS)
        if not any(n.op_type in _MATMULS for n in nodes):
            operands.append(index)
    return operands[0] if len(operands) == 1 else None


def _reads_cached_values(view: GraphView, softmax: onnx.NodeProto) -> bool:
    """Whether the softmax weights a self-attention KV cache: the matmul it feeds reads a
    `past_key_values.*.decoder.*` input (how a with-past graph traced with one token looks
    when the exporter built no causal mask for it)."""
    todo = [softmax.output[0]]
    while todo:
        probs = todo.pop()
        for user in view.consumers.get(probs, []):
            if user.op_type in _MASK_WRAPPERS:  # e.g. [B * H, T, S] back to [B, H, T, S]
                todo.append(user.output[0])
            if user.op_type != "MatMul":
                continue
            values = user.input[1] if user.input[0] == probs else user.input[0]
            _, leaves = view.ancestry(values)
            if any(is_self_kv(n) for n in leaves):
                return True
    return False


def _large_negatives(view: GraphView, nodes: Iterable[onnx.NodeProto]) -> list[npt.NDArray[Any]]:
    """Float constants at or below `_NEGATIVE_ENOUGH` that `nodes` read or make, 0-d."""
    found = []
    for node in nodes:
        for tensor in (*node.input, *node.output):
            dims = view.dims(tensor) if tensor else None
            small = dims is not None and int(np.prod(dims)) <= 16  # no weight is converted
            value = view.constant(tensor) if small else None
            if value is None and node.op_type == "ConstantOfShape" and tensor in node.output:
                value = _constant_of_shape_value(node)
            if value is not None and value.dtype.kind == "f" and value.size:
                low = value.min()
                if float(low) <= _NEGATIVE_ENOUGH:
                    found.append(np.array(low, dtype=value.dtype))
    return found


def _find_masks(
    view: GraphView,
) -> tuple[list[tuple[onnx.NodeProto, int]], list[onnx.NodeProto], npt.NDArray[Any]]:
    softmaxes = [n for n in view.graph.node if n.op_type == "Softmax"]
    if not softmaxes:
        raise _Unsupported("no Softmax: not an attention decoder")
    self_masks: list[tuple[onnx.NodeProto, int]] = []
    unmasked: list[onnx.NodeProto] = []
    self_negatives: list[npt.NDArray[Any]] = []
    cross_negatives: list[npt.NDArray[Any]] = []
    for softmax in softmaxes:
        add = _softmax_mask_add(view, softmax)
        operand = None if add is None else _mask_operand(view, add)
        if add is None or operand is None:
            if _reads_cached_values(view, softmax):
                unmasked.append(softmax)
                continue
            raise _Unsupported(f"softmax {softmax.name!r} has no additive mask")
        nodes, leaves = view.ancestry(add.input[operand])
        reads = {leaf for leaf in leaves if not view.is_constant(leaf)}
        if ENCODER_ATTENTION_MASK in reads:
            cross_negatives += _large_negatives(view, nodes)
            continue
        if reads:
            raise _Unsupported(f"mask of {softmax.name!r} reads {sorted(reads)[:3]}")
        self_masks.append((add, operand))
        self_negatives += _large_negatives(view, nodes)
    if not self_masks and not unmasked:
        raise _Unsupported("no self-attention found")
    if self_masks and not self_negatives:
        raise _Unsupported("the causal mask has no large negative constant")
    # A graph with no causal mask at all takes the value of its encoder mask.
    negatives = self_negatives or cross_negatives
    if not negatives:
        raise _Unsupported("no mask with a large negative constant")
    return self_masks, unmasked, min(negatives, key=float)


def _constant_of_shape_value(node: onnx.NodeProto) -> npt.NDArray[Any] | None:
    for attr in node.attribute:
        if attr.name == "value":
            return np.asarray(numpy_helper.to_array(attr.t))
    return None


def _reaches_range(view: GraphView, name: str) -> bool:
    nodes, _ = view.ancestry(name, stop_at=frozenset({"Range"}))
    return any(n.op_type == "Range" for n in nodes)


def _shape_only(view: GraphView, name: str) -> bool:
    """Whether a tensor depends on nothing but shapes and constants (a past length)."""
    _, leaves = view.ancestry(name)
    return all(view.is_constant(leaf) for leaf in leaves)


def _walk_indices(view: GraphView, name: str) -> tuple[list[_Link], onnx.NodeProto] | None:
    """The ops from a step-1 `Range` to the lookup indices `name`, or None."""
    links: list[_Link] = []
    current = view.producer.get(name)
    while current is not None and current.op_type != "Range":
        op = current.op_type
        if op in ("Cast", "Identity"):
            links.append(_Link(current, 0, True))
        elif op == "Unsqueeze":
            links.append(_Link(current, 0, False))
        elif op in ("Add", "Sub") and len(current.input) == 2:
            operand = next((i for i in (0, 1) if _reaches_range(view, current.input[i])), None)
            if operand is None or (op == "Sub" and operand != 0):
                return None
            other = current.input[1 - operand]
            if view.constant(other) is not None:
                links.append(_Link(current, operand, True))
            elif _shape_only(view, other):
                links.append(_Link(current, operand, False))
            else:
                return None
        else:
            return None
        current = view.producer.get(current.input[links[-1].operand])
    if current is None:
        return None
    step = view.constant(current.input[2])
    if step is None or step.size != 1 or int(step.reshape(())) != 1:
        return None
    return links[::-1], current


def _find_positions(view: GraphView) -> tuple[onnx.NodeProto, list[_Link]]:
    """The `embed_positions` lookup and the ops from its `Range` to its indices."""
    found: list[tuple[onnx.NodeProto, list[_Link]]] = []
    for node in view.graph.node:
        if node.op_type != "Gather" or len(node.input) != 2:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if axis != 0 or view.rank(node.input[0]) != 2:
            continue
        walk = _walk_indices(view, node.input[1])
        if walk is not None:
            found.append((node, walk[0]))
    if len(found) != 1:
        raise _Unsupported(f"{len(found)} position lookups (Gather on a Range) instead of one")
    return found[0]


def _plan(view: GraphView) -> _Plan:
    if MASK_INPUT in view.inputs or POSITIONS_INPUT in view.inputs:
        raise _Unsupported(f"already takes {MASK_INPUT} or {POSITIONS_INPUT}")
    self_masks, unmasked, negative = _find_masks(view)
    gather, chain = _find_positions(view)
    unsqueezes = [link.node for link in chain if link.node.op_type == "Unsqueeze"]
    if any(_unsqueeze_axes(view, n) != [0] for n in unsqueezes) or len(unsqueezes) > 1:
        raise _Unsupported("position indices are reshaped in a way the rewrite does not know")
    lookup_unsqueeze = None
    if not unsqueezes:
        # Indices [T] became [B, T]: the looked-up rows gain a leading batch axis, which the
        # Add with the token embeddings [B, T, D] broadcasts, provided nothing in between
        # depends on the rank (a per-tensor dequantize, a cast, a scale do not).
        lookup_unsqueeze = _check_lookup_path(view, gather)
    return _Plan(self_masks, unmasked, negative, gather, chain, lookup_unsqueeze)


def _unsqueeze_axes(view: GraphView, node: onnx.NodeProto) -> list[int] | None:
    if len(node.input) > 1:
        axes = view.constant(node.input[1])
        return None if axes is None else [int(a) for a in axes.reshape(-1)]
    for attr in node.attribute:
        if attr.name == "axes":
            return list(attr.ints)
    return None


def _check_lookup_path(view: GraphView, gather: onnx.NodeProto) -> onnx.NodeProto | None:
    """Follow the looked-up embeddings to the Add with the token embeddings; return an
    Unsqueeze(axes 0) met on the way (to be bypassed) or raise if the path is unknown."""
    name = gather.output[0]
    unsqueeze = None
    while True:
        users = view.consumers.get(name, [])
        if len(users) != 1:
            raise _Unsupported(f"position embeddings used by {len(users)} nodes")
        user = users[0]
        if user.op_type == "Add":
            return unsqueeze
        if user.op_type not in _LOOKUP_CHAIN or user.input[0] != name:
            raise _Unsupported(f"position embeddings go through {user.op_type}")
        if user.op_type == "DequantizeLinear":
            scale = view.constant(user.input[1])
            if scale is None or scale.size != 1:
                raise _Unsupported("position table dequantized per axis")
        if user.op_type == "Mul":
            factor = view.constant(user.input[1])
            if factor is None or factor.size != 1:
                raise _Unsupported("position embeddings scaled by a non-scalar")
        if user.op_type == "Unsqueeze":
            if _unsqueeze_axes(view, user) != [0] or unsqueeze is not None:
                raise _Unsupported("position embeddings unsqueezed on an inner axis")
            unsqueeze = user
        name = user.output[0]


def _apply(view: GraphView, plan: _Plan, tag: str, version: int) -> None:
    """Edit the graph in place according to the plan; new names carry `tag`."""
    graph = view.graph
    name = f"{_PREFIX}/{tag}"

    def const(suffix: str, value: npt.NDArray[Any]) -> str:
        graph.initializer.append(numpy_helper.from_array(value, f"{name}/{suffix}"))
        return f"{name}/{suffix}"

    def unsqueeze(source: str, axes: list[int], out: str) -> onnx.NodeProto:
        if version >= 13:
            axes_name = const(f"{out}_axes", np.array(axes, dtype=np.int64))
            return helper.make_node("Unsqueeze", [source, axes_name], [out], name=out)
        return helper.make_node("Unsqueeze", [source], [out], name=out, axes=axes)

    zero = const("zero", np.array(0, dtype=np.int64))
    negative = const("negative", plan.negative)
    pad = f"{name}/padding"  # [B, 1, 1, past + cur], True where masked
    head = [
        helper.make_node("Equal", [MASK_INPUT, zero], [f"{pad}_2d"], name=f"{pad}_2d"),
        unsqueeze(f"{pad}_2d", [1, 2], pad),
    ]
    # New nodes go right before the node that reads them (kept topologically sorted),
    # keyed by that node's first output, which is unique in the graph.
    before: dict[str, list[onnx.NodeProto]] = {}
    if plan.unmasked:
        # Scores [B, H, T, S] or [B * H, T, S] (older attention code): viewed as
        # [B, H * T, S], plus a bias [B, 1, S] that is NEG on padding slots, viewed back.
        dims, rows, bias = f"{name}/mask_shape", f"{name}/rows_shape", f"{name}/padding_bias"
        one, two = const("one", np.array([1], np.int64)), const("two", np.array([2], np.int64))
        head += [
            helper.make_node("Shape", [MASK_INPUT], [dims], name=dims),
            helper.make_node(
                "Slice", [dims, const("start", np.array([0], np.int64)), one], [f"{dims}_b"]
            ),
            helper.make_node("Slice", [dims, one, two], [f"{dims}_s"]),
            helper.make_node(
                "Concat",
                [f"{dims}_b", const("minus_one", np.array([-1], np.int64)), f"{dims}_s"],
                [rows],
                name=rows,
                axis=0,
            ),
            unsqueeze(f"{pad}_2d", [1], f"{pad}_3d"),
            helper.make_node(
                "Where",
                [f"{pad}_3d", negative, const("zero_float", np.zeros((), plan.negative.dtype))],
                [bias],
                name=bias,
            ),
        ]
        for layer, softmax in enumerate(plan.unmasked):
            scores, step = softmax.input[0], f"{name}/self_scores_{layer}"
            before.setdefault(softmax.output[0], []).extend(
                [
                    helper.make_node("Shape", [scores], [f"{step}_shape"]),
                    helper.make_node("Reshape", [scores, rows], [f"{step}_rows"]),
                    helper.make_node("Add", [f"{step}_rows", bias], [f"{step}_masked"]),
                    helper.make_node("Reshape", [f"{step}_masked", f"{step}_shape"], [step]),
                ]
            )
            softmax.input[0] = step
    causal = _causal_mask(name, const, unsqueeze, plan.negative, head) if plan.self_masks else ""
    for layer, (add, operand) in enumerate(plan.self_masks):
        masked = f"{name}/self_mask_{layer}"
        where = [pad, negative, causal]
        before.setdefault(add.output[0], []).append(
            helper.make_node("Where", where, [masked], name=masked)
        )
        add.input[operand] = masked
    current = POSITIONS_INPUT
    chain_nodes: list[onnx.NodeProto] = []
    for index, link in enumerate(plan.index_chain):
        if not link.keep:
            continue
        out = f"{name}/positions_{index}"
        inputs = list(link.node.input)
        inputs[link.operand] = current
        copy = helper.make_node(link.node.op_type, inputs, [out], name=out)
        copy.attribute.extend(link.node.attribute)
        chain_nodes.append(copy)
        current = out
    before.setdefault(plan.gather.output[0], []).extend(chain_nodes)
    plan.gather.input[1] = current
    dropped = None
    if plan.lookup_unsqueeze is not None:
        node = plan.lookup_unsqueeze
        dropped = node.output[0]
        bypass = helper.make_node("Identity", [node.input[0]], [dropped], name=node.name)
        before.setdefault(dropped, []).append(bypass)
    nodes = list(head)
    for node in graph.node:
        key = node.output[0] if node.output else ""
        nodes.extend(before.get(key, []))
        if not key or key != dropped:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            nodes.append(copy)
    del graph.node[:]
    graph.node.extend(live_nodes(nodes, {o.name for o in graph.output}))  # the export's mask


def _causal_mask(
    name: str,
    const: Callable[[str, npt.NDArray[Any]], str],
    unsqueeze: Callable[[str, list[int], str], onnx.NodeProto],
    negative: npt.NDArray[Any],
    head: list[onnx.NodeProto],
) -> str:
    """Append to `head` the causal mask [T, S] of new token i (after `S - T` cached ones)
    over key j: NEG where j > S - T + i, else 0, from the lengths of the ids and of the
    mask; return its name.

    Why: it is the export's own causal mask (the masks rewrite's check compares them on a
    forced prefix, a cached step and, in fp32, new tokens after a cache), which builds it
    with about 60 nodes (`Trilu`, `ScatterND` of a padding mask that is all ones, `Range`s,
    `Expand`s): a fifth of a prefill's nodes, and a call costs what its nodes cost."""
    mask = f"{name}/causal"
    one = const("causal_one", np.array(1, dtype=np.int64))
    zero = const("causal_zero", np.array(0, dtype=np.int64))
    head += [
        helper.make_node("Shape", [INPUT_IDS], [f"{mask}_ids_shape"]),
        helper.make_node("Gather", [f"{mask}_ids_shape", one], [f"{mask}_new"], axis=0),
        helper.make_node("Shape", [MASK_INPUT], [f"{mask}_mask_shape"]),
        helper.make_node("Gather", [f"{mask}_mask_shape", one], [f"{mask}_keys"], axis=0),
        helper.make_node("Sub", [f"{mask}_keys", f"{mask}_new"], [f"{mask}_past"]),
        helper.make_node("Range", [f"{mask}_past", f"{mask}_keys", one], [f"{mask}_rows"]),
        unsqueeze(f"{mask}_rows", [1], f"{mask}_query"),
        helper.make_node("Range", [zero, f"{mask}_keys", one], [f"{mask}_key"]),
        helper.make_node("Greater", [f"{mask}_key", f"{mask}_query"], [f"{mask}_future"]),
        helper.make_node(
            "Where",
            [
                f"{mask}_future",
                const("causal_negative", negative),
                const("causal_zero_float", np.zeros((), negative.dtype)),
            ],
            [mask],
            name=mask,
        ),
    ]
    return mask


def _add_inputs(graph: onnx.GraphProto) -> None:
    ids = next((i for i in graph.input if i.name == INPUT_IDS), None)
    if ids is None:
        raise _Unsupported(f"no {INPUT_IDS} input")
    dims = [d.dim_param or d.dim_value for d in ids.type.tensor_type.shape.dim]
    batch = dims[0] if dims else "batch_size"
    length = dims[1] if len(dims) > 1 else "decoder_sequence_length"
    graph.input.extend(
        [
            helper.make_tensor_value_info(
                MASK_INPUT, TensorProto.INT64, [batch, "past_plus_decoder_sequence_length"]
            ),
            helper.make_tensor_value_info(POSITIONS_INPUT, TensorProto.INT64, [batch, length]),
        ]
    )


def _rewrite(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    version = opset(out)
    declared = {i.name for i in graph.input}
    if MASK_INPUT in declared or POSITIONS_INPUT in declared:
        raise _Unsupported(f"already takes {MASK_INPUT} or {POSITIONS_INPUT}")
    if len(graph.node) == 1 and graph.node[0].op_type == "If":
        outer = {i.name: i for i in graph.initializer}
        branches = [a for a in graph.node[0].attribute if a.type == onnx.AttributeProto.GRAPH]
        if {a.name for a in branches} != {"then_branch", "else_branch"}:
            raise _Unsupported("an If that is not the merged decoder's")
        views = [(a.name, GraphView(a.g, outer)) for a in branches]
        plans = [(tag, view, _plan(view)) for tag, view in views]  # all found before editing
        for tag, view, plan in plans:
            _apply(view, plan, tag, version)
    else:
        view = GraphView(graph, {})
        plans = [("main", view, _plan(view))]
        _apply(view, plans[0][2], "main", version)
    _add_inputs(graph)
    # Several new tokens per row after a cache need a causal mask among them; a graph
    # whose self-attention had no mask at all (traced with one token) gets only the
    # padding mask from the rewrite, so its rows must take one token per call.
    causal = not any(plan.unmasked for _, _, plan in plans)
    props = {p.key: p for p in out.metadata_props}
    prop = props.get(CAUSAL_KEY) or out.metadata_props.add()
    prop.key, prop.value = CAUSAL_KEY, "1" if causal else "0"
    return out


def rewrite_decoder(model: onnx.ModelProto, name: str = "decoder") -> onnx.ModelProto | None:
    """A copy of `model` that takes `decoder_attention_mask` and `decoder_position_ids`,
    or None (the reason logged) when its graph lacks the structure this module knows.

    Works on a no-past decoder, a with-past decoder, or a merged one (both branches),
    fp32 or int8. `model` is not modified. `engine.model.checks.check_rewrite` compares
    the result with the original.
    """
    try:
        return _rewrite(model)
    except _Unsupported as exc:
        reason = str(exc)
    except Exception as exc:  # a malformed graph: falling back is always safe
        reason = f"unexpected graph: {exc!r}"
    log.warning("%s: no batched-decoder rewrite (%s): rows must share one length", name, reason)
    return None
