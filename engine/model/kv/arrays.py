"""A continuous batch's decoder state as arrays of rows (`RowState`), and the array
helpers the batches that keep their rows' keys and values themselves share: rows kept in
place, stacked with padding, their bytes, their sources trimmed and stacked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.model.layouts import EncoderOutput, FloatArray, IntArray, stack_encoder_outputs


def stacked(
    parts: Sequence[npt.NDArray[Any]], size: int, *, axis: int, left: bool = False
) -> npt.NDArray[Any]:
    """`parts` one after the other along axis 0, each padded with zeros along `axis` to
    `size` (on the left or the right), in one new array.

    Why not pad each and concatenate: that holds the state three times at once (the rows,
    their padded copies and the result), and a join is when a batch's state is largest."""
    shape = list(parts[0].shape)
    shape[0], shape[axis] = sum(p.shape[0] for p in parts), size
    out = np.empty(shape, dtype=parts[0].dtype)
    row = 0
    for part in parts:
        rows, have = part.shape[0], part.shape[axis]
        real = [slice(row, row + rows)] + [slice(None)] * (out.ndim - 1)
        pad = list(real)
        real[axis] = slice(size - have, size) if left else slice(0, have)
        pad[axis] = slice(0, size - have) if left else slice(have, size)
        out[tuple(real)] = part
        out[tuple(pad)] = 0
        row += rows
    return out


def kept(arrays: tuple[FloatArray, ...], rows: IntArray) -> tuple[FloatArray, ...]:
    """`a[rows]` of each array. Where `rows` only drops some (increasing), in place: the
    rows after the first gap move down and the result views the first `len(rows)`.

    Why: rows leave at most steps of a busy batch, and copying every other row's keys and
    values each time held the state twice, in fresh blocks, at the moment of the copy
    (docs/performance.md#figures-behind-the-codes-choices). Only for arrays the batch
    owns: its decoder calls' outputs and its own `stacked` results."""
    if rows.size == 0 or bool(np.any(rows[1:] <= rows[:-1])):
        return tuple(a[rows] for a in arrays)
    moved = np.flatnonzero(rows != np.arange(rows.size))
    if moved.size == 0:
        return tuple(a[: rows.size] for a in arrays)
    first = int(moved[0])
    for a in arrays:
        a[first : rows.size] = a[rows[first:]]
    return tuple(a[: rows.size] for a in arrays)


def position_bytes(arrays: Sequence[FloatArray]) -> int:
    """Bytes one position of one row takes over keys and values `arrays`, each
    [rows, heads, positions, head_dim]."""
    return sum(int(a.shape[1]) * int(a.shape[3]) * a.itemsize for a in arrays)


def spanned(arrays: Sequence[FloatArray]) -> int:
    """Bytes of the arrays `arrays` view (a row selection in place leaves a view of the
    first rows of a larger array, which keeps all of it)."""
    total = 0
    for a in arrays:
        root: np.ndarray[Any, Any] = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        total += root.nbytes
    return total


def source_width(attention_mask: IntArray) -> int:
    """Source positions up to the last one any row of `attention_mask` marks real (0 for
    none)."""
    used = np.flatnonzero(attention_mask.any(axis=0))
    return int(used[-1]) + 1 if used.size else 0


def sources_trimmed(
    enc: EncoderOutput, cross_kv: tuple[FloatArray, ...]
) -> tuple[EncoderOutput, tuple[FloatArray, ...]]:
    """A batch's sources cut to its longest (after the rows with longer ones left)."""
    source = source_width(enc.attention_mask)
    if source == enc.attention_mask.shape[1]:
        return enc, cross_kv
    trimmed = EncoderOutput(enc.hidden_states[:, :source], enc.attention_mask[:, :source])
    return trimmed, tuple(a[:, :, :source] for a in cross_kv)


def sources_stacked(
    enc: EncoderOutput,
    cross_kv: tuple[FloatArray, ...],
    other: EncoderOutput,
    other_kv: tuple[FloatArray, ...],
) -> tuple[EncoderOutput, tuple[FloatArray, ...]]:
    """Two batches' sources as one, each padded to the longer (`attention_mask` 0)."""
    source = max(enc.attention_mask.shape[1], other.attention_mask.shape[1])
    joined = tuple(stacked(pair, source, axis=2) for pair in zip(cross_kv, other_kv, strict=True))
    return stack_encoder_outputs([enc, other]), joined


@dataclass
class RowState:
    """A continuous batch's decoder state, row by row: its sources, the self KV of every
    row in one array [rows, heads, slots, dim] whose real slots `real` marks (1), the
    cross-attention KV and how many tokens each row was fed (start token included)."""

    enc: EncoderOutput
    self_kv: tuple[FloatArray, ...]
    cross_kv: tuple[FloatArray, ...]
    real: IntArray  # [rows, slots]
    lengths: IntArray  # [rows]

    def select(self, select: list[int]) -> None:
        """Keep these rows, in this order; then cut off the slots no row uses any more (the
        rows that left were the long ones) and the source positions past the longest."""
        if select == list(range(self.real.shape[0])):
            return  # no row left or moved: nothing to select or trim
        rows: IntArray = np.array(select, dtype=np.int64)
        self.enc = self.enc.select(rows)
        self.self_kv = kept(self.self_kv, rows)
        self.cross_kv = kept(self.cross_kv, rows)
        self.real, self.lengths = self.real[rows], self.lengths[rows]
        if not len(select):
            return
        used = np.flatnonzero(self.real.any(axis=0))
        first = int(used[0]) if used.size else self.real.shape[1]
        if first:
            self.real = self.real[:, first:]
            self.self_kv = tuple(a[:, :, first:] for a in self.self_kv)
        self.enc, self.cross_kv = sources_trimmed(self.enc, self.cross_kv)

    def extend(self, other: RowState) -> None:
        """Append `other`'s rows: the self KV right-aligned (the shorter side grows on the
        left), sources padded to the longest with `attention_mask` 0."""
        slots = max(self.real.shape[1], other.real.shape[1])
        self.self_kv = tuple(
            stacked(pair, slots, axis=2, left=True)
            for pair in zip(self.self_kv, other.self_kv, strict=True)
        )
        self.enc, self.cross_kv = sources_stacked(
            self.enc, self.cross_kv, other.enc, other.cross_kv
        )
        self.real = stacked((self.real, other.real), slots, axis=1, left=True)
        self.lengths = np.concatenate([self.lengths, other.lengths])

    def squeeze(self) -> None:
        """Drop the holes that rejected lookahead left in the self KV: each row's real
        slots moved together at the end (right-aligned, as after a join)."""
        keep = self.real.sum(axis=1)
        width = int(keep.max(initial=0))
        order = np.argsort(self.real, axis=1, kind="stable")[:, self.real.shape[1] - width :]
        self.self_kv = tuple(
            np.take_along_axis(a, order[:, None, :, None], axis=2) for a in self.self_kv
        )
        self.real = (np.arange(width)[None, :] >= (width - keep)[:, None]).astype(np.int64)


def prefilled(
    enc: EncoderOutput,
    self_kv: tuple[FloatArray, ...],
    cross_kv: tuple[FloatArray, ...],
    select: Sequence[int],
    lengths: IntArray,
) -> RowState:
    """The state of the prefilled rows a batch keeps: the prefill's rows `select` names
    (a beam's repeated), each with its first `lengths[k]` positions real (start token,
    forced prefix, the draft it confirmed), the rest masked out."""
    width = int(self_kv[0].shape[2]) if self_kv else int(lengths.max(initial=0))
    real = np.zeros(enc.batch_size, dtype=np.int64)
    real[np.asarray(select, dtype=np.int64)] = lengths
    used = (np.arange(width)[None, :] < real[:, None]).astype(np.int64)
    state = RowState(enc, self_kv, cross_kv, used, real)
    state.select(list(select))
    return state
