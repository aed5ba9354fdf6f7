"""Batches: the rows of many searches run through shared decoder calls.

A scheduler lane drives its batch through the same cycle whatever its kind
(`DecodeBatch`), so that it never asks which kind it holds or what shape a call returned:

1. `update()`: each search takes its rows' logits from the last call; those that ended leave;
2. `schedule(joining, leaving)`: searches whose request was aborted leave, new ones join
   (prefilled in one call: start token, forced prefix, draft) and take their first step;
3. `execute()`: one decoder call over every live row.

One batch class, `engine.decoding.continuous.ContinuousBatch`, runs over the model's KV
backend, chosen at load (`engine.model.backend`; `engine.decoding.backends` builds it).
Over the rewritten decoder (`MaskedDecoder`: positions per row, a mask over cache slots)
searches join and leave at any step (iteration-level batching, as in Orca and vLLM), the
rows' state handed to every step (copied), kept in lane buffers extended in place (the
CPU's default) or in KV slots (a GPU's). Over the stock decoder graphs
(`engine.model.kv.lockstep`), which take positions from the past length and have no
self-attention mask, all rows keep one length (the backend is not `ragged`): searches
join only an empty batch. The encoder runs once per source, before: a search joins with
its source's encoder output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from engine.decoding.search import Extension, Search
from engine.model.config import ModelConfig
from engine.model.kv.base import StateBytes
from engine.model.layouts import (
    EncoderOutput,
    FloatArray,
    IntArray,
)


class Member(NamedTuple):
    """A search joining a batch, with the encoder output of its one source and, for a
    batch that keeps rows in KV slots (`engine.model.kv.slots.rows`), the slots its
    request was given (one per row it may hold)."""

    search: Search
    enc: EncoderOutput
    slots: tuple[int, ...] = ()


LOOKAHEAD_POSITIONS = 4
"""Extra positions one cached step may compute for looked-ahead tokens, over all its rows.
Every row of a step is padded to the longest row's positions, so a lookahead costs each
row of the batch: an extra position is cheap next to a saved step for a lone row, but at
many rows one more position each costs more than the step it could save for one of them.
So a lone row looks 4 ahead, 2 rows 2 each, 3-4 rows 1 and a busier step none:
speculation pays at low load, as in LLM serving; a larger budget gained nothing under
load (examples/benchmarks/capacity.py measures it)."""


@dataclass
class Steps:
    """What one decoder call did to a batch's searches, gathered search by search: those
    that ended, those still running, the rows to keep (in their new order: a beam reorders
    and widens its own rows), the next token of each kept row, and for each row fed
    expected tokens, how many of them it confirmed."""

    ended: list[Search] = field(default_factory=list)
    kept: list[Search] = field(default_factory=list)
    select: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    confirmed: list[tuple[int, int]] = field(default_factory=list)  # (row, tokens)

    def add(self, search: Search, row: int, step: Extension | None) -> None:
        """`search`, whose rows start at `row`, took `step` (None: it ended)."""
        if step is None:
            self.ended.append(search)
            return
        self.kept.append(search)
        self.select.extend(row + p for p in step.parents)
        self.tokens.extend(step.tokens)


class DecodeBatch(ABC):
    """The searches of one lane and the decoder state of their rows (a search's rows are
    consecutive). The cycle: `update`, `schedule`, `execute`, and again (module docstring).

    `stats` counts what the batch verified ahead (draft_ and lookahead_ offered and
    accepted); the scheduler takes them after each step."""

    def __init__(self) -> None:
        self.searches: list[Search] = []
        self.stats: Counter[str] = Counter()
        # The last call's logits [rows, positions, vocab] until `update` takes them, and the
        # tokens each row was fed after its own next one (expected: lookahead), if any.
        self._logits: FloatArray | None = None
        self._ahead: list[list[int]] = []
        # Set by the scheduler for each turn: no other lane of the model is running, so
        # the output projection may take every core (`MaskedDecoder.step`'s `alone`).
        self.alone = False

    def __len__(self) -> int:
        return len(self.searches)

    @property
    def rows(self) -> int:
        return sum(s.width for s in self.searches)

    def state_bytes(self) -> StateBytes | None:
        """The memory of the rows' decoder state now (`StateBytes`); None where the batch
        does not keep it itself (a lockstep batch's cache, a KV slot pool: the pool's size
        is the scheduler's `kv_slots`)."""
        return None

    def quiet_in(self) -> float | None:
        """Seconds after which an idle batch has memory to give back (`settle`), at most
        0 when it has now; None when it has none (or is not idle). The lane's thread waits
        no longer than this for work, so that a burst's memory does not stay resident
        until the lane's next request."""
        return None

    def settle(self) -> None:
        """Give back what an idle batch no longer needs, once `quiet_in` says so (a batch
        that keeps nothing between requests has nothing to give back)."""
        return None

    @property
    @abstractmethod
    def joinable(self) -> bool:
        """Whether searches may join at the next `schedule`."""

    @abstractmethod
    def update(self) -> list[Search]:
        """Each search takes its rows' logits from the last `execute` (nothing to take
        before the first); returns the searches that ended, which left the batch."""

    @abstractmethod
    def schedule(self, joining: Sequence[Member], leaving: Collection[Search] = ()) -> list[Search]:
        """Between `update` and `execute`: `leaving` searches leave (their request was
        aborted); `joining` ones are prefilled in one call and take their first step
        there. Returns the joining searches that ended already."""

    @abstractmethod
    def execute(self) -> None:
        """One decoder call over every live row; nothing when none is left."""

    def _observe(self, logits: FloatArray) -> Steps:
        """Each search observes its rows' logits at their first position [rows, positions,
        vocab]. `searches` keeps the searches still running."""
        steps = Steps()
        row = 0
        for search in self.searches:
            width = search.width  # before the step: a beam widens
            steps.add(search, row, search.observe(logits[row : row + width, 0]))
            row += width
        self.searches = steps.kept
        return steps

    def _count_lookahead(self, ahead: Sequence[Sequence[int]], steps: Steps) -> None:
        """Add to `stats` the tokens a step fed ahead and those its rows confirmed."""
        self.stats["lookahead_offered"] += sum(map(len, ahead))
        self.stats["lookahead_accepted"] += sum(taken for _, taken in steps.confirmed)

    def _look_ahead(self, most: int) -> list[list[int]]:
        """Each row's tokens to verify after its next one in the coming step, at most
        `most` (`Search.take_lookahead`; a beam's: none); [] when no row has any."""
        if most <= 0:
            return []
        ahead: list[list[int]] = [[] for _ in range(self.rows)]
        row = 0
        for search in self.searches:
            ahead[row] = search.take_lookahead(most)
            row += search.width
        return ahead if any(ahead) else []

    def _without(self, gone: Collection[Search]) -> list[int] | None:
        """The rows left once `gone` leave (`searches` updated), or None if none of them
        is in the batch."""
        if not any(search in gone for search in self.searches):
            return None
        select: list[int] = []
        kept: list[Search] = []
        row = 0
        for search in self.searches:
            if search not in gone:
                kept.append(search)
                select.extend(range(row, row + search.width))
            row += search.width
        self.searches = kept
        return select


def common_prefill_rows(
    searches: Sequence[Search], config: ModelConfig
) -> tuple[IntArray, IntArray]:
    """What a batch over rows of one length (a backend that is not `ragged`: the stock
    graphs) prefills its newcomers with: the start token and the prefix they all share
    the length of (`ids`, unpadded; `mask` all 1); each search forces the rest of its
    prefix step by step (`Search.start`), and no draft is fed."""
    common = min(len(s.prefix) for s in searches)
    for search in searches:
        search.start(common)
    ids = np.array(
        [[config.decoder_start_token_id, *s.prefix[:common]] for s in searches], dtype=np.int64
    )
    return ids, np.ones_like(ids)


def prefill_rows(searches: Sequence[Search], config: ModelConfig) -> tuple[IntArray, IntArray]:
    """What a continuous batch's prefill feeds its newcomers, right-padded: the start token,
    forced prefix and draft of each (`ids`, with `mask` 1 on real tokens); each search is
    told that its whole prefix went in (`Search.start`)."""
    fed = [[config.decoder_start_token_id, *s.prefix, *s.draft] for s in searches]
    if len(searches) == 1:  # the common prefill: one newcomer, nothing to pad
        searches[0].start(len(searches[0].prefix))
        ids = np.array(fed, dtype=np.int64)
        return ids, np.ones_like(ids)
    width = max(map(len, fed))
    ids = np.full((len(searches), width), config.pad_token_id, dtype=np.int64)
    mask = np.zeros((len(searches), width), dtype=np.int64)
    for r, (search, row_ids) in enumerate(zip(searches, fed, strict=True)):
        ids[r, : len(row_ids)] = row_ids
        mask[r, : len(row_ids)] = 1
        search.start(len(search.prefix))
    return ids, mask
