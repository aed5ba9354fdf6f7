"""What the graph passes share: loading a graph from any of its forms, and a view of one
graph's producers, consumers and constants that the structural searches walk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper, numpy_helper

SHAPE_ONLY = frozenset({"Shape", "Size"})
"""Ops that read their input's shape, not its values."""


def load_model(source: Path | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """A model from a file or serialised bytes; a `ModelProto` is copied (passes edit the
    model they get, never the caller's)."""
    if isinstance(source, Path):
        return onnx.load(str(source))
    if isinstance(source, bytes):
        return onnx.load_from_string(source)
    model = onnx.ModelProto()
    model.CopyFrom(source)
    return model


def opset(model: onnx.ModelProto) -> int:
    """The model's default-domain opset (1 when it declares none)."""
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=1)


class GraphView:
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
        self.outputs = {o.name for o in graph.output}

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
            if node.op_type not in SHAPE_ONLY:
                todo.extend(node.input)
        return nodes, leaves


class UnsortableGraph(Exception):
    """A node reads a tensor that nothing makes (message says which)."""


def attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of `node`'s attribute `name` (a `Transpose`'s `perm` as a list of ints,
    an `axis` as an int, ...), or `default` where the node does not set it."""
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def reads(node: onnx.NodeProto) -> list[str]:
    """What a node reads: its inputs, and for a node with subgraphs (`If`) the outer
    values its subgraphs use."""
    names = [name for name in node.input if name]
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            made = {o for n in attr.g.node for o in n.output} | {i.name for i in attr.g.initializer}
            names += [name for n in attr.g.node for name in reads(n) if name not in made]
    return names


def sorted_nodes(nodes: list[onnx.NodeProto], known: set[str]) -> list[onnx.NodeProto]:
    """`nodes` in an order where each comes after the producers of its inputs (those in
    `known` are there from the start); `UnsortableGraph` when one reads a tensor nothing
    makes."""
    made = set(known)
    left = list(nodes)
    out: list[onnx.NodeProto] = []
    while left:
        ready = [n for n in left if all(i in made for i in reads(n))]
        if not ready:
            missing = sorted({i for n in left for i in reads(n) if i not in made})
            raise UnsortableGraph(f"nodes read tensors nothing makes: {missing[:3]}")
        taken = {id(n) for n in ready}
        out.extend(ready)
        made.update(o for n in ready for o in n.output)
        left = [n for n in left if id(n) not in taken]
    return out


def live_nodes(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """The nodes that some graph output depends on (the others' results are unused)."""
    producer = {o: n for n in nodes for o in n.output}
    todo, seen = list(outputs), set(outputs)
    keep: set[int] = set()
    while todo:
        node = producer.get(todo.pop())
        if node is None or id(node) in keep:
            continue
        keep.add(id(node))
        for name in reads(node):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return [n for n in nodes if id(n) in keep]
