"""A continuous batch's state kept without second copies: rows that only leave move down
in place (`kept`), and a join pads and stacks into one new array (`stacked`); both give
what indexing, padding and concatenating give. That rows still equal decoding alone
while others leave from anywhere in the batch: tests/test_scheduler.py
(`test_concurrent_requests_equal_decoding_each_alone`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine.model.kv.arrays import kept as kept_rows
from engine.model.kv.arrays import stacked

Array = np.ndarray[Any, Any]


def _state(rows: int, seed: int = 0) -> tuple[Array, Array]:
    rng = np.random.default_rng(seed)
    shape = (rows, 2, 5, 3)  # rows, heads, slots, head_dim
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(
        np.float32
    )


@pytest.mark.parametrize(
    "rows",
    [[0, 1, 2, 3, 4], [0, 1, 2], [1, 2, 3, 4], [0, 2, 4], [3], [4], []],
    ids=["all", "tail-left", "head-left", "gaps", "one", "last", "none"],
)
def test_rows_that_only_leave_move_down_in_place(rows: list[int]) -> None:
    arrays = _state(5)
    expected = tuple(a[np.array(rows, dtype=np.int64)].copy() for a in arrays)
    kept = kept_rows(arrays, np.array(rows, dtype=np.int64))
    for got, want, source in zip(kept, expected, arrays, strict=True):
        np.testing.assert_array_equal(got, want)
        if rows:  # no second copy of the state: a view of the batch's own array
            assert np.shares_memory(got, source)


@pytest.mark.parametrize("rows", [[2, 0, 1], [0, 0, 1], [1, 1]], ids=["reordered", "dup", "dup2"])
def test_reordered_or_repeated_rows_are_copied(rows: list[int]) -> None:
    """A beam reorders and repeats its rows: moving them in place would overwrite rows
    still to be read, so they are copied, and the source is left as it was."""
    arrays = _state(3)
    before = tuple(a.copy() for a in arrays)
    kept = kept_rows(arrays, np.array(rows, dtype=np.int64))
    for got, source, original in zip(kept, arrays, before, strict=True):
        np.testing.assert_array_equal(got, original[rows])
        np.testing.assert_array_equal(source, original)
        assert not np.shares_memory(got, source)


@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
def test_a_join_pads_and_stacks_in_one_array(left: bool) -> None:
    mine, _ = _state(3, seed=1)
    theirs = np.random.default_rng(2).standard_normal((2, 2, 7, 3)).astype(np.float32)
    got = stacked((mine, theirs), 7, axis=2, left=left)
    pad = [(0, 0), (0, 0), (2, 0) if left else (0, 2), (0, 0)]
    want = np.concatenate([np.pad(mine, pad), theirs])
    np.testing.assert_array_equal(got, want)
    assert got.dtype == mine.dtype


def test_a_join_of_masks_pads_each_side_to_the_widest() -> None:
    """The real-slot masks [rows, slots] stack the same way, whichever side is wider."""
    a = np.ones((2, 4), dtype=np.int64)
    b = np.array([[1, 1, 1, 1, 1, 1]], dtype=np.int64)
    # The result is built in fresh memory, which may hold anything: padding left as it
    # was would read as real slots. Freed just before, a block of ones is likely reused.
    dirty = np.ones((3, 6), dtype=np.int64)
    del dirty
    got = stacked((a, b), 6, axis=1, left=True)
    np.testing.assert_array_equal(got, [[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [1] * 6])
