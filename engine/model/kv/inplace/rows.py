"""The KV backend whose self-attention keys and values stay where they were written: one
buffer per layer and kind, `[rows, heads, positions, head_dim]`, that each step reads and
extends in place (`engine.model.kv.inplace.steps.InPlaceSteps`, `engine.model.kv.inplace.rewrite`):
`engine.model.backend.Backend.INPLACE`, the CPU's default.

The copied backend (`engine.model.kv.copied`) hands every row's keys and values to
each step and gets them back one position longer: the graph copies the whole state into
new arrays at every step, and a join pads and copies it again. Here row r of the batch is
row r of the buffers, its positions first and its length its own, so:

- a step writes one position per row and copies nothing (and its rows are not padded to
  the longest: each row's attention reads its own positions);
- a join copies only the newcomers' prefilled positions into the rows after the last;
- a leave moves the rows after it down by their own positions only;
- rows past the most the lane held over the last `RELEASE_AFTER` to twice that give their
  pages back (`release_rows`), so that after a burst the buffers' memory comes down to the
  rows the lane runs, while steady load, whose rows leave and join again every turn,
  keeps them (a join into given-back pages costs it faulting them in again); an idle
  lane's thread wakes when its spans have passed (`quiet_in`) and gives back all but the
  first row (`settle`), so a burst's memory does not wait for the lane's next request;
- the buffers grow (doubling their rows) only when the batch outgrows them, so the state's
  memory is set by the most rows a lane held, not allocated per step.

Cross-attention keys and values, and the encoder mask, are kept the same way: lane buffers
of `[rows, heads, sources, head_dim]` as wide as the longest source a row brought (rounded
up to `SOURCE_STEP`), each row's source right-padded with mask 0, which attention ignores
exactly. A join writes the newcomers' rows once; the state is not stacked again at every
join, nor copied to be bound (the step binds views of the buffers' first rows).
Re-aligned drafts are verified in a step (lookahead) for a lone row only:
`GroupQueryAttention` refuses several new tokens per row for several rows, and a lone row
is where a saved step is worth the most (`LOOKAHEAD_POSITIONS`). A rejected token's
position is simply written again. Rows equal decoding alone over the same graphs: each
row's attention reads its own positions only.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.model.kv.arrays import position_bytes, source_width, spanned
from engine.model.kv.base import (
    KvBackend,
    Newcomer,
    Output,
    Owner,
    Prefill,
    StateBytes,
    masked_prefill,
)
from engine.model.kv.inplace.steps import InPlaceBinding, InPlaceSteps
from engine.model.layouts import EncoderOutput, FloatArray, IntArray
from engine.model.marian import MarianOnnx
from engine.model.masked import MaskedDecoder

INITIAL_ROWS = 4
"""Rows of a lane's first buffers; they double when the batch outgrows them."""


def mapped_zeros(shape: tuple[int, ...], dtype: np.dtype[Any]) -> FloatArray:
    """A zeroed array whose pages the kernel maps as they are written, in pages of 4 KiB,
    private to the process (`release_rows` can hand them back).

    Why not `np.zeros`: NumPy advises huge pages for large arrays, and a buffer of
    `[rows, heads, positions, head_dim]` is written a few positions per head at a time:
    with huge pages the first position of each head made the whole buffer resident
    (docs/performance.md#figures-behind-the-codes-choices)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    private = getattr(mmap, "MAP_PRIVATE", None)
    if private is None:  # no POSIX flags (Windows): an anonymous map as the platform makes it
        memory = mmap.mmap(-1, max(size, 1))
    else:
        memory = mmap.mmap(-1, max(size, 1), flags=private | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        memory.madvise(advice)
    array: FloatArray = np.frombuffer(memory, dtype=dtype, count=int(np.prod(shape)))
    return array.reshape(shape)


def release_rows(buffer: FloatArray, begin: int, end: int) -> None:
    """Give rows [begin, end) of a `mapped_zeros` buffer back to the kernel, in whole pages:
    they take no memory until written again, and read as zeros. A no-op for other arrays
    or where the platform cannot.

    Why: rows leave a lane's buffers from the end (`InPlaceKv._select`), and the pages
    they wrote stayed resident: a lane's buffers held the memory of the most rows it ever
    ran, each at the most positions any of its rows reached, not of the rows it runs."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    base: Any = buffer.base
    while base is not None and not isinstance(base, mmap.mmap):  # array -> memoryview -> map
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    end = min(end, len(buffer))
    if advice is None or base is None or end <= begin:
        return
    row = buffer[0].nbytes
    page = mmap.PAGESIZE
    at = buffer.ctypes.data - np.frombuffer(base, dtype=np.uint8, count=1).ctypes.data
    start = -(-(at + begin * row) // page) * page  # whole pages inside the rows only
    stop = (at + end * row) // page * page
    if stop > start:
        base.madvise(advice, start, stop - start)


RELEASE_AFTER = 5.0
"""Seconds a lane's rows past its current ones stay resident after it last held them:
rows past the most it held in the last one or two such spans give their pages back.

Why not at once: under steady load rows leave and join a lane every turn, and a join into
given-back pages faults them in again, far slower than a join into resident ones: given
back at every leave, a loaded `capacity.py` run answered fewer partials with no less
memory (docs/performance.md#figures-behind-the-codes-choices)."""

SOURCE_STEP = 16
"""Source positions the cross-attention buffers widen by at a time (`_reserve`)."""


def _widened(width: int) -> int:
    """`width` source positions rounded up to `SOURCE_STEP`s, at least one."""
    return max(SOURCE_STEP, -(-width // SOURCE_STEP) * SOURCE_STEP)


_Views = tuple[EncoderOutput, tuple[FloatArray, ...], tuple[FloatArray, ...]]
"""A row count's views of the lane's buffers: the encoder mask (with an empty hidden
state), the cross-attention and the self-attention buffers' first rows."""


@dataclass
class _Rows:
    """The batch's rows apart from their keys and values: views of the first rows of the
    lane's buffers (the encoder mask and cross-attention keys and values, each row's
    source right-padded to the buffers' width with mask 0), made when rows join or leave
    so that a step binds the same arrays as the last; each row's positions so far."""

    enc: EncoderOutput
    cross_kv: tuple[FloatArray, ...]
    lengths: IntArray  # [rows]
    self_kv: tuple[FloatArray, ...] = ()  # the self-attention buffers' first rows


class InPlaceKv(KvBackend):
    """Rows' state in lane buffers updated in place (module docstring)."""

    def __init__(self, model: MarianOnnx, decoder: MaskedDecoder, steps: InPlaceSteps) -> None:
        self.model = model
        self.decoder = decoder
        self.steps = steps
        config = model.config
        # A row's positions: the start token and at most the length limit's tokens.
        self.positions = min(config.max_length, config.max_position_embeddings)
        self._buffers: tuple[FloatArray, ...] = ()
        # Cross-attention keys and values, [rows, heads, sources, head_dim] each, and the
        # encoder mask [rows, sources]: rows as the self-attention buffers', the sources'
        # width the longest a row brought, rounded up (`SOURCE_STEP`).
        self._cross: tuple[FloatArray, ...] = ()
        self._mask: IntArray = np.zeros((0, 0), dtype=np.int64)
        self._rows: _Rows | None = None
        self._bound = InPlaceBinding()  # this lane's step bindings, kept between steps
        # The views of the buffers' first rows for each row count (`_views`), made over
        # the arrays of `_views_of` (the mask, cross-attention and self-attention buffers).
        self._counted: dict[int, _Views] = {}
        self._views_of: tuple[object, ...] = ()
        # What `_give_back` keeps: the most rows held in the previous span of
        # `RELEASE_AFTER` seconds and in the current one, when the current one began,
        # and the rows whose pages may be resident (the most held since last given back);
        # `clock` gives the time (seconds, monotonic), a test's own where it sets one.
        self.clock = time.monotonic
        self._spans = (0, 0)
        self._span_began = self.clock()
        self._resident = 0

    @property
    def itemsize(self) -> int:
        """Bytes of one value of the decoder's state (its float type's)."""
        return int(np.dtype(self.model.float_type).itemsize)

    @property
    def buffer_rows(self) -> int:
        """Rows the buffers hold now (the most this lane has needed, rounded up)."""
        return int(self._buffers[0].shape[0]) if self._buffers else 0

    def state_bytes(self) -> StateBytes | None:
        """The rows' written positions and real source positions (`live`); the buffers at
        the rows they hold now, over the whole position range and the widest source
        (kept while the lane is idle: pages never written are not resident: `reserved`)."""
        held = spanned(self._buffers) + spanned(self._cross)
        rows = self._rows
        if rows is None or not rows.lengths.size:
            return StateBytes(0, held)
        live = int(rows.lengths.sum()) * position_bytes(self._buffers)
        live += int(rows.enc.attention_mask.sum()) * position_bytes(self._cross)
        return StateBytes(live, held)

    def lookahead_most(self, rows: int, budget: int) -> int:
        """A lone row only: `GroupQueryAttention` refuses several new tokens per row for
        several rows."""
        return budget if rows == 1 else 0

    def confirmed(self, confirmed: Sequence[tuple[int, int]]) -> None:
        """A lone row fed tokens ahead: the positions of those it confirmed are written
        (a rejected one's is simply written again by the next step)."""
        rows = self._rows
        assert rows is not None
        for row, taken in confirmed:
            rows.lengths[row] += taken

    def keep(self, select: Sequence[int], owners: Sequence[Owner]) -> None:
        self._select(select)

    def prefill(
        self,
        newcomers: Sequence[Newcomer],
        enc: EncoderOutput,
        ids: IntArray,
        mask: IntArray,
        *,
        alone: bool,
    ) -> Prefill:
        return masked_prefill(self.decoder, newcomers, enc, ids, mask, alone=alone)

    def join(
        self,
        prefill: Prefill,
        select: Sequence[int],
        lengths: IntArray,
        owners: Sequence[Owner],
    ) -> None:
        """The newcomers' prefilled positions copied into the rows after the last, read
        from the prefill's own arrays (rows `select` names; no state of its own built)."""
        enc, self_kv, cross_kv = prefill.pending
        chosen = [int(r) for r in select]
        rows = self._rows if self._rows is not None and self._rows.lengths.size else None
        before = 0 if rows is None else len(rows.lengths)
        count = before + len(chosen)
        if chosen == list(range(enc.batch_size)):
            mask = enc.attention_mask
            cross = cross_kv
        else:  # some newcomers ended in their prefill (or a beam repeats its rows)
            mask = enc.attention_mask[chosen]
            cross = tuple(a[chosen] for a in cross_kv)
        width = source_width(mask)
        self._reserve(count, width, self_kv, cross_kv, before)
        for i, (row, length) in enumerate(zip(chosen, lengths.tolist(), strict=True)):
            for buffer, written in zip(self._buffers, self_kv, strict=True):
                buffer[before + i, :, :length] = written[row, :, :length]
        for buffer, written in zip(self._cross, cross, strict=True):
            buffer[before:count, :, :width] = written[:, :, :width]
            buffer[before:count, :, width:] = 0
        self._mask[before:count, :width] = mask[:, :width]
        self._mask[before:count, width:] = 0
        if rows is not None:
            held = np.concatenate([rows.lengths, lengths])
        else:
            held = lengths.astype(np.int64, copy=True)
        self._rows = self._views(held)

    def _views(self, lengths: IntArray) -> _Rows:
        """The rows' state: the buffers' first `len(lengths)` rows (contiguous, so bound
        as they are) and their lengths. The views of each row count are kept while the
        buffers are the same: a step's binding of that count is kept as long as they are
        the same objects (`InPlaceBinding`), so a turn whose rows left and joined one for
        one, or whose row count came back to one it ran before, binds nothing again."""
        count = len(lengths)
        of = (self._mask, self._cross, self._buffers)
        if len(of) != len(self._views_of) or not all(
            a is b for a, b in zip(of, self._views_of, strict=True)
        ):
            self._views_of, self._counted = of, {}
            self._bound.forget()  # its bindings hold the arrays replaced
        views = self._counted.get(count)
        if views is None:
            # The step graphs take no encoder hidden states: an empty one keeps the rows.
            hidden = np.zeros((count, 0, 0), dtype=self.model.float_type)
            enc = EncoderOutput(hidden, self._mask[:count])
            cross = tuple(b[:count] for b in self._cross)
            views = self._counted[count] = (enc, cross, tuple(b[:count] for b in self._buffers))
        enc, cross, self_kv = views
        return _Rows(enc, cross, lengths, self_kv)

    def release(self) -> None:
        """Nothing kept alive for an idle lane, the bindings' arrays too."""
        self._rows, self._counted, self._views_of = None, {}, ()
        self._bound.forget()

    def step(
        self,
        next_ids: IntArray,
        ahead: Sequence[Sequence[int]],
        *,
        logits: bool,
        alone: bool,
    ) -> Output:
        rows = self._rows
        assert rows is not None
        ids = next_ids[:, None]
        if ahead:  # one row: its next token and those it is expected to go on with
            ids = np.array([[int(next_ids[0]), *ahead[0]]], dtype=np.int64)
        fed = int(ids.shape[1])
        out = self.steps.step(
            rows.enc,
            ids,
            rows.lengths,
            rows.self_kv,
            rows.cross_kv,
            alone=alone,
            bound=self._bound,
        )
        rows.lengths = rows.lengths + 1
        return out[:, None, :] if fed == 1 else out

    def _reserve(
        self,
        count: int,
        width: int,
        self_kv: Sequence[FloatArray],
        cross_kv: Sequence[FloatArray],
        held: int,
    ) -> None:
        """Buffers of at least `count` rows (a doubling of `INITIAL_ROWS`) and, for
        cross-attention, `width` source positions (widened by `SOURCE_STEP`s), one per
        array of the newcomers' `self_kv` and `cross_kv` (their heads, head size and
        type); the first `held` rows kept."""
        rows = max(self.buffer_rows, INITIAL_ROWS)
        while rows < count:  # a doubling of `INITIAL_ROWS`, even for a first join past it
            rows *= 2
        if count > self.buffer_rows:
            grown = tuple(
                mapped_zeros((rows, a.shape[1], self.positions, a.shape[3]), a.dtype)
                for a in self_kv
            )
            if held and self._rows is not None:
                longest = int(self._rows.lengths[:held].max())
                for new, old in zip(grown, self._buffers, strict=True):
                    new[:held, :, :longest] = old[:held, :, :longest]
            self._buffers = grown
        sources = int(self._mask.shape[1])
        if self._mask.shape[0] == self.buffer_rows and width <= sources:
            return
        self._relayout(max(sources, width), held, cross_kv)

    def _select(self, select: Sequence[int]) -> None:
        """Keep these rows, in this order: their positions move to the buffers' first rows
        (only rows after the first change move; a beam's reordered rows are copied)."""
        rows = self._rows
        assert rows is not None
        if len(select) == len(rows.lengths) and all(row == kept for kept, row in enumerate(select)):
            return  # every row stays where it is (a step's common case: compared in Python)
        order = np.asarray(select, dtype=np.int64)
        lengths = rows.lengths
        moved = np.flatnonzero(order != np.arange(order.size))
        if moved.size:
            first = int(moved[0])
            sources = order[first:]
            longest = int(lengths[sources].max())
            increasing = bool(np.all(np.diff(order) > 0))
            for buffer in self._buffers:
                if increasing:  # rows only left: each moves down over a freed one
                    for target, source in zip(
                        range(first, order.size), sources.tolist(), strict=True
                    ):
                        length = int(lengths[source])
                        buffer[target, :, :length] = buffer[source, :, :length]
                else:  # reordered or repeated (a beam): read them all before writing
                    buffer[first : order.size, :, :longest] = buffer[sources, :, :longest]
            wholes: tuple[npt.NDArray[Any], ...] = (*self._cross, self._mask)
            for whole in wholes:  # a row's whole source width
                whole[first : order.size] = whole[sources]
        self._narrow(order.size)  # first: buffers it replaces need not give pages back
        self._give_back(order.size, len(lengths))
        self._rows = self._views(lengths[order])

    def _give_back(self, count: int, held: int) -> None:
        """After rows left (`held` -> `count`): the rows past the most this lane held in
        the last one or two spans of `RELEASE_AFTER` seconds give their pages back
        (`release_rows`). The first row is always kept, so that a lone stream's next request
        does not fault its row in again."""
        now = self.clock()
        previous, current = self._spans
        current = max(current, held)
        if now - self._span_began >= 2 * RELEASE_AFTER:  # a quiet span between: it held
            previous, current, self._span_began = held, count, now  # the rows of the last turn
        elif now - self._span_began >= RELEASE_AFTER:
            previous, current, self._span_began = current, count, now
        self._spans = (previous, current)
        self._resident = max(self._resident, held)
        keep = max(previous, current, count, 1)
        if keep < self._resident:
            for whole in (*self._buffers, *self._cross):
                release_rows(whole, keep, self._resident)
            self._resident = keep

    def quiet_in(self) -> float | None:
        """An idle lane's rows past the first give their pages back two spans of
        `RELEASE_AFTER` after the span in which its last rows left began (`_give_back`:
        at least one span after they left)."""
        if (self._rows is not None and self._rows.lengths.size) or self._resident <= 1:
            return None
        return self._span_began + 2 * RELEASE_AFTER - self.clock()

    def settle(self) -> None:
        """Give back the rows past the first (`_give_back` starts a new span before it
        releases, so a release that fails is tried again a quiet spell later, not in a
        loop)."""
        if self._rows is None or not self._rows.lengths.size:
            self._give_back(0, 0)

    def _narrow(self, count: int) -> None:
        """Cross-attention buffers as narrow as the first `count` rows' longest source
        (rounded up), once the rows with longer ones have left and they would be half as
        wide or less. Why: every step's cross-attention reads the buffers' whole width,
        and a join writes its rows' padding over all of it; one long source would
        otherwise cost every later row of the lane."""
        if not count:
            return
        need = source_width(self._mask[:count])
        if 2 * _widened(need) <= self._mask.shape[1]:
            self._relayout(need, count, self._cross)

    def _relayout(self, width: int, held: int, like: Sequence[FloatArray]) -> None:
        """New cross-attention buffers and encoder mask, one per array of `like` (their
        heads, head size and type), with the self-attention buffers' rows and `width`
        source positions rounded up (`_widened`); the first `held` rows' sources kept, as
        far as the new width goes (a narrowing keeps what those rows use)."""
        wide, rows = _widened(width), self.buffer_rows
        cross = tuple(mapped_zeros((rows, a.shape[1], wide, a.shape[3]), a.dtype) for a in like)
        mask = np.zeros((rows, wide), dtype=np.int64)
        if held:
            kept = min(wide, int(self._mask.shape[1]))
            for new, old in zip(cross, self._cross, strict=True):
                new[:held, :, :kept] = old[:held, :, :kept]
            mask[:held, :kept] = self._mask[:held, :kept]
        self._cross, self._mask = cross, mask
