"""Shape plumbing folded: the Optimum export computes every `Reshape` target, `Expand`
shape and mask `Slice` bound at run time from `Shape -> Gather -> Unsqueeze -> Concat`
chains; `fold_shapes` replaces each one it can prove with a constant, and what is left
unread goes.

Why: at one row a call costs what its graph's nodes cost, about 0.7 us a node on this CPU
whatever the node computes (docs/performance.md), and ONNX Runtime folds none of these
chains (their sizes are not known before the call). A third of the decoder's nodes after
ONNX Runtime's own optimisation were such plumbing.

What is proved (`passes.symbolic`): a target element that is a number stays; one that
equals the same axis of the Reshape's input becomes 0 (ONNX: copy that dimension; never
with `allowzero`); the export's own -1 stays; a target with anything else is left as it
is. An `Expand` whose shape is its input's own (or 1 where the input has that size)
becomes `Identity`, as does a `Slice` from 0 to its input's own size, and an `Expand`
whose result reaches only elementwise ops until the shapes are what they were (the
attention mask broadcast to the scores' shape, which the `Add` into the scores broadcasts
anyway: `_drop_expands`); ONNX Runtime removes identities. A target left whose elements
are numbers and sizes that the ids or the source mask name is read from those inputs once,
at the head of the graph (`_from_inputs`: `passes.per_token`'s). The outputs are the graph's
own for every input shape that the graph accepts, and the loader compares them on a probe
anyway (`engine.model.checks`). Where the shapes are known ONNX Runtime may fuse more
(`Add` + `LayerNormalization` into `SkipLayerNormalization`), which rounds differently:
about 1e-6 of a logit in fp32, too much in fp16 (`RuntimeOptions.folds`).

A graph with subgraphs (the merged decoder's `If`), or one where nothing folds, gives
None and a logged reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from itertools import count

import numpy as np
import onnx
from onnx import helper, numpy_helper

from engine.model.names import ATTENTION_MASK, ENCODER_ATTENTION_MASK, INPUT_IDS, LOGITS
from engine.model.passes.graph import GraphView, live_nodes, load_model, reads
from engine.model.passes.head import projection_input
from engine.model.passes.symbolic import BIG, ELEMENTWISE, Dim, Shape, Shapes

log = logging.getLogger(__name__)

_PREFIX = "folded_shape"  # the new tensors' names start with this, and a run's number
_SIZE_INPUTS = (INPUT_IDS, ENCODER_ATTENTION_MASK, ATTENTION_MASK)
"""The inputs whose sizes `_from_inputs` reads."""
Constant = Callable[[Sequence[int]], str]
"""Makes an int64 initializer of the values given and returns its name."""


class _Unsupported(Exception):
    """The graph is not of a shape this pass knows (message says why)."""


def fold_shapes(
    source: bytes | onnx.ModelProto, name: str, *, in_place: bool = False
) -> onnx.ModelProto | None:
    """`source` with its provable shape computations constant (module docstring), or None
    (logged with the reason, under `name`) where the graph has subgraphs or nothing to
    fold. A `ModelProto` given is copied first, unless `in_place` (a caller that owns it
    saves a copy of the weights; it is left as it was where the result is None)."""
    model = source if in_place and isinstance(source, onnx.ModelProto) else load_model(source)
    try:
        before, after = _fold(model)
    except _Unsupported as exc:
        log.info("%s: shape computations kept (%s)", name, exc)
        return None
    log.info("%s: shape computations folded: %d nodes -> %d", name, before, after)
    return model


def _fold(model: onnx.ModelProto) -> tuple[int, int]:
    graph = model.graph
    if any(a.type in (a.GRAPH, a.GRAPHS) for n in graph.node for a in n.attribute):
        raise _Unsupported("a graph with subgraphs")
    shapes = Shapes(graph)
    constants = {i.name for i in graph.initializer}
    constants |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    names = constants | {o for n in graph.node for o in n.output}
    run = next(k for k in count() if not any(n.startswith(f"{_PREFIX}{k}/") for n in names))
    prefix = f"{_PREFIX}{run}"  # a graph folded again (after `passes.per_token`) gets its own
    folded = 0
    added: list[onnx.TensorProto] = []

    def constant(values: Sequence[int]) -> str:
        tensor = numpy_helper.from_array(
            np.asarray(values, dtype=np.int64), f"{prefix}/{len(added)}"
        )
        added.append(tensor)
        return tensor.name

    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Reshape" and node.input[1] not in constants:
            target = _reshape_target(shapes, node)
            if target is not None:
                node.input[1] = constant(target)
                folded += 1
        elif node.op_type == "Expand" and node.input[1] not in constants:
            folded += _fold_expand(shapes, node, constant)
        elif node.op_type == "Slice" and any(i not in constants for i in node.input[1:3]):
            folded += _fold_slice(shapes, node)
    folded += _from_inputs(graph, shapes, constants, constant, prefix)
    graph.initializer.extend(added)  # before the second walks, which read them
    folded += _drop_expands(graph, shapes)
    if not folded:
        raise _Unsupported("no shape computation it can prove")
    before = len(graph.node)
    kept = live_nodes(list(graph.node), {o.name for o in graph.output})
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in graph.node for name in reads(node)}
    initializers = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    return before, len(graph.node)


def _from_inputs(
    graph: onnx.GraphProto, shapes: Shapes, constants: set[str], constant: Constant, prefix: str
) -> int:
    """Each `Reshape` target still computed whose elements are numbers and sizes the
    graph's inputs name (`dim_param`: batch, tokens) read from those inputs instead: one
    `Shape` per input, one `Gather` per size, one `Concat` per distinct target, at the
    head of the graph; how many.

    Why: `passes.per_token` reshapes each flat [B * T, N] result back to [B, T, N] with a
    target read from its own input's shape (two nodes each, about 30 per graph), which no
    0 or -1 can name; the targets are the same few vectors."""
    sources: dict[str, tuple[str, int]] = {}
    inputs = {value.name: value for value in graph.input}
    # The ids and the source mask only, in that order: they have a row each and their
    # length; KV buffers may be longer than their sizes say (in place, KV slots).
    for value in (inputs[n] for n in _SIZE_INPUTS if n in inputs):
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_param") and dim.dim_param:
                sources.setdefault(dim.dim_param, (value.name, axis))
    head: list[onnx.NodeProto] = []
    sizes: dict[str, str] = {}
    made: dict[tuple[Dim, ...], str] = {}
    projection = _projection_nodes(graph)

    def size(symbol: str) -> str:
        if symbol not in sizes:
            value, axis = sources[symbol]
            shape = f"{prefix}/shape_of/{value}"
            if not any(node.output[0] == shape for node in head):
                head.append(helper.make_node("Shape", [value], [shape], name=shape))
            sizes[symbol] = f"{prefix}/size/{symbol}"
            indices = constant([axis])
            head.append(helper.make_node("Gather", [shape, indices], [sizes[symbol]], axis=0))
        return sizes[symbol]

    def readable(element: Dim) -> bool:
        if element.constant is not None:
            return element.constant > 0 or element.constant == -1
        return (
            len(element.terms) == 1
            and element.terms[0][1] == 1
            and len(element.terms[0][0]) == 1
            and element.terms[0][0][0] in sources
        )

    rewired = 0
    for node in graph.node:
        if node.op_type != "Reshape" or node.input[1] in constants or node.domain:
            continue
        if node.output[0] in projection:
            continue  # the projection reads nothing but its hidden state (`passes.head`)
        if node.input[1].startswith(_PREFIX):
            continue  # folded above, or by an earlier run
        target = shapes.value(node.input[1])
        if target is None or not target or not all(readable(e) for e in target):
            continue
        key = tuple(target)
        if key not in made:
            parts: list[str] = []
            numbers: list[int] = []
            for element in target:
                if element.constant is not None:
                    numbers.append(element.constant)
                    continue
                if numbers:
                    parts.append(constant(numbers))
                    numbers = []
                parts.append(size(element.terms[0][0][0]))
            if numbers:
                parts.append(constant(numbers))
            made[key] = f"{prefix}/target/{len(made)}"
            head.append(helper.make_node("Concat", parts, [made[key]], axis=0))
        node.input[1] = made[key]
        rewired += 1
    nodes = [*head, *graph.node]  # reading graph inputs and constants only: first
    del graph.node[:]
    graph.node.extend(nodes)
    return rewired


def _projection_nodes(graph: onnx.GraphProto) -> set[str]:
    """The outputs of the nodes between a decoder's hidden state and its logits (what
    `passes.head` cuts off, which must read the hidden state alone), or of every node
    where the graph has logits but no projection that cut finds."""
    logits = next((o for o in graph.output if o.name == LOGITS), None)
    if logits is None:
        return set()
    dims = logits.type.tensor_type.shape.dim
    view = GraphView(graph, {})
    hidden = None
    if dims and dims[-1].HasField("dim_value"):
        hidden = projection_input(view, int(dims[-1].dim_value))
    if hidden is None:
        return {out for node in graph.node for out in node.output}
    nodes, _ = view.ancestry(LOGITS, leaves_at=frozenset({hidden}))
    return {out for node in nodes for out in node.output}


def _reshape_target(shapes: Shapes, node: onnx.NodeProto) -> list[int] | None:
    """A constant target equal to `node`'s computed one for every input it accepts, or
    None."""
    source, target = shapes.shape(node.input[0]), shapes.value(node.input[1])
    allowzero = any(a.name == "allowzero" and a.i for a in node.attribute)
    if source is None or target is None:
        return None
    out: list[int] = []
    for axis, element in enumerate(target):
        number = element.constant
        if number is not None and (number > 0 or number == -1):
            out.append(number)
        elif number == 0 and not allowzero:
            out.append(0)  # the export's own copy of that dimension
        elif not allowzero and axis < len(source) and source[axis] == element:
            out.append(0)
        else:
            return None
    return out if out.count(-1) <= 1 else None


def _fold_expand(shapes: Shapes, node: onnx.NodeProto, constant: Constant) -> int:
    """`Identity` where the Expand keeps its input's shape, else a constant shape where
    every element is known; 1 where folded, else 0."""
    source, target = shapes.shape(node.input[0]), shapes.value(node.input[1])
    if source is None or target is None or len(target) > len(source):
        return _expand_constant(target, source, node, constant)
    one = Dim.of(1)
    tail = source[len(source) - len(target) :]
    if all(t in (one, s) for t, s in zip(target, tail, strict=True)):
        _to_identity(node)
        return 1
    return _expand_constant(target, source, node, constant)


def _expand_constant(
    target: Sequence[Dim] | None, source: Shape | None, node: onnx.NodeProto, constant: Constant
) -> int:
    """A constant shape for the Expand where each element is a number or its input's own
    size on that axis (then 1); 1 where folded, else 0."""
    if target is None:
        return 0
    rank = max(len(target), len(source)) if source is not None else len(target)
    padded: tuple[Dim | None, ...] | None = None
    if source is not None:
        padded = (None,) * (rank - len(source)) + tuple(source)
    out: list[int] = []
    for i, element in enumerate((Dim.of(1),) * (rank - len(target)) + tuple(target)):
        number = element.constant
        mine = None if padded is None else padded[i]
        if number is not None and number >= 0:
            out.append(number)
        elif mine is not None and mine == element:
            out.append(1)
        else:
            return 0
    out = out[rank - len(target) :]
    node.input[1] = constant(out)
    return 1


def _fold_slice(shapes: Shapes, node: onnx.NodeProto) -> int:
    """`Identity` where the Slice takes every element of each axis it slices; 1 where
    folded, else 0."""
    source, plan = shapes.shape(node.input[0]), shapes.slice_plan(node)
    if source is None or plan is None:
        return 0
    for axis, start, end, step in plan:
        whole = end == source[axis] or (end.constant is not None and end.constant >= BIG)
        if step != 1 or start.constant != 0 or not whole:
            return 0
    _to_identity(node)
    return 1


def _drop_expands(graph: onnx.GraphProto, shapes: Shapes) -> int:
    """Each `Expand` whose result reaches nothing but elementwise ops until the shapes
    are those it gave (a mask broadcast to the scores' shape before the `Add` that would
    broadcast it anyway) as `Identity`; how many.

    Why equal: elementwise ops commute with broadcasting, so without the Expand every
    tensor downstream holds the same values broadcast less, and one whose shape is
    unchanged (proved on a second walk of the graph) holds the same values."""
    dropped = 0
    outputs = {o.name for o in graph.output}
    for node in list(graph.node):
        if node.op_type != "Expand" or node.domain not in ("", "ai.onnx"):
            continue
        kept = onnx.NodeProto()
        kept.CopyFrom(node)
        _to_identity(node)
        after = Shapes(graph)
        if _broadcast_away(graph, node.output[0], shapes, after, outputs):
            dropped += 1
            shapes = after
        else:
            node.CopyFrom(kept)
    return dropped


def _broadcast_away(
    graph: onnx.GraphProto, start: str, before: Shapes, after: Shapes, outputs: set[str]
) -> bool:
    """Whether every tensor downstream of `start` either has the same known shape in both
    walks or is read by elementwise ops only (and is no graph output)."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for user in graph.node:
        for name in user.input:
            consumers.setdefault(name, []).append(user)
    todo, seen = [start], {start}
    while todo:
        name = todo.pop()
        shape = after.shape(name)
        if shape is not None and shape == before.shape(name):
            continue  # the same values from here on
        users = consumers.get(name, [])
        if name in outputs or any(user.op_type not in ELEMENTWISE for user in users):
            return False
        for user in users:
            for out in user.output:
                if out not in seen:
                    seen.add(out)
                    todo.append(out)
    return True


def _to_identity(node: onnx.NodeProto) -> None:
    """`node` as `Identity` of its first input (same name and output)."""
    keep = node.input[0]
    replacement = helper.make_node("Identity", [keep], list(node.output), name=node.name)
    node.CopyFrom(replacement)
