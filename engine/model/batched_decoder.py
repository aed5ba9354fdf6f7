"""Rewrite Marian's ONNX decoder so that rows of one batch may have different lengths.

Continuous batching puts streams that started at different times into one decoder call, so
each row has its own number of cached tokens. The stock Optimum export cannot take that: it
has no decoder attention mask (it builds a causal mask from the past length) and no position
ids (it looks up `embed_positions` at `range(past_len, past_len + cur_len)`, the same for all
rows). `rewrite_decoder` adds, at load time:

- `decoder_attention_mask` int64 [B, past_len + cur_len]: 1 for real positions, 0 for
  padding slots in the self-attention KV cache and among the current tokens. Every
  self-attention score mask becomes `Where(mask == 0, NEG, causal_mask)`, NEG being the large
  negative value the graph's own mask uses, so a padding slot is exactly as invisible as a
  future token. The causal part still counts cache *slots*, which is right: a row's new
  tokens sit after all slots, real or padding.
- `decoder_position_ids` int64 [B, cur_len]: each row's real positions, fed to the
  `embed_positions` lookup in place of the shared range.

With an all-ones mask and positions `arange(past, past + cur)`, the `Where` passes the
original mask through bit for bit and the lookup returns the same rows, so logits equal the
original graph's.

Feeding it (what tests/test_batched_decoder.py does):
- prefill: rows padded to one length T (right or left), mask [B, T] 0 on the padding,
  positions 0..n-1 of each row's own tokens (any in-range value, e.g. 0, on padding);
- each step: one token per row, mask = previous mask + a column of ones, positions
  [B, 1] = each row's own length; the cache grows by one slot per row, padding included;
- a row joining later: its self KV zero-padded along axis 2 (left or right) to the batch's
  slot count with mask 0 there, its encoder KV and `encoder_attention_mask` likewise;
- padding slots must hold finite values (zeros): a masked slot weighs exactly 0, but
  0 * NaN is NaN. Logits at padded token positions are meaningless.

The subgraphs are found by structure, not by node names:
- score masks: the operand of the `Add` feeding each attention `Softmax` whose ancestry
  (not looking through `Shape`) has no matmul; it is the self-attention mask when that
  ancestry reads no graph input (it derives from shapes and constants), the cross-attention
  mask when it reads `encoder_attention_mask`;
- self-attention with no mask at all: exporters before transformers 4.48 built no causal
  mask for one query token, so their with-past graph adds nothing to its self-attention
  scores. A softmax without a mask whose weights multiply a `past_key_values.*.decoder.*`
  value gets the padding mask added to its scores ([B, H, T, S] or the older
  [B * H, T, S], viewed as [B, H * T, S]), NEG taken from the encoder mask;
- positions: the one `Gather` from a constant 2-D table whose indices come from a `Range`
  with step 1, through `Cast`/`Unsqueeze`, constant offsets (kept) and an added past length
  (dropped: the given positions replace `Range + past_len` too), never from a graph input.
Both the fp32 and the int8 (`quantize_dynamic`) files have this shape: in int8 the table is
an int8 initializer followed by a per-tensor `DequantizeLinear`, and the masks stay fp32.
A merged decoder (one `If` on `use_cache_branch`) is rewritten inside both branches.

Anything else (a no-past softmax without a mask, two position lookups, a mask with no
large negative constant, a per-axis dequantized table) returns None and logs why: callers
then batch only rows of equal length (lockstep).

int8 caveat, not the rewrite's: `DynamicQuantizeLinear` takes one scale per tensor over
the whole batch, so with the files' quantization any batching (lockstep too) moves a row's
int8 logits a little (0.2 on the fixture) against decoding it alone; `per_token=True`
(what the engine runs) quantizes per token instead (`engine.model.passes.per_token`).

Needs the `onnx` package, imported only here, like `engine.model.passes.merged_split`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from engine.model.passes.merged_split import split_merged

if TYPE_CHECKING:
    import onnx
    import onnxruntime as ort

log = logging.getLogger(__name__)

MASK_INPUT = "decoder_attention_mask"
POSITIONS_INPUT = "decoder_position_ids"
REWRITE_TOLERANCE = 1e-4
"""Largest logit difference accepted between a rewritten decoder and the original."""

_PREFIX = "batched_decoder"
_MATMULS = frozenset(
    {"MatMul", "MatMulInteger", "Gemm", "QLinearMatMul", "MatMulNBits", "DynamicQuantizeMatMul"}
)
_SHAPE_ONLY = frozenset({"Shape", "Size"})  # read their input's shape, not its values
_MASK_WRAPPERS = frozenset({"Reshape", "Cast", "Identity"})  # between the mask Add and Softmax
_LOOKUP_CHAIN = frozenset({"Cast", "Identity", "DequantizeLinear", "Mul", "Unsqueeze"})
_NEGATIVE_ENOUGH = -1e4  # a mask constant at or below this is "the large negative value"


CAUSAL_KEY = "nmt_incremental.causal_over_new_tokens"
"""Metadata of a rewritten decoder: "1" when its self-attention is causal among several
new tokens after a cache (so a step may verify lookahead tokens), "0" when not."""


class _Unsupported(Exception):
    """The graph does not have the structure the rewrite understands (message says why)."""


@dataclass(frozen=True)
class BatchedDecoder:
    """Rewritten decoders of one model directory, serialised for `InferenceSession`.

    `first` takes no past (start token plus forced prefix, padded rows allowed); `step`
    takes the self and cross KV. Both take `decoder_attention_mask` [B, past + cur] and
    `decoder_position_ids` [B, cur] besides the inputs of the files they came from.
    """

    first: bytes
    step: bytes
    sources: tuple[str, ...]
    max_difference: float | None  # None: not checked (`load_batched_decoder(check=False)`)
    # `load_batched_decoder(per_token=True)` on int8 files: `first` and `tokens` (the step)
    # quantize activations per token (`engine.model.passes.per_token`); `step` keeps the files'
    # quantization, the same values for a call of one token and faster. None otherwise.
    tokens: bytes | None = None


# -- graph inspection --------------------------------------------------------------------


class _View:
    """Producers, consumers and constants of one graph (a branch also sees the outer
    graph's initializers, which an `If` branch reads as shared weights)."""

    def __init__(self, graph: onnx.GraphProto, outer: dict[str, onnx.TensorProto]) -> None:
        self.graph = graph
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for out in node.output:
                if out:
                    self.producer[out] = node
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        self.initializers = {**outer, **{i.name: i for i in graph.initializer}}
        self.inputs = {i.name for i in graph.input}

    def is_constant(self, name: str) -> bool:
        node = self.producer.get(name)
        return name in self.initializers or (node is not None and node.op_type == "Constant")

    def dims(self, name: str) -> list[int] | None:
        """Shape of a constant tensor, read without converting it (tables can be large)."""
        if name in self.initializers:
            return list(self.initializers[name].dims)
        node = self.producer.get(name)
        if node is None or node.op_type != "Constant":
            return None
        for attr in node.attribute:
            if attr.name == "value":
                return list(attr.t.dims)
            if attr.name in ("value_float", "value_int"):
                return []
            if attr.name in ("value_floats", "value_ints"):
                return [len(attr.floats) or len(attr.ints)]
        return None

    def rank(self, name: str) -> int | None:
        dims = self.dims(name)
        return None if dims is None else len(dims)

    def constant(self, name: str) -> npt.NDArray[Any] | None:
        """The value of a tensor known at load time (initializer or `Constant`), else None."""
        from onnx import helper, numpy_helper

        if name in self.initializers:
            return np.asarray(numpy_helper.to_array(self.initializers[name]))
        node = self.producer.get(name)
        if node is None or node.op_type != "Constant":
            return None
        for attr in node.attribute:
            value = helper.get_attribute_value(attr)
            if attr.name == "value":
                return np.asarray(numpy_helper.to_array(value))
            if attr.name in ("value_float", "value_int", "value_floats", "value_ints"):
                return np.asarray(value)
        return None

    def ancestry(
        self,
        name: str,
        stop_at: frozenset[str] = frozenset(),
        leaves_at: frozenset[str] = frozenset(),
    ) -> tuple[list[onnx.NodeProto], set[str]]:
        """Nodes whose values flow into `name` and the leaf tensors (inputs, initializers,
        outer names, and any of `leaves_at`, not traced further) they read; does not look
        through shape-only ops. Stops early (and returns what it has) at the first node
        whose type is in `stop_at`."""
        nodes: list[onnx.NodeProto] = []
        leaves: set[str] = set()
        seen: set[str] = set()
        todo = [name]
        while todo:
            current = todo.pop()
            if current in seen or not current:
                continue
            seen.add(current)
            node = self.producer.get(current)
            if node is None or current in leaves_at:
                leaves.add(current)
                continue
            nodes.append(node)
            if node.op_type in stop_at:
                break
            if node.op_type not in _SHAPE_ONLY:
                todo.extend(node.input)
        return nodes, leaves


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


def _softmax_mask_add(view: _View, softmax: onnx.NodeProto) -> onnx.NodeProto | None:
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


def _mask_operand(view: _View, add: onnx.NodeProto) -> int | None:
    """Which input of `add` is the mask: the one no matmul flows into (the other one holds
    the scores)."""
    operands = []
    for index, name in enumerate(add.input):
        nodes, _ = view.ancestry(name, stop_at=_MATMULS)
        if not any(n.op_type in _MATMULS for n in nodes):
            operands.append(index)
    return operands[0] if len(operands) == 1 else None


def _reads_cached_values(view: _View, softmax: onnx.NodeProto) -> bool:
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
            if any(n.startswith("past_key_values.") and ".decoder." in n for n in leaves):
                return True
    return False


def _large_negatives(view: _View, nodes: Iterable[onnx.NodeProto]) -> list[npt.NDArray[Any]]:
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
    view: _View,
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
        if "encoder_attention_mask" in reads:
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
    from onnx import numpy_helper

    for attr in node.attribute:
        if attr.name == "value":
            return np.asarray(numpy_helper.to_array(attr.t))
    return None


def _reaches_range(view: _View, name: str) -> bool:
    nodes, _ = view.ancestry(name, stop_at=frozenset({"Range"}))
    return any(n.op_type == "Range" for n in nodes)


def _shape_only(view: _View, name: str) -> bool:
    """Whether a tensor depends on nothing but shapes and constants (a past length)."""
    _, leaves = view.ancestry(name)
    return all(view.is_constant(leaf) for leaf in leaves)


def _walk_indices(view: _View, name: str) -> tuple[list[_Link], onnx.NodeProto] | None:
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


def _find_positions(view: _View) -> tuple[onnx.NodeProto, list[_Link]]:
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


def _plan(view: _View) -> _Plan:
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


def _unsqueeze_axes(view: _View, node: onnx.NodeProto) -> list[int] | None:
    if len(node.input) > 1:
        axes = view.constant(node.input[1])
        return None if axes is None else [int(a) for a in axes.reshape(-1)]
    for attr in node.attribute:
        if attr.name == "axes":
            return list(attr.ints)
    return None


def _check_lookup_path(view: _View, gather: onnx.NodeProto) -> onnx.NodeProto | None:
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


# -- graph editing -----------------------------------------------------------------------


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _apply(view: _View, plan: _Plan, tag: str, opset: int) -> None:
    """Edit the graph in place according to the plan; new names carry `tag`."""
    import onnx
    from onnx import helper, numpy_helper

    graph = view.graph
    name = f"{_PREFIX}/{tag}"

    def const(suffix: str, value: npt.NDArray[Any]) -> str:
        graph.initializer.append(numpy_helper.from_array(value, f"{name}/{suffix}"))
        return f"{name}/{suffix}"

    def unsqueeze(source: str, axes: list[int], out: str) -> onnx.NodeProto:
        if opset >= 13:
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
    for layer, (add, operand) in enumerate(plan.self_masks):
        masked = f"{name}/self_mask_{layer}"
        where = [pad, negative, add.input[operand]]
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
    graph.node.extend(nodes)


def _add_inputs(graph: onnx.GraphProto) -> None:
    from onnx import TensorProto, helper

    ids = next((i for i in graph.input if i.name == "input_ids"), None)
    if ids is None:
        raise _Unsupported("no input_ids input")
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
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    opset = _opset(out)
    declared = {i.name for i in graph.input}
    if MASK_INPUT in declared or POSITIONS_INPUT in declared:
        raise _Unsupported(f"already takes {MASK_INPUT} or {POSITIONS_INPUT}")
    if len(graph.node) == 1 and graph.node[0].op_type == "If":
        outer = {i.name: i for i in graph.initializer}
        branches = [a for a in graph.node[0].attribute if a.type == onnx.AttributeProto.GRAPH]
        if {a.name for a in branches} != {"then_branch", "else_branch"}:
            raise _Unsupported("an If that is not the merged decoder's")
        views = [(a.name, _View(a.g, outer)) for a in branches]
        plans = [(tag, view, _plan(view)) for tag, view in views]  # all found before editing
        for tag, view, plan in plans:
            _apply(view, plan, tag, opset)
    else:
        view = _View(graph, {})
        plans = [("main", view, _plan(view))]
        _apply(view, plans[0][2], "main", opset)
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
    or None (the reason logged) when its graph lacks the structure described above.

    Works on a no-past decoder, a with-past decoder, or a merged one (both branches),
    fp32 or int8. `model` is not modified. Check the result with `check_rewrite`.
    """
    try:
        return _rewrite(model)
    except _Unsupported as exc:
        reason = str(exc)
    except Exception as exc:  # a malformed graph: falling back is always safe
        reason = f"unexpected graph: {exc!r}"
    log.warning("%s: no batched-decoder rewrite (%s): rows must share one length", name, reason)
    return None


# -- checking ----------------------------------------------------------------------------


def _session(model: Path | bytes | ort.InferenceSession) -> Any:
    import onnxruntime as ort

    if not isinstance(model, Path | bytes):
        return model  # a session already (the caller's own options)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    source = str(model) if isinstance(model, Path) else model
    return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])


def _dim(value: Any, default: int) -> int:
    return value if isinstance(value, int) else default


def probe_feed(
    inputs: Iterable[Any],
    *,
    past_len: int,
    cur_len: int,
    batch: int = 1,
    source_len: int = 5,
    seed: int = 0,
    vocab: int = 8,
) -> dict[str, npt.NDArray[Any]]:
    """Random decoder inputs for ONNX Runtime input descriptions (`NodeArg`s), with an
    all-ones decoder mask and positions `arange(past_len, past_len + cur_len)`; the encoder
    KV has `source_len` positions in a with-past call and none in a no-past one."""
    rng = np.random.default_rng(seed)
    feed: dict[str, npt.NDArray[Any]] = {}
    for arg in inputs:
        name, shape = arg.name, list(arg.shape)
        if name == "input_ids":
            feed[name] = rng.integers(1, max(vocab, 2), (batch, cur_len), dtype=np.int64)
        elif name == "encoder_attention_mask":
            feed[name] = np.ones((batch, source_len), dtype=np.int64)
        elif name == "use_cache_branch":
            feed[name] = np.array([past_len > 0])
        elif name == MASK_INPUT:
            feed[name] = np.ones((batch, past_len + cur_len), dtype=np.int64)
        elif name == POSITIONS_INPUT:
            row = np.arange(past_len, past_len + cur_len, dtype=np.int64)
            feed[name] = np.tile(row, (batch, 1))
        elif name == "encoder_hidden_states":
            states = (batch, source_len, _dim(shape[-1], 1))
            feed[name] = rng.standard_normal(states).astype(np.float32)
        elif name.startswith("past_key_values."):
            length = past_len if ".decoder." in name else (source_len if past_len else 0)
            size = (batch, _dim(shape[1], 1), length, _dim(shape[3], 1))
            feed[name] = rng.standard_normal(size).astype(np.float32)
        else:
            raise ValueError(f"no probe value for decoder input {name!r}")
    return feed


def check_rewrite(
    original: Path | bytes | ort.InferenceSession,
    rewritten: Path | bytes | ort.InferenceSession,
    *,
    past_len: int,
    cur_len: int,
    batch: int = 2,
    seed: int = 0,
) -> float:
    """Largest logit difference between the original decoder and its rewrite on random
    inputs, the rewrite fed an all-ones mask and consecutive positions.

    `original` may be the merged file (`use_cache_branch` is set from `past_len`) and
    `rewritten` one of its split branches: each session gets the inputs it declares. Either
    may be a session already open, so that a caller checks the sessions it will run without
    opening them twice (the fp32 OPUS-MT decoder takes ~1.7 s to open).
    """
    first, second = _session(original), _session(rewritten)
    vocab = second.get_outputs()[0].shape[-1]
    args = {a.name: a for s in (first, second) for a in s.get_inputs()}
    if "input_ids" not in args:
        raise ValueError("not a decoder: no input_ids")
    feed = probe_feed(
        args.values(),
        past_len=past_len,
        cur_len=cur_len,
        batch=batch,
        seed=seed,
        vocab=min(_dim(vocab, 8), 1000),
    )
    results = []
    for session in (first, second):
        names = {a.name for a in session.get_inputs()}
        results.append(session.run(["logits"], {k: v for k, v in feed.items() if k in names})[0])
    return float(np.max(np.abs(results[0] - results[1])))


# -- model directories -------------------------------------------------------------------


def _load(source: Path | bytes) -> onnx.ModelProto:
    import onnx

    if isinstance(source, Path):
        return onnx.load(str(source))
    return onnx.load_from_string(source)


def load_batched_decoder(
    model_dir: Path,
    *,
    quantized: bool = False,
    check: bool = True,
    tolerance: float = REWRITE_TOLERANCE,
    per_token: bool = False,
) -> BatchedDecoder | None:
    """The model's no-past and with-past decoders rewritten and checked, or None (logged).

    Takes the split pair when both files exist, else the merged file cut into its two
    branches (`engine.model.passes.merged_split`). Each rewrite is compared with the file it
    came from on a multi-token no-past probe and a one-token cached step; a difference above
    `tolerance` rejects it. `check=False` skips that (it opens four sessions) for a caller
    that runs `check_rewrite` on its own sessions; `max_difference` is then None.
    `per_token`: also the int8 no-past decoder and step (`tokens`) with activations
    quantized per token, as `MarianOnnx` opens int8 files (`RuntimeOptions.int8_per_token`);
    the check covers the mask rewrite, on the files' quantization.
    """
    try:
        import onnx  # noqa: F401
    except ImportError:
        log.info("onnx not installed: no batched-decoder rewrite")
        return None
    # Imported here so that engine.model.runtime may one day import this module.
    from engine.model.runtime import (
        DECODER,
        DECODER_MERGED,
        DECODER_WITH_PAST,
        QUANTIZED_SUFFIX,
        onnx_dir,
    )

    files = onnx_dir(model_dir)
    suffix = QUANTIZED_SUFFIX if quantized else ""
    single = files / f"{DECODER}{suffix}.onnx"
    with_past = files / f"{DECODER_WITH_PAST}{suffix}.onnx"
    merged = files / f"{DECODER_MERGED}{suffix}.onnx"
    parts: list[Path | bytes]
    originals: list[Path]
    sources: tuple[str, ...]
    if single.is_file() and with_past.is_file():
        parts, originals = [single, with_past], [single, with_past]
        sources = (single.name, with_past.name)
    elif merged.is_file():
        split = split_merged(merged)
        if split is None:
            log.warning("%s: cannot be split: no batched-decoder rewrite", merged.name)
            return None
        parts, originals, sources = list(split), [merged, merged], (merged.name,)
    else:
        log.warning("%s: no decoder with past: no batched-decoder rewrite", model_dir)
        return None
    out: list[bytes] = []
    worst: float | None = 0.0 if check else None
    # (past_len, cur_len) probes: a forced prefix, then a cached step.
    probes = (("no past", 0, 3), ("with past", 4, 1))
    for part, original, (label, past_len, cur_len) in zip(parts, originals, probes, strict=True):
        model = rewrite_decoder(_load(part), f"{sources[0]} ({label})")
        if model is None:
            return None
        data = model.SerializeToString()
        out.append(data)
        if worst is None:
            continue
        try:
            difference = check_rewrite(original, data, past_len=past_len, cur_len=cur_len)
        except Exception as exc:  # onnxruntime raises its own types for graphs it rejects
            log.warning("%s (%s): rewritten decoder does not run: %s", sources[0], label, exc)
            return None
        if not difference <= tolerance:
            log.warning(
                "%s (%s): rewritten decoder differs by %.3g (tolerance %g): not used",
                sources[0],
                label,
                difference,
                tolerance,
            )
            return None
        worst = max(worst, difference)
    if not per_token:
        return BatchedDecoder(out[0], out[1], sources, worst)
    from engine.model.passes.per_token import per_token_graph

    first = per_token_graph(out[0], f"{sources[0]} (no past)")
    tokens = per_token_graph(out[1], f"{sources[0]} (with past)")
    if first is None or tokens is None:
        return BatchedDecoder(out[0], out[1], sources, worst)  # fp32, or logged why not
    return BatchedDecoder(first, out[1], sources, worst, tokens)


# -- the output projection as a graph of its own ---------------------------------------


@dataclass(frozen=True)
class HeadSplit:
    """A decoder graph cut in two at the input of its vocabulary projection.

    `body` computes everything but the logits and outputs `hidden` (the last layer norm's
    output) besides the graph's other outputs; `head` maps `hidden` to `logits`. Run one
    after the other they are the original graph, op for op.
    """

    body: bytes
    head: bytes
    hidden: str


def split_output_projection(data: bytes, vocab: int, logits: str = "logits") -> HeadSplit | None:
    """`data` (a decoder graph) cut at the input of the matmul that projects to `vocab`
    logits, or None when the graph has no such single projection feeding `logits` alone.

    Why: at one row per call a decoder step is ~450 small ops and one large one, the
    512 x 65001 projection. Worker threads pay off only on the large one: waking a second
    thread for each small op costs more than it saves (`MaskedDecoder` runs the body on
    one thread and the head on all cores). Initializers go with the part that reads them,
    so no weight is held twice (but a tied embedding, which both read).
    """
    import onnx
    from onnx import helper

    model = onnx.load_from_string(data)
    graph = model.graph
    if any(attr.type in (attr.GRAPH, attr.GRAPHS) for n in graph.node for attr in n.attribute):
        return None  # an `If` (merged decoder): its branches read names this cut cannot see
    view = _View(graph, {})

    def projects(weight: str) -> bool:
        """[hidden, vocab], or a Transpose of a [vocab, hidden] one (tied embeddings)."""
        dims = view.dims(weight)
        if dims is not None:
            return len(dims) == 2 and dims[1] == vocab
        node = view.producer.get(weight)
        if node is None or node.op_type != "Transpose" or not view.is_constant(node.input[0]):
            return False
        dims = view.dims(node.input[0])
        return dims is not None and len(dims) == 2 and dims[0] == vocab

    projections = [
        node
        for node in graph.node
        if node.op_type in ("MatMul", "MatMulInteger")
        and len(node.input) > 1
        and projects(node.input[1])
    ]
    if len(projections) != 1 or logits not in {o.name for o in graph.output}:
        return None
    hidden = projections[0].input[0]
    if projections[0].op_type == "MatMulInteger":
        from engine.model.passes.per_token import activation_source

        source = activation_source(view.producer, hidden)
        if source is None:
            return None  # int8 activations from something this cut does not know
        hidden = source
    # The head: every node between `hidden` and `logits`.
    nodes, leaves = view.ancestry(logits, leaves_at=frozenset({hidden}))
    if leaves - {hidden} - view.initializers.keys():
        return None  # the logits read a graph input besides `hidden`
    if any(node.op_type in _SHAPE_ONLY for node in nodes):
        return None  # a shape read from the body, which the walk does not follow
    head_ids = {id(node) for node in nodes}
    head_nodes = [n for n in graph.node if id(n) in head_ids]
    if projections[0] not in head_nodes:
        return None
    for node in head_nodes:
        for out in node.output:
            users = view.consumers.get(out, [])
            if any(id(u) not in head_ids for u in users) and node.op_type != "Constant":
                return None  # the body reads a head value: not a clean cut
            if out != logits and out in {o.name for o in graph.output}:
                return None

    def used(nodes: list[onnx.NodeProto]) -> set[str]:
        return {name for node in nodes for name in node.input}

    body_nodes = [n for n in graph.node if id(n) not in head_ids]
    body_reads = used(body_nodes)
    shared = {id(n) for n in head_nodes if n.op_type == "Constant" and body_reads & set(n.output)}
    body_nodes = [n for n in graph.node if id(n) not in head_ids or id(n) in shared]
    body_reads, head_reads = used(body_nodes), used(head_nodes)  # once: graphs are large

    hidden_info = helper.make_tensor_value_info(hidden, onnx.TensorProto.FLOAT, None)
    logits_info = next(o for o in graph.output if o.name == logits)
    body_graph = helper.make_graph(
        body_nodes,
        f"{graph.name}_body",
        list(graph.input),
        [hidden_info, *(o for o in graph.output if o.name != logits)],
        [i for i in graph.initializer if i.name in body_reads],
    )
    body_inputs = body_reads | {hidden}
    del body_graph.input[:]
    body_graph.input.extend(i for i in graph.input if i.name in body_inputs)
    head_graph = helper.make_graph(
        head_nodes,
        f"{graph.name}_head",
        [hidden_info],
        [logits_info],
        [i for i in graph.initializer if i.name in head_reads],
    )
    # The shapes the graph knows go with each part: ORT's fusions need them (without them
    # the body's Add + LayerNormalization stayed unfused where the whole step had
    # SkipLayerNormalization, which rounds differently: not the same values bit for bit).
    for part, part_nodes, reads in (
        (body_graph, body_nodes, body_reads),
        (head_graph, head_nodes, head_reads),
    ):
        names = reads | {out for node in part_nodes for out in node.output}
        part.value_info.extend(v for v in graph.value_info if v.name in names)
    parts = []
    for part in (body_graph, head_graph):
        out = helper.make_model(part, opset_imports=list(model.opset_import))
        out.ir_version = model.ir_version
        parts.append(out.SerializeToString())
    return HeadSplit(parts[0], parts[1], hidden)
