"""The KV backend interface the one continuous batch (`engine.decoding.continuous`)
drives, and what its calls return.

A call returns either logits (`[rows, positions, vocab]`, the masked decoder's) or the
model's own greedy choice with its log-probability and, where asked for, the logits
(`StepOutput`, over KV slots). The batch reads a row's positions through `Positions`, which
gives the choice where the model made one and the logits always, so that it never asks
which backend runs. No search here: the batch tells a backend what it needs as numbers
(`Newcomer`) and names rows by their owner (`Owner`: a search, to the batch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from engine.model.kv.slots.pool import StepOutput
from engine.model.layouts import EncoderOutput, FloatArray, IntArray
from engine.model.logits import RowLogits, RowRun
from engine.model.masked import MaskedDecoder

LOOKAHEAD = 4
"""Draft tokens a greedy row may have verified in one cached step, after the draft was
re-aligned (`GreedySearch.take_lookahead`): on the committed fixture logs, longer runs
confirm almost nothing more (examples/benchmarks/draft_bound.py)."""


class StateBytes(NamedTuple):
    """A batch's decoder state in bytes: `live`, what its rows' positions and sources
    occupy now; `reserved`, what the arrays holding them span (buffers kept for more rows
    and positions than run now: their pages are mapped as they are written, so resident
    memory lies between the two)."""

    live: int
    reserved: int


class Owner(Hashable, Protocol):
    """What a row group belongs to (a search): hashable, with its rows' count now."""

    @property
    def width(self) -> int: ...


@dataclass(frozen=True)
class Newcomer:
    """What a backend's prefill needs of a joining row group: `start`, where its forced
    prefix ends (its first position read); `slots`, the KV slots its request was given
    (one per row it may hold; none but over slots); `minimum`, its minimum new tokens;
    `bans`, whether eos is banned at each position from `start` to its last fed token
    (given where the backend `chooses`); `logits`, whether its search needs the logits."""

    start: int
    slots: tuple[int, ...] = ()
    minimum: int = 0
    bans: tuple[bool, ...] = ()
    logits: bool = False


class Positions(Protocol):
    """One row's outputs from a position on, read in order."""

    def logits(self, index: int) -> FloatArray:
        """The `index`-th position's logits [1, V]."""
        ...

    def choice(self, index: int) -> tuple[int, float] | None:
        """The model's choice there and its log-probability; None where it made none."""
        ...


@dataclass(frozen=True)
class LogitsPositions:
    """A row's logits from a position on: `values[i]` [V] (an array, or a prefill's
    `RowRun`, projected as read)."""

    values: FloatArray | RowRun

    def logits(self, index: int) -> FloatArray:
        row: FloatArray = self.values[index][None]
        return row

    def choice(self, index: int) -> tuple[int, float] | None:
        return None


@dataclass(frozen=True)
class ChoicePositions:
    """Row `row` of a call's choices from position `first` on (its logits where the call
    returned them)."""

    out: StepOutput
    row: int
    first: int

    def logits(self, index: int) -> FloatArray:
        assert self.out.logits is not None, "the logits were not asked for"
        row: FloatArray = self.out.logits[self.row : self.row + 1, self.first + index]
        return row

    def choice(self, index: int) -> tuple[int, float] | None:
        at = self.first + index
        return int(self.out.ids[self.row, at]), float(self.out.scores[self.row, at])


Output = FloatArray | StepOutput
"""What a step returns: logits [rows, positions, vocab], or the model's choices."""


def positions_of(out: Output, row: int) -> Positions:
    """Row `row` of a step's output, from its first position."""
    if isinstance(out, StepOutput):
        return ChoicePositions(out, row, 0)
    return LogitsPositions(out[row])


@dataclass(frozen=True)
class Prefill:
    """What a backend's prefill gives the batch: `logits` packed by row (the masked
    decoder's), or the model's `choices` with where each row's reads begin (`firsts`);
    and what the backend needs back to `join` the rows the batch keeps (`pending`)."""

    pending: Any
    logits: RowLogits | None = None
    choices: StepOutput | None = None
    firsts: tuple[int, ...] = ()

    def positions(self, row: int, start: int) -> Positions:
        """Newcomer `row`'s outputs from its position `start` (its forced prefix's end)."""
        if self.choices is not None:
            return ChoicePositions(self.choices, 0, self.firsts[row])
        assert self.logits is not None
        return LogitsPositions(self.logits.row(row, start))


def lookahead_rows(
    next_ids: IntArray, ahead: Sequence[Sequence[int]], pad: int
) -> tuple[IntArray, IntArray]:
    """What a step with lookahead feeds: each row's next token (`next_ids` [B]) then its
    `ahead` tokens, right-padded with `pad` (`ids` [B, T]), and `new` [B, T], 1 on the
    real ones."""
    rows, fed = len(next_ids), 1 + max(map(len, ahead))
    ids = np.full((rows, fed), pad, dtype=np.int64)
    new = np.zeros((rows, fed), dtype=np.int64)
    ids[:, 0], new[:, 0] = next_ids, 1
    for r, looked in enumerate(ahead):
        ids[r, 1 : 1 + len(looked)] = looked
        new[r, 1 : 1 + len(looked)] = 1
    return ids, new


class KvBackend(ABC):
    """Where a continuous batch's rows keep their decoder state. Rows are in the batch's
    order (a row group's rows consecutive); the batch tells the backend every change:

    - `prefill` the newcomers (start token, forced prefix, draft; right-padded) in one
      call, then `join` the rows it keeps after the running ones;
    - `step` every row (its next token, and for some rows tokens ahead to verify);
    - `confirmed`: what each row fed ahead confirmed (the rest is not the row's);
    - `keep` rows in a new order (rows left, a beam reordered and widened);
    - `release` once no row is left.

    A backend that is not `ragged` takes newcomers only while it holds no row.
    """

    chooses = False
    """Whether a call returns the model's own greedy choice (the batch then gives each
    newcomer's `bans`, and asks for logits where a search needs them)."""

    ragged = True
    """Whether rows keep lengths of their own (positions per row, a mask over slots): the
    batch then prefills newcomers right-padded with their whole prefix and draft, joins
    them to running rows at any step, and may feed tokens ahead. False (the stock graphs:
    `lockstep`): rows advance together, so the batch joins newcomers only when it is
    empty, feeds them their common prefix unpadded (the rest forced step by step, no
    draft), and `lookahead_most` is 0."""

    @abstractmethod
    def lookahead_most(self, rows: int, budget: int) -> int:
        """Tokens each of `rows` rows may feed ahead in the next step, given `budget`
        extra positions over all of them (`LOOKAHEAD_POSITIONS`)."""

    @abstractmethod
    def prefill(
        self,
        newcomers: Sequence[Newcomer],
        enc: EncoderOutput,
        ids: IntArray,
        mask: IntArray,
        *,
        alone: bool,
    ) -> Prefill:
        """One call over the newcomers' `ids` (`mask`: 1 on real tokens), their sources
        stacked in `enc`. `alone`: no other lane runs (the projection may take every
        core)."""

    @abstractmethod
    def join(
        self,
        prefill: Prefill,
        select: Sequence[int],
        lengths: IntArray,
        owners: Sequence[Owner],
    ) -> None:
        """Append the prefilled rows `select` names (a prefill row per kept row, a beam's
        repeated), `lengths` [rows] the positions each wrote that are its own, `owners`
        the row groups they belong to, in order (each the newcomer of the same index in
        the prefill it came from: `select` names it)."""

    @abstractmethod
    def step(
        self,
        next_ids: IntArray,
        ahead: Sequence[Sequence[int]],
        *,
        logits: bool,
        alone: bool,
    ) -> Output:
        """One call over every row: its next token (`next_ids` [rows]) and, where
        `ahead` ([] or one list per row) has any, the tokens it expects after it.
        `logits`: a row needs them (a backend that `chooses` returns them too)."""

    @abstractmethod
    def confirmed(self, confirmed: Sequence[tuple[int, int]]) -> None:
        """After a step that fed rows tokens ahead: (row, tokens it confirmed)."""

    @abstractmethod
    def keep(self, select: Sequence[int], owners: Sequence[Owner]) -> None:
        """Keep the rows `select` names, in its order, for `owners` (the batch's now)."""

    @abstractmethod
    def release(self) -> None:
        """No row is left: let go what is kept per request."""

    def state_bytes(self) -> StateBytes | None:
        """The rows' decoder state in bytes (`StateBytes`); None where the backend does
        not hold it per lane (a KV slot pool is the scheduler's)."""
        return None

    def quiet_in(self) -> float | None:
        """Seconds until an idle backend has memory to give back (`settle`); None: none."""
        return None

    def settle(self) -> None:
        """Give back what an idle backend no longer needs."""
        return None


def masked_prefill(
    decoder: MaskedDecoder,
    newcomers: Sequence[Newcomer],
    enc: EncoderOutput,
    ids: IntArray,
    mask: IntArray,
    *,
    alone: bool,
) -> Prefill:
    """The prefill of the backends whose rows' state lives in arrays (copied, in place):
    one masked-decoder call, logits from each newcomer's `start`, its keys and values
    pending for `join`."""
    needed = np.array([newcomer.start for newcomer in newcomers], dtype=np.int64)
    logits, self_kv, cross_kv = decoder.prefill(enc, ids, mask, needed, alone=alone)
    return Prefill((enc, self_kv, cross_kv), logits=logits)
