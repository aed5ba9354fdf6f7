"""Shapes and shape values of one graph, symbolically: what `passes.shapes` proves its
rewrites with.

Every dimension is a polynomial (`Dim`) over symbols: a graph input's named dimension
(`dim_param`; the ONNX IR makes one name one size across a graph's inputs), or a fresh
symbol for anything this walk cannot follow, which equals nothing but itself. Small
integer tensors (the shape vectors that `Shape`, `Gather`, `Unsqueeze` and `Concat`
compute) are followed element by element, as `Dim`s too. Two `Dim`s that compare equal
are equal at run time, whatever the inputs' sizes; unequal ones may still be.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from engine.model.passes.graph import attribute

Term = tuple[tuple[str, ...], int]  # (sorted symbols of a monomial, coefficient)


class Dim:
    """A polynomial with integer coefficients over symbolic sizes, kept in one normal form
    (so that equal polynomials compare equal)."""

    __slots__ = ("terms",)

    def __init__(self, terms: dict[tuple[str, ...], int]) -> None:
        self.terms: tuple[Term, ...] = tuple(sorted((m, c) for m, c in terms.items() if c))

    @staticmethod
    def of(value: int) -> Dim:
        return Dim({(): int(value)})

    @staticmethod
    def symbol(name: str) -> Dim:
        return Dim({(name,): 1})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Dim) and self.terms == other.terms

    def __hash__(self) -> int:
        return hash(self.terms)

    def __repr__(self) -> str:
        value = self.constant
        return str(value) if value is not None else " + ".join(f"{c}*{m}" for m, c in self.terms)

    @property
    def constant(self) -> int | None:
        """Its value where it has no symbol, else None."""
        if not self.terms:
            return 0
        if len(self.terms) == 1 and not self.terms[0][0]:
            return self.terms[0][1]
        return None

    @property
    def sizes_only(self) -> bool:
        """Whether it is a sum of products of sizes with positive coefficients (so never
        negative at run time)."""
        return all(c > 0 for _, c in self.terms)

    def __add__(self, other: Dim) -> Dim:
        out = dict(self.terms)
        for m, c in other.terms:
            out[m] = out.get(m, 0) + c
        return Dim(out)

    def __neg__(self) -> Dim:
        return Dim({m: -c for m, c in self.terms})

    def __sub__(self, other: Dim) -> Dim:
        return self + -other

    def __mul__(self, other: Dim) -> Dim:
        out: dict[tuple[str, ...], int] = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                m = tuple(sorted(m1 + m2))
                out[m] = out.get(m, 0) + c1 * c2
        return Dim(out)

    def divided(self, other: Dim) -> Dim | None:
        """`self / other` where `other` is one term that divides each of `self`'s exactly,
        else None."""
        if len(other.terms) != 1:
            return None
        (dm, dc) = other.terms[0]
        out: dict[tuple[str, ...], int] = {}
        for m, c in self.terms:
            rest = list(m)
            for s in dm:
                if s not in rest:
                    return None
                rest.remove(s)
            if c % dc:
                return None
            out[tuple(rest)] = c // dc
        return Dim(out)


Shape = tuple[Dim, ...]
BIG = 2**62  # a Slice end at or past this means "to the end"


def product(dims: Sequence[Dim]) -> Dim:
    out = Dim.of(1)
    for d in dims:
        out = out * d
    return out


_SAME_SHAPE = frozenset(
    {
        "Cast", "Softmax", "LogSoftmax", "Relu", "Gelu", "FastGelu", "QuickGelu", "Tanh",
        "Sigmoid", "Sqrt", "Erf", "Neg", "Not", "Identity", "Exp", "Log", "Reciprocal", "Abs",
        "Trilu", "ScatterND", "ScatterElements", "DequantizeLinear", "QuantizeLinear",
        "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
        "Dropout", "IsNaN", "IsInf", "CumSum", "Floor", "Ceil", "Round", "Sign", "Clip",
        "DynamicQuantizeLinear", "Softplus", "HardSigmoid", "LeakyRelu", "Elu", "Selu",
    }
)  # fmt: skip
"""Ops whose first output has their first input's shape."""
_BROADCAST = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Equal", "Greater", "Less", "GreaterOrEqual",
        "LessOrEqual", "And", "Or", "Xor", "Where", "Max", "Min", "Sum", "BitShift",
    }
)  # fmt: skip
_INT_TYPES = frozenset(
    {onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT8, onnx.TensorProto.UINT8}
)
_MAX_VALUES = 64  # longest integer vector followed element by element
_WALKS = count()
ELEMENTWISE = frozenset(
    {
        "Cast", "Relu", "Tanh", "Sigmoid", "Sqrt", "Erf", "Neg", "Not", "Identity", "Exp",
        "Log", "Reciprocal", "Abs", "Floor", "Ceil", "Round", "Sign", "IsNaN", "IsInf",
        "Add", "Sub", "Mul", "Div", "Pow", "Equal", "Greater", "Less", "GreaterOrEqual",
        "LessOrEqual", "And", "Or", "Xor", "Where", "Max", "Min",
    }
)  # fmt: skip
"""Ops each of whose output elements is a function of the input elements at its own
(broadcast) index alone: they commute with broadcasting."""


class Shapes:
    """Symbolic shapes (`shape`) and small integer values (`value`) of a graph's tensors,
    from one walk over its nodes in order (a sorted graph, as ONNX requires)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self._fresh = count()
        self._walk = next(_WALKS)  # fresh symbols of two walks never compare equal
        self.shapes: dict[str, Shape] = {}
        self.values: dict[str, tuple[Dim, ...]] = {}  # flattened; the shape says the layout
        for value in graph.input:
            tensor = value.type.tensor_type
            if tensor.HasField("shape"):
                self.shapes[value.name] = tuple(self._input_dim(d) for d in tensor.shape.dim)
        for init in graph.initializer:  # weights by their dims: never converted
            dims = tuple(int(d) for d in init.dims)
            if init.data_type in _INT_TYPES and int(np.prod(dims)) <= _MAX_VALUES:
                self._constant(init.name, numpy_helper.to_array(init))
            else:
                self.shapes[init.name] = tuple(Dim.of(d) for d in dims)
        for node in graph.node:
            self._visit(node)

    def new(self) -> Dim:
        """A symbol equal to nothing else."""
        return Dim.symbol(f"?{self._walk}.{next(self._fresh)}")

    def _input_dim(self, dim: onnx.TensorShapeProto.Dimension) -> Dim:
        if dim.HasField("dim_value"):
            return Dim.of(dim.dim_value)
        if dim.HasField("dim_param") and dim.dim_param:
            return Dim.symbol(dim.dim_param)
        return self.new()

    def shape(self, name: str) -> Shape | None:
        return self.shapes.get(name)

    def value(self, name: str) -> tuple[Dim, ...] | None:
        return self.values.get(name)

    def ints(self, name: str) -> list[int] | None:
        """A value whose elements are all known numbers."""
        value = self.values.get(name)
        if value is None:
            return None
        out = [d.constant for d in value]
        return None if any(v is None for v in out) else [int(v) for v in out if v is not None]

    def _constant(self, name: str, array: Any) -> None:
        array = np.asarray(array)
        self.shapes[name] = tuple(Dim.of(d) for d in array.shape)
        if array.size <= _MAX_VALUES and array.ndim <= 1 and array.dtype.kind in "iub":
            self.values[name] = tuple(Dim.of(int(v)) for v in array.reshape(-1))

    def _set(self, name: str, shape: Shape | None, value: Sequence[Dim] | None = None) -> None:
        if shape is not None:
            self.shapes[name] = shape
        if value is not None and len(value) <= _MAX_VALUES:
            self.values[name] = tuple(value)

    def _visit(self, node: onnx.NodeProto) -> None:
        op = node.op_type
        if node.domain not in ("", "ai.onnx", "com.microsoft"):
            return
        ins = list(node.input)
        shapes = [self.shapes.get(i) if i else None for i in ins]
        out = node.output[0] if node.output else ""
        if op == "Constant":
            value = attribute(node, "value")
            if value is not None:
                dims = tuple(int(d) for d in value.dims)
                if value.data_type in _INT_TYPES and int(np.prod(dims)) <= _MAX_VALUES:
                    self._constant(out, numpy_helper.to_array(value))
                else:
                    self.shapes[out] = tuple(Dim.of(d) for d in dims)
            else:
                for key in ("value_int", "value_ints"):
                    got = attribute(node, key)
                    if got is not None:
                        self._constant(out, np.asarray(got, dtype=np.int64))
            return
        if op in _SAME_SHAPE:
            self._set(out, shapes[0] if shapes else None, self._same_value(node))
            if op == "DynamicQuantizeLinear" and len(node.output) == 3:
                self._set(node.output[1], ())
                self._set(node.output[2], ())
            return
        if op in _BROADCAST:
            self._broadcast(node, shapes)
            return
        handler = getattr(self, f"_op_{op}", None)
        if handler is not None:
            handler(node, shapes)

    # -- values --------------------------------------------------------------------------

    def _same_value(self, node: onnx.NodeProto) -> tuple[Dim, ...] | None:
        if node.op_type in ("Cast", "Identity"):
            to = attribute(node, "to")
            if to is None or to in _INT_TYPES or to == onnx.TensorProto.FLOAT:
                return self.values.get(node.input[0])
        return None

    def _elementwise(self, node: onnx.NodeProto, shape: Shape | None) -> tuple[Dim, ...] | None:
        args = [self.values.get(i) for i in node.input]
        if shape is None or len(shape) > 1 or any(a is None for a in args):
            return None
        n = 1 if not shape else shape[0].constant
        if n is None:
            return None
        full = [a if len(a) == n else a * n for a in args if a is not None and len(a) in (1, n)]
        if len(full) != len(args):
            return None
        op = node.op_type
        out: list[Dim] = []
        for items in zip(*full, strict=True):
            result = _combine(op, items)
            if result is None:
                return None
            out.append(result)
        return tuple(out)

    # -- shapes --------------------------------------------------------------------------

    def _broadcast(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        if any(s is None for s in shapes):
            return
        rank = max(len(s) for s in shapes if s is not None)
        padded = [(Dim.of(1),) * (rank - len(s)) + s for s in shapes if s is not None]
        shape = tuple(self.broadcast_dims([s[i] for s in padded]) for i in range(rank))
        self._set(node.output[0], shape, self._elementwise(node, shape))

    def broadcast_dims(self, dims: Sequence[Dim]) -> Dim:
        """The size that broadcasting `dims` together gives (a fresh symbol where it
        depends on which of them are 1 at run time)."""
        one = Dim.of(1)
        rest = [d for d in dims if d != one]
        if not rest:
            return one
        if all(d == rest[0] for d in rest):
            return rest[0]
        numbers = {d.constant for d in rest if d.constant is not None}
        return Dim.of(numbers.pop()) if len(numbers) == 1 else self.new()

    def _op_MatMul(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        a, b = shapes[0], shapes[1]
        if a is None or b is None or len(a) < 2 or len(b) < 2:
            return
        batch_a, batch_b = a[:-2], b[:-2]
        rank = max(len(batch_a), len(batch_b))
        batch_a = (Dim.of(1),) * (rank - len(batch_a)) + batch_a
        batch_b = (Dim.of(1),) * (rank - len(batch_b)) + batch_b
        batch = tuple(self.broadcast_dims([x, y]) for x, y in zip(batch_a, batch_b, strict=True))
        self._set(node.output[0], (*batch, a[-2], b[-1]))

    _op_MatMulInteger = _op_MatMul

    def _op_Transpose(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        shape = shapes[0]
        if shape is None:
            return
        perm = attribute(node, "perm") or list(reversed(range(len(shape))))
        self._set(node.output[0], tuple(shape[p] for p in perm))

    def _op_Shape(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        shape = shapes[0]
        if shape is None:
            return
        start, end = attribute(node, "start", 0), attribute(node, "end", len(shape))
        dims = shape[slice(start, end)]
        self._set(node.output[0], (Dim.of(len(dims)),), dims)

    def _op_Size(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        if shapes[0] is not None:
            self._set(node.output[0], (), (product(shapes[0]),))

    def _axes(self, node: onnx.NodeProto) -> list[int] | None:
        if len(node.input) > 1 and node.input[1]:
            return self.ints(node.input[1])
        axes = attribute(node, "axes")
        return None if axes is None else list(axes)

    def _op_Unsqueeze(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        shape, axes = shapes[0], self._axes(node)
        if shape is None or axes is None:
            return
        rank = len(shape) + len(axes)
        where = sorted(a % rank for a in axes)
        dims = list(shape)
        for a in where:
            dims.insert(a, Dim.of(1))
        self._set(node.output[0], tuple(dims), self.values.get(node.input[0]))

    def _op_Squeeze(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        shape, axes = shapes[0], self._axes(node)
        if shape is None:
            return
        if axes is None:
            if len(node.input) > 1 and node.input[1]:
                return
            axes = [i for i, d in enumerate(shape) if d == Dim.of(1)]
        drop = {a % max(len(shape), 1) for a in axes}
        dims = tuple(d for i, d in enumerate(shape) if i not in drop)
        self._set(node.output[0], dims, self.values.get(node.input[0]))

    def _op_Concat(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        if any(s is None for s in shapes) or not shapes:
            return
        known = [s for s in shapes if s is not None]
        rank = len(known[0])
        if rank == 0 or any(len(s) != rank for s in known):
            return
        axis = attribute(node, "axis", 0) % rank
        dims = list(known[0])
        dims[axis] = Dim.of(0)
        for s in known:
            dims[axis] = dims[axis] + s[axis]
        for i in range(rank):
            if i != axis:  # equal in every part of a valid Concat: the best known of them
                dims[i] = min((s[i] for s in known), key=lambda d: "?" in repr(d))
        value = None
        if rank == 1:
            parts = [self.values.get(i) for i in node.input]
            if all(p is not None for p in parts):
                value = tuple(d for p in parts if p is not None for d in p)
        self._set(node.output[0], tuple(dims), value)

    def _op_Gather(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        data, indices = shapes[0], shapes[1]
        if data is None or indices is None or not data:
            return
        axis = attribute(node, "axis", 0) % len(data)
        dims = (*data[:axis], *indices, *data[axis + 1 :])
        value = None
        source, picks = self.values.get(node.input[0]), self.ints(node.input[1])
        if len(data) == 1 and source is not None and picks is not None:
            n = len(source)
            if all(-n <= p < n for p in picks):
                value = tuple(source[p] for p in picks)
        self._set(node.output[0], dims, value)

    def _op_Slice(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        shape = shapes[0]
        if shape is None:
            return
        plan = self.slice_plan(node)
        if plan is None:
            self._set(node.output[0], tuple(self.new() for _ in shape))
            return
        dims = list(shape)
        for axis, start, end, step in plan:
            dims[axis] = self._sliced(shape[axis], start, end, step)
        value = None
        source = self.values.get(node.input[0])
        if len(shape) == 1 and source is not None and plan:
            _, start, end, step = plan[0]
            s, e = start.constant, end.constant
            if s is not None and e is not None:
                value = source[slice(s, e, step)]
        self._set(node.output[0], tuple(dims), value)

    def slice_plan(self, node: onnx.NodeProto) -> list[tuple[int, Dim, Dim, int]] | None:
        """(axis, start, end, step) per sliced axis, with `Dim` bounds, or None."""
        shape = self.shapes.get(node.input[0])
        if shape is None or len(node.input) < 3:
            return None
        starts, ends = self.values.get(node.input[1]), self.values.get(node.input[2])
        axes = self.ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        steps = self.ints(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if starts is None or ends is None or len(starts) != len(ends):
            return None
        if axes is None:
            if len(node.input) > 3 and node.input[3]:
                return None
            axes = list(range(len(starts)))
        steps = steps or [1] * len(starts)
        if len(axes) != len(starts) or len(steps) != len(starts):
            return None
        rank = len(shape)
        return [(a % rank, s, e, st) for a, s, e, st in zip(axes, starts, ends, steps, strict=True)]

    def _sliced(self, dim: Dim, start: Dim, end: Dim, step: int) -> Dim:
        if step != 1:
            return self.new()
        s, e = start.constant, end.constant
        if s == 0 and ((e is not None and e >= BIG) or end == dim):
            return dim
        n = dim.constant
        if n is not None and s is not None and e is not None:
            return Dim.of(len(range(n)[slice(s, e)]))
        return self.new()  # e.g. min(end, dim): which one is not known

    def _op_Reshape(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        target = self.values.get(node.input[1])
        if target is None:
            return
        shape = self.reshaped(shapes[0], target, bool(attribute(node, "allowzero", 0)))
        value = self.values.get(node.input[0])
        if shape is not None:
            self._set(node.output[0], shape, value if len(shape) <= 1 else None)

    def reshaped(
        self, shape: Shape | None, target: Sequence[Dim], allowzero: bool = False
    ) -> Shape | None:
        """The output shape of a Reshape of `shape` to `target` (a fresh symbol for a -1
        this cannot divide out)."""
        out: list[Dim | None] = []
        for i, t in enumerate(target):
            c = t.constant
            if c == 0 and not allowzero:
                if shape is None or i >= len(shape):
                    return None
                out.append(shape[i])
            elif c == -1:
                out.append(None)
            elif c is not None and c < 0:
                return None
            else:
                out.append(t)
        if out.count(None) > 1:
            return None
        if None in out:
            known = [d for d in out if d is not None]
            inferred = None if shape is None else product(shape).divided(product(known))
            out[out.index(None)] = inferred if inferred is not None else self.new()
        return tuple(d for d in out if d is not None)

    def _op_Expand(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        shape, target = shapes[0], self.values.get(node.input[1])
        if shape is None or target is None:
            return
        rank = max(len(shape), len(target))
        a = (Dim.of(1),) * (rank - len(shape)) + shape
        b = (Dim.of(1),) * (rank - len(target)) + tuple(target)
        self._set(
            node.output[0], tuple(self.broadcast_dims([x, y]) for x, y in zip(a, b, strict=True))
        )

    def _op_ConstantOfShape(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        dims = self.values.get(node.input[0])
        if dims is None:
            return
        value = attribute(node, "value")
        fill = 0.0 if value is None else numpy_helper.to_array(value).reshape(-1)[0]
        filled = None
        n = product(dims).constant
        if len(dims) == 1 and n is not None and float(fill).is_integer():
            filled = (Dim.of(int(fill)),) * n
        self._set(node.output[0], tuple(dims), filled)

    def _op_Range(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        start, limit, delta = (self.values.get(i) for i in node.input)
        if start and limit and delta and delta[0].constant == 1:
            length = limit[0] - start[0]
            values = None
            s, e = start[0].constant, limit[0].constant
            if s is not None and e is not None:
                values = tuple(Dim.of(v) for v in range(s, e))
            self._set(node.output[0], (length,), values)
            return
        self._set(node.output[0], (self.new(),))

    def _op_Flatten(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        shape = shapes[0]
        if shape is None:
            return
        axis = attribute(node, "axis", 1) % (len(shape) + 1)
        self._set(node.output[0], (product(shape[:axis]), product(shape[axis:])))

    def _op_GroupQueryAttention(self, node: onnx.NodeProto, shapes: list[Shape | None]) -> None:
        if shapes[0] is not None:
            self._set(node.output[0], shapes[0])


def _combine(op: str, items: Sequence[Dim]) -> Dim | None:
    """One element of an integer op over shape values, or None where it is not exact."""
    if op == "Add":
        return items[0] + items[1]
    if op == "Sub":
        return items[0] - items[1]
    if op == "Mul":
        return items[0] * items[1]
    if op == "Div":
        return items[0].divided(items[1])
    if op == "Where":
        cond = items[0].constant
        return None if cond is None else items[1] if cond else items[2]
    if op == "Equal":
        a, b = items
        if a == b:
            return Dim.of(1)
        ca, cb = a.constant, b.constant
        if ca is not None and cb is not None:
            return Dim.of(int(ca == cb))
        # A size (a dimension, a product of them) is never negative.
        if (ca is not None and ca < 0 and b.sizes_only) or (
            cb is not None and cb < 0 and a.sizes_only
        ):
            return Dim.of(0)
        return None
    if op in ("Max", "Min"):
        ca, cb = items[0].constant, items[1].constant
        if ca is not None and cb is not None:
            return Dim.of(max(ca, cb) if op == "Max" else min(ca, cb))
        return items[0] if items[0] == items[1] else None
    return None
