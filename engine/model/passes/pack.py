"""Projections of one tensor packed: the `MatMul`s that read the same input with constant
weights, each followed by the `Add` of a constant bias, made one `MatMul` over their
weights side by side, one `Add` and a `Split` into the tensors they made.

Why: a call of the fixture's graphs costs what its nodes cost (about 0.7 us a node back
to back, two to four times that on a lane that slept between turns), and a layer's query,
key and value projections read the same normalised states, as the prefill's six
cross-attention keys and values read the encoder's output: three or six pairs of nodes
become three, and one wider product is cheaper than several narrow ones
(docs/performance.md, issue 54's fifth pass). Each output column is the same dot product
over the same input row, so the values are those of the separate products.

Found by structure: a `MatMul` whose second input is a constant of rank 2 and whose
output only an `Add` with a constant bias of rank 1 reads. Two or more that read one
tensor are packed. Only float weights (the int8 graphs' quantized products are other
ops, left as they are). Where the three are the query, key and value of ONNX Runtime's
`GroupQueryAttention` (the in-place step's self-attention) and nothing else reads them, it
takes them packed: no `Split`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from engine.model.passes.graph import GraphView, opset, sorted_nodes

log = logging.getLogger(__name__)

_PREFIX = "packed_projection"


@dataclass(frozen=True)
class _Projection:
    """One `MatMul` + bias `Add` of a constant weight [K, N] and bias [N]."""

    matmul: onnx.NodeProto
    add: onnx.NodeProto
    weight: np.ndarray
    bias: np.ndarray
    output: str  # what the Add made


def pack_projections(model: onnx.ModelProto, name: str) -> int:
    """Pack `model`'s projections of one input (module docstring) in place; returns how
    many groups were packed (0: the model is unchanged). Raises before changing anything
    where the packed graph cannot be ordered (`UnsortableGraph`)."""
    graph = model.graph
    view = GraphView(graph, {})
    groups: dict[str, list[_Projection]] = {}
    for node in graph.node:
        found = _projection(view, node)
        if found is not None:
            groups.setdefault(node.input[0], []).append(found)
    packed = [g for g in groups.values() if len(g) > 1 and _alike(g)]
    if not packed:
        return 0
    split_as_input = opset(model) >= 13
    gone: set[int] = set()
    rewired: dict[int, onnx.NodeProto] = {}  # attention nodes taking a packed input: copies
    weights_gone: set[str] = set()
    added: list[onnx.NodeProto] = []
    initializers: list[onnx.TensorProto] = []
    for index, group in enumerate(packed):
        source = group[0].matmul.input[0]
        stem = f"{_PREFIX}_{index}"
        weight = np.concatenate([p.weight for p in group], axis=1)
        bias = np.concatenate([p.bias for p in group])
        sizes = np.array([p.weight.shape[1] for p in group], dtype=np.int64)
        initializers += [
            numpy_helper.from_array(weight, f"{stem}_weight"),
            numpy_helper.from_array(bias, f"{stem}_bias"),
        ]
        added.append(helper.make_node("MatMul", [source, f"{stem}_weight"], [f"{stem}_product"]))
        added.append(helper.make_node("Add", [f"{stem}_product", f"{stem}_bias"], [f"{stem}_sum"]))
        outputs = [p.output for p in group]
        for p in group:
            gone.update((id(p.matmul), id(p.add)))
            weights_gone.update(i for i in (*p.matmul.input[1:], *p.add.input) if i)
        attention = _takes_packed(view, outputs)
        if attention is not None:  # GroupQueryAttention reads q, k and v packed: no Split
            copy = onnx.NodeProto()
            copy.CopyFrom(attention)
            copy.input[0], copy.input[1], copy.input[2] = f"{stem}_sum", "", ""
            rewired[id(attention)] = copy
            continue
        if split_as_input:
            initializers.append(numpy_helper.from_array(sizes, f"{stem}_sizes"))
            split = helper.make_node("Split", [f"{stem}_sum", f"{stem}_sizes"], outputs, axis=-1)
        else:
            split = helper.make_node("Split", [f"{stem}_sum"], outputs, axis=-1, split=sizes)
        added.append(split)
    # Nothing of `model` changed so far: a graph that cannot be sorted raises as it was.
    kept = [rewired.get(id(n), n) for n in graph.node if id(n) not in gone]
    still_read = {i for n in kept for i in n.input} | view.outputs
    known = view.inputs | view.initializers.keys() | {i.name for i in initializers}
    nodes = sorted_nodes(kept + added, known)
    unread = [i for i in graph.initializer if i.name in weights_gone and i.name not in still_read]
    for tensor in unread:
        graph.initializer.remove(tensor)
    graph.initializer.extend(initializers)
    del graph.node[:]
    graph.node.extend(nodes)
    log.info(
        "%s: %d projections packed into %d (passes.pack)",
        name,
        sum(len(g) for g in packed),
        len(packed),
    )
    return len(packed)


def _projection(view: GraphView, node: onnx.NodeProto) -> _Projection | None:
    """`node` as the `MatMul` of a projection, with the `Add` of its bias; else None."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    weight = view.constant(node.input[1]) if view.rank(node.input[1]) == 2 else None
    readers = view.consumers.get(node.output[0], [])
    if weight is None or weight.dtype != np.float32 or len(readers) != 1:
        return None
    add = readers[0]
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
        return None
    other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
    if other == node.output[0] or view.rank(other) != 1:
        return None
    bias = view.constant(other)
    if bias is None or bias.dtype != np.float32 or bias.shape != (weight.shape[1],):
        return None
    if node.output[0] in view.outputs:
        return None
    return _Projection(node, add, weight, bias, add.output[0])


def _takes_packed(view: GraphView, outputs: list[str]) -> onnx.NodeProto | None:
    """The `GroupQueryAttention` that alone reads `outputs` as its query, key and value
    (inputs 0, 1 and 2), which it takes packed as one input instead; else None."""
    if len(outputs) != 3 or len(set(outputs)) != 3:
        return None
    readers = [view.consumers.get(o, []) for o in outputs]
    if any(len(r) != 1 for r in readers) or len({id(r[0]) for r in readers}) != 1:
        return None
    node = readers[0][0]
    if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
        return None
    if list(node.input[:3]) != outputs or outputs[0] in view.outputs:
        return None
    return node


def _alike(group: list[_Projection]) -> bool:
    """Whether the group's weights share their first axis (they read one input)."""
    return len({p.weight.shape[0] for p in group}) == 1
