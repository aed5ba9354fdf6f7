"""The KV backend interface a continuous batch drives, and what its calls return.

A call returns either logits (`Logits`: [rows, positions, vocab], the masked decoder's)
or the model's own greedy choice with its log-probability and, where a search asked for
them, the logits (`engine.model.slots.StepOutput`, over KV slots). A search reads one
position through a `Run`, which gives it the choice where it can take one and the logits
where it needs them, so that the batch never asks which kind it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.decoding.batch import Member, StateBytes
from engine.decoding.search import Extension, GreedySearch, Search
from engine.model.layouts import EncoderOutput, FloatArray, IntArray
from engine.model.logits import RowRun
from engine.model.slots import StepOutput


class Run(Protocol):
    """One row's outputs from a position on, as a search reads them in order."""

    def take(self, search: Search, index: int) -> Extension | None:
        """`search` (one row) observes the run's `index`-th position."""
        ...


@dataclass(frozen=True)
class LogitsRun:
    """A row's logits from a position on: `values[i]` [V] (an array, or a prefill's
    `RowRun`, projected as read)."""

    values: FloatArray | RowRun

    def take(self, search: Search, index: int) -> Extension | None:
        return search.observe(self.values[index][None])


@dataclass(frozen=True)
class ChoiceRun:
    """Row `row` of a call's choices from position `first` on: a greedy search that
    needs no logits takes the model's choice, any other observes the logits."""

    out: StepOutput
    row: int
    first: int

    def take(self, search: Search, index: int) -> Extension | None:
        at = self.first + index
        if isinstance(search, GreedySearch) and not search.needs_logits:
            token, score = self.out.ids[self.row, at], self.out.scores[self.row, at]
            return search.take(int(token), float(score))
        assert self.out.logits is not None, "a search that needs logits asked for them"
        return search.observe(self.out.logits[self.row : self.row + 1, at])


Output = FloatArray | StepOutput
"""What a step returns: logits [rows, positions, vocab], or the model's choices."""


def run_of(out: Output, row: int) -> Run:
    """Row `row` of a step's output, from its first position."""
    if isinstance(out, StepOutput):
        return ChoiceRun(out, row, 0)
    return LogitsRun(out[row])


@dataclass(frozen=True)
class Prefill:
    """What a backend's prefill gives the batch: each newcomer's outputs from a position
    on (`run(row, start)`: `start` is where its forced prefix ends), and what the backend
    needs back to `join` the rows the batch keeps (its own)."""

    run: Callable[[int, int], Run]
    pending: Any


class KvBackend(ABC):
    """Where a continuous batch's rows keep their decoder state. Rows are in the batch's
    order (a search's rows consecutive); the batch tells the backend every change:

    - `prefill` the newcomers (start token, forced prefix, draft; right-padded) in one
      call, then `join` the rows it keeps after the running ones;
    - `step` every row (its next token, and for some rows tokens ahead to verify);
    - `confirmed`: what each row fed ahead confirmed (the rest is not the row's);
    - `keep` rows in a new order (rows left, a beam reordered and widened);
    - `release` once no row is left.
    """

    chooses = False
    """Whether a step returns the model's own greedy choice (a search that needs the
    logits asks for them: `step(logits=True)`)."""

    @abstractmethod
    def lookahead_most(self, rows: int, budget: int) -> int:
        """Tokens each of `rows` rows may feed ahead in the next step, given `budget`
        extra positions over all of them (`LOOKAHEAD_POSITIONS`)."""

    @abstractmethod
    def prefill(
        self,
        joining: Sequence[Member],
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
        self, prefill: Prefill, select: Sequence[int], lengths: IntArray, kept: Sequence[Search]
    ) -> None:
        """Append the prefilled rows `select` names (a prefill row per kept row, a beam's
        repeated), `lengths` [rows] the positions each wrote that are its own, `kept`
        the searches they belong to, in order."""

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
        `logits`: a search needs them (a backend that `chooses` returns them too)."""

    @abstractmethod
    def confirmed(self, confirmed: Sequence[tuple[int, int]]) -> None:
        """After a step that fed rows tokens ahead: (row, tokens it confirmed)."""

    @abstractmethod
    def keep(self, select: Sequence[int], searches: Sequence[Search]) -> None:
        """Keep the rows `select` names, in its order, for `searches` (the batch's now)."""

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
