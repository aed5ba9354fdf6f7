"""Logits of the batchable decoder's calls: a rewritten graph whole or cut at its output
projection (`CutGraph`), and the logits of a prefill packed by row and projected as the
searches read them (`RowLogits`).

The projection is most of a position's cost (docs/performance.md, memory under load):
positions no search reads are never projected, and the rest are projected
`HEAD_POSITIONS` at a time into one buffer per thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from engine.model.layouts import FloatArray, IntArray
from engine.model.names import LOGITS


class CutGraph(NamedTuple):
    """One rewritten decoder graph (no-past or with-past) as the scheduler runs it: whole
    (`session`, `head` None), or its body (`session`) with the output projection apart
    (`head`: the projection's session and the input it takes, `passes.head`), and the
    projection on every core (`alone`, the same kind) for a lane that runs alone."""

    session: ort.InferenceSession
    head: tuple[ort.InferenceSession, str] | None
    alone: tuple[ort.InferenceSession, str] | None = None


HEAD_POSITIONS = 32
"""Positions per call of an output projection run apart (`CutGraph.head`). Its int32
products and float logits are positions x vocabulary, and ONNX Runtime's arena keeps the
largest block it ever served for the session's life, so one call over a long prefill
left that block held for good; bounded calls cost no more than one call over everything
and each writes straight into its buffer (I/O binding), with no copy (figures:
docs/performance.md, memory under load)."""


class _Logits(Protocol):
    """Where a `RowLogits`' packed positions come from."""

    def position(self, index: int) -> FloatArray:
        """Packed position `index`'s logits [V]; valid until the next read on this thread."""
        ...

    def all(self) -> FloatArray:
        """Every packed position [K, V], in an array of its own (not a thread's buffer)."""
        ...


@dataclass(frozen=True)
class _Computed:
    """Logits computed in the call: [K, V]."""

    values: FloatArray

    def position(self, index: int) -> FloatArray:
        row: FloatArray = self.values[index]
        return row

    def all(self) -> FloatArray:
        return self.values


_chunks = threading.local()  # per thread: `held` (owner, chunk, logits) and `buffers`


HEADS_KEPT = 4
"""Projection sessions a thread keeps a binding of (`_head_binding`): a lane's head and
its head on every core; a thread that ran more models' (tests, a process of several
targets on one thread) keeps only the latest few."""


def _head_binding(
    session: ort.InferenceSession, out: FloatArray, vocab: int, owner: FloatArray | None
) -> ort.IOBinding:
    """This thread's I/O binding of a projection `session`, its logits bound to `out`, the
    first rows of `owner` (bound again only when `owner` or the rows are not the last
    call's: a thread projects into its one buffer, `_Projected`; an `out` of no such
    buffer, None, is bound every time). Why: a new binding and its output bound at every
    chunk cost about as much as a one-position projection's own Python."""
    bindings: dict[int, tuple[ort.IOBinding, object, int]] = getattr(_chunks, "bindings", {})
    _chunks.bindings = bindings
    kept = bindings.get(id(session))
    if kept is not None and owner is not None and kept[1] is owner and kept[2] == len(out):
        return kept[0]
    if kept is None and len(bindings) >= HEADS_KEPT:
        bindings.clear()  # a binding holds its session: not every model's a thread ran
    binding = kept[0] if kept is not None else session.io_binding()
    binding.bind_output(LOGITS, "cpu", 0, out.dtype, [1, len(out), vocab], out.ctypes.data)
    # The owner is held with the binding: its memory cannot go while the binding names it.
    bindings[id(session)] = (binding, owner, len(out))
    return binding


class _Projected:
    """Logits of hidden states `picked` [K, d], projected `HEAD_POSITIONS` at a time when a
    position of the chunk is first read, into one buffer per thread.

    Why: a prefill's searches read each row's positions in order and stop at the first
    draft token the model does not confirm. Projected all at once, the positions of every
    row took a fresh [K, V] array per prefill, on pages the kernel must fault in and zero,
    held until the last row was read, on each lane at once; and the chunks past every
    row's first mismatch were projected for nothing (docs/performance.md)."""

    def __init__(
        self, head: tuple[ort.InferenceSession, str], vocab: int, dtype: Any, picked: FloatArray
    ) -> None:
        self._session, self._input = head
        self._picked = picked
        self._chunk = HEAD_POSITIONS
        self._vocab, self._dtype = vocab, dtype
        self._values: FloatArray | None = None
        # What the thread's buffer says it holds (not `self`: the buffer would keep it alive)
        self._token = object()

    def _into(self, begin: int, out: FloatArray, owner: FloatArray | None = None) -> None:
        """Project packed positions [begin, begin + len(out)) into `out` (contiguous; the
        first rows of `owner`, the thread's buffer, where it is one), through this
        thread's binding of the head (`_head_binding`)."""
        binding = _head_binding(self._session, out, self._vocab, owner)
        picked = np.ascontiguousarray(self._picked[None, begin : begin + len(out)])
        binding.bind_cpu_input(self._input, picked)
        self._session.run_with_iobinding(binding)

    def position(self, index: int) -> FloatArray:
        if self._values is not None:
            row: FloatArray = self._values[index]
            return row
        chunk = index // self._chunk
        held: tuple[object, int, FloatArray] | None = getattr(_chunks, "held", None)
        if held is None or held[0] is not self._token or held[1] != chunk:
            key = (self._chunk, self._vocab, self._dtype)
            buffers: dict[tuple[int, int, Any], FloatArray] = getattr(_chunks, "buffers", {})
            _chunks.buffers = buffers
            if key not in buffers:
                buffers.clear()  # one buffer per thread: the newest head's shape
                buffers[key] = np.empty((self._chunk, self._vocab), dtype=self._dtype)
            begin = chunk * self._chunk
            buffer = buffers[key]
            out = buffer[: min(self._chunk, len(self._picked) - begin)]
            self._into(begin, out, buffer)
            held = _chunks.held = (self._token, chunk, out)
        row = held[2][index - chunk * self._chunk]
        return row

    def all(self) -> FloatArray:
        if self._values is None:
            values = np.empty((len(self._picked), self._vocab), dtype=self._dtype)
            for begin in range(0, len(values), self._chunk):
                self._into(begin, values[begin : begin + self._chunk])
            self._values = values
        return self._values


class RowRun:
    """One row's logits from a position on: `run[i]` [V] is the i-th (valid until the next
    read on this thread: a search copies what it observes)."""

    def __init__(self, source: _Logits, begin: int, end: int) -> None:
        self._source, self._begin, self._end = source, begin, end

    def __len__(self) -> int:
        return self._end - self._begin

    def __getitem__(self, index: int) -> FloatArray:
        if not 0 <= index < self._end - self._begin:
            raise IndexError(f"position {index} of a run of {self._end - self._begin}")
        return self._source.position(self._begin + index)


@dataclass(frozen=True)
class RowLogits:
    """Logits at a run of consecutive positions of each row, packed: row r's start at its
    position `firsts[r]` and are packed positions `offsets[r]:offsets[r + 1]`.

    Why packed: a prefill reads only each row's draft and the position after it, and
    spreading those over a zeroed [rows, positions, vocab] array cost a copy of every
    logit, a quarter of the projection's time, and as much memory again
    (docs/performance.md). A projection run apart is computed as rows are read
    (`_Projected`)."""

    source: _Logits
    firsts: IntArray
    offsets: IntArray

    @classmethod
    def whole(cls, logits: FloatArray) -> RowLogits:
        """Every position of logits [B, T, V]."""
        batch, length, vocab = logits.shape
        return cls(
            _Computed(logits.reshape(batch * length, vocab)),
            np.zeros(batch, dtype=np.int64),
            np.arange(batch + 1, dtype=np.int64) * length,
        )

    @property
    def values(self) -> FloatArray:
        """Every packed position's logits [K, V] (all projected, once)."""
        return self.source.all()

    def row(self, row: int, start: int) -> RowRun:
        """Row `row`'s logits from its position `start` on."""
        first = int(self.firsts[row])
        begin, end = int(self.offsets[row]), int(self.offsets[row + 1])
        if not first <= start < first + (end - begin):
            raise IndexError(f"row {row}: position {start} was not projected")
        return RowRun(self.source, begin + start - first, end)

    def dense(self, length: int) -> FloatArray:
        """As [B, `length`, V], zeros where nothing was projected (a view when every
        position was)."""
        values = self.values
        batch, vocab = len(self.firsts), values.shape[-1]
        counts = np.diff(self.offsets)
        if not self.firsts.any() and np.all(counts == length):
            return values.reshape(batch, length, vocab)
        logits = np.zeros((batch, length, vocab), dtype=values.dtype)
        for r in range(batch):
            first, begin = int(self.firsts[r]), int(self.offsets[r])
            logits[r, first : first + counts[r]] = values[begin : begin + counts[r]]
        return logits


def project(
    head: tuple[ort.InferenceSession, str], states: FloatArray, wanted: npt.NDArray[np.bool_]
) -> RowLogits:
    """Logits from a cut graph's hidden `states` [B, T, d], computed only at the positions
    `wanted` marks, one run of consecutive positions per row: the output projection is
    most of a position's cost, and padding, lookahead slots past a row's own and a forced
    prefix are never read. In calls of `HEAD_POSITIONS`, as the positions are read."""
    counts = wanted.sum(axis=1)
    firsts = np.argmax(wanted, axis=1)
    last = np.where(counts > 0, wanted.shape[1] - 1 - np.argmax(wanted[:, ::-1], axis=1), -1)
    if np.any(counts != np.where(counts > 0, last - firsts + 1, 0)):
        raise ValueError("the positions to project must be consecutive in each row")
    return project_runs(head, states, firsts.astype(np.int64), counts.astype(np.int64))


def project_runs(
    head: tuple[ort.InferenceSession, str], states: FloatArray, firsts: IntArray, counts: IntArray
) -> RowLogits:
    """`project` of the positions `firsts[r]` to `firsts[r] + counts[r] - 1` of each row r
    (no position where `counts[r]` is 0), given as runs: what a prefill knows from its
    lengths, without the mask's passes to find them."""
    session, hidden = head
    batch = len(firsts)
    if batch == 1:  # a view of the row's run: no copy
        begin, count = int(firsts[0]), max(int(counts[0]), 0)
        picked = states[0, begin : begin + count]  # [K, d]
        offsets = np.array([0, count], dtype=np.int64)
    else:
        rows = zip(firsts.tolist(), counts.tolist(), strict=True)
        picked = np.concatenate([states[r, f : f + max(c, 0)] for r, (f, c) in enumerate(rows)])
        offsets = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(np.maximum(counts, 0), out=offsets[1:])
    output = session.get_outputs()[0]
    vocab = output.shape[-1]
    source: _Logits
    if not isinstance(vocab, int):  # a symbolic vocabulary: one call, its own output
        source = _Computed(session.run([LOGITS], {hidden: picked[None]})[0][0])
    else:
        dtype = np.float16 if output.type == "tensor(float16)" else np.float32
        source = _Projected(head, vocab, dtype, picked)
    return RowLogits(source, firsts, offsets)


def head_logits(
    graph: CutGraph, hidden: FloatArray, real: npt.NDArray[np.bool_], alone: bool
) -> FloatArray:
    """A cut step's logits from its body's `hidden` [B, T, D]: [B, V] for one token per
    row, else [B, T, V] with the positions `real` [B, T] marks projected (the others are
    meaningless); on every core where the lane runs `alone` and the graph has that head."""
    assert graph.head is not None
    projection = graph.alone if alone and graph.alone is not None else graph.head
    if hidden.shape[1] == 1:
        head, head_input = projection
        logits: FloatArray = head.run([LOGITS], {head_input: hidden})[0][:, -1, :]
        return logits
    return project(projection, hidden, real).dense(hidden.shape[1])
