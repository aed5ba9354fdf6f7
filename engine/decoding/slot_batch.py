"""A continuous batch whose decoder state stays in KV slots (`engine.model.slots`).

Each running row owns a slot, given by the scheduling policy when its request joins:
its keys and values are written there by its prefill and by every step, at its own
absolute positions, and never move. A step sends each row's token, position and slot and
gets each row's argmax back; a search that needs more (a beam, a hook) gets its rows'
logits. No state is concatenated, reallocated or sent between steps. (Reading a row's
positions is a `Gather` inside the graph, which on the CPU copies them as a concatenation
would: see `SchedulerOptions.kv_slots` for why the CPU's default copies the state.)

Draft and lookahead are as in `engine.decoding.batch.ContinuousBatch`, with one
simplification the slots allow: a rejected lookahead token leaves nothing to squeeze, its
position is written again by the row's next token.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.decoding.batch import (
    LOOKAHEAD,
    DecodeBatch,
    Member,
    Steps,
    lookahead_rows,
    prefill_rows,
    stack_encoder_outputs,
)
from engine.decoding.search import Extension, GreedySearch, Search
from engine.model.layouts import IntArray
from engine.model.marian import MarianOnnx
from engine.model.masked import MaskedDecoder
from engine.model.slots import KvSlots, StepOutput


def _take(search: Search, out: StepOutput, row: int, position: int) -> Extension | None:
    """A one-row search's step from the model's choice at `position` of `row`."""
    if isinstance(search, GreedySearch) and not search.needs_logits:
        return search.take(int(out.ids[row, position]), float(out.scores[row, position]))
    assert out.logits is not None
    return search.observe(out.logits[row : row + 1, position])


def confirm(
    search: Search, out: StepOutput, row: int, first: int, expected: Sequence[int]
) -> tuple[Extension | None, int]:
    """`batch._confirm` on a step's output: the search goes on through `expected` (fed
    from position `first`) while it picks them. Returns its last step and how many it
    confirmed."""
    confirmed = 0
    while True:
        step = _take(search, out, row, first + confirmed)
        if step is None or confirmed >= len(expected) or step.tokens != [expected[confirmed]]:
            return step, confirmed
        confirmed += 1


@dataclass
class _Rows:
    """The batch's rows, as arrays: each row's slot, positions written (the next one's
    index), next token, source length and minimum length (`min_new_tokens`)."""

    slot: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    length: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    next: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    source: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    minimum: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def take(self, select: Sequence[int]) -> None:
        """Keep these rows, in this order."""
        rows = np.asarray(select, dtype=np.int64)
        for name in ("slot", "length", "next", "source", "minimum"):
            setattr(self, name, getattr(self, name)[rows])

    def extend(self, other: _Rows) -> None:
        for name in ("slot", "length", "next", "source", "minimum"):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(other, name)]))


class SlotBatch(DecodeBatch):
    """Searches that join and leave at any step, each row in its own KV slot (module
    docstring). `slots` of a joining `Member` are its request's, one per row it may
    hold (a beam's width)."""

    def __init__(
        self,
        model: MarianOnnx,
        decoder: MaskedDecoder,
        pool: KvSlots,
        lookahead_positions: int = 0,
    ) -> None:
        super().__init__()
        self.model = model
        self.pool = pool
        self.lookahead_positions = lookahead_positions if decoder.lookahead else 0
        self._owned: dict[Search, tuple[int, ...]] = {}  # each search's slots
        self._wide = 0  # searches that are not greedy (beams): rows that may reorder
        self._rows = _Rows()
        self._out: StepOutput | None = None  # the last step's, until `update` takes it

    @property
    def joinable(self) -> bool:
        return self._out is None

    def update(self) -> list[Search]:
        out, self._out = self._out, None
        if out is None:
            return []
        if not self._ahead and out.logits is None and not self._wide:
            return self._take_choices(out)
        steps = Steps()
        row = 0
        ahead = self._ahead
        for search in self.searches:
            width = search.width
            if ahead and ahead[row]:
                step, taken = confirm(search, out, row, 0, ahead[row])
                steps.confirmed.append((row, taken))
            elif width == 1:
                step = _take(search, out, row, 0)
            else:
                assert out.logits is not None
                step = search.observe(out.logits[row : row + width, 0])
            steps.add(search, row, step)
            row += width
        if ahead:
            for r, taken in steps.confirmed:
                self._rows.length[r] += taken
            self._count_lookahead(ahead, steps)
        self._ahead = []
        self.searches = steps.kept
        for search in steps.ended:
            self._leave(search)
        self._arrange(steps)
        return steps.ended

    def _take_choices(self, out: StepOutput) -> list[Search]:
        """The common step, kept lean (it runs once per token, for every row): each row a
        greedy search that takes the model's own choice, one position per row, the rows
        in place but those that ended."""
        ended: list[Search] = []
        gone: list[int] = []
        tokens: list[int] = []
        rows = zip(self.searches, out.ids[:, 0].tolist(), out.scores[:, 0].tolist(), strict=True)
        for row, (search, token, score) in enumerate(rows):
            assert isinstance(search, GreedySearch)
            step = search.take(token, score)
            if step is None:
                ended.append(search)
                gone.append(row)
            else:
                tokens.append(step.tokens[0])
        if gone:
            kept = np.ones(len(self.searches), dtype=bool)
            kept[gone] = False
            self.searches = [s for s, keep in zip(self.searches, kept, strict=True) if keep]
            for search in ended:
                self._leave(search)
            self._rows.take(np.flatnonzero(kept).tolist())
        self._rows.next = np.array(tokens, dtype=np.int64)
        return ended

    def _leave(self, search: Search) -> None:
        del self._owned[search]
        if not isinstance(search, GreedySearch):
            self._wide -= 1

    def _arrange(self, steps: Steps) -> None:
        """The rows of the searches kept, in their new order: a beam's row continues a
        parent row, whose state is copied into the row's own slot when it is another."""
        rows = self._rows
        parents = rows.slot[steps.select]
        rows.take(steps.select)
        rows.next = np.array(steps.tokens, dtype=np.int64)
        rows.slot = np.array(
            [slot for search in self.searches for slot in self._owned[search][: search.width]],
            dtype=np.int64,
        )
        moved = np.flatnonzero(rows.slot != parents)
        if moved.size:
            positions = int(rows.length[moved].max())
            self.pool.copy(parents[moved].tolist(), rows.slot[moved].tolist(), positions)

    def schedule(self, joining: Sequence[Member], leaving: Collection[Search] = ()) -> list[Search]:
        if self._out is not None:
            raise RuntimeError("schedule between execute and update")
        kept = self._without(leaving)
        if kept is not None:
            self._rows.take(kept)
        for search in leaving:
            if search in self._owned:
                self._leave(search)
        if not joining:
            return []
        return self._prefill(joining)

    def _prefill(self, joining: Sequence[Member]) -> list[Search]:
        """One call over the newcomers (start token, forced prefix, draft; right-padded),
        their keys and values written into every slot they own; each takes its first
        step there and goes on through its draft while the draft is confirmed."""
        searches = [member.search for member in joining]
        ids, mask = prefill_rows(searches, self.model.config)
        width = ids.shape[1]
        lengths_fed = mask.sum(axis=1).tolist()
        enc = stack_encoder_outputs([member.enc for member in joining])
        owned = [tuple(member.slots) for member in joining]
        # What each row reads: its positions from its first free choice (after its forced
        # prefix) to its last fed token, flat over rows x width, eos banned below its minimum.
        reads: list[int] = []
        ban: list[bool] = []
        spans: list[tuple[int, int]] = []
        for r, (search, fed) in enumerate(zip(searches, lengths_fed, strict=True)):
            first = len(reads)
            for t in range(len(search.prefix), fed):
                reads.append(r * width + t)
                ban.append(search.options.bans_eos(t))
            spans.append((first, len(reads)))
        out = self.pool.prefill(
            enc,
            ids,
            mask,
            np.array([slot for own in owned for slot in own], dtype=np.int64),
            np.repeat(np.arange(len(searches)), [len(own) for own in owned]),
            np.array(reads, dtype=np.int64),
            np.array(ban, dtype=np.bool_),
            logits=any(search.needs_logits for search in searches),
        )
        steps = Steps()
        lengths: list[int] = []
        for r, search in enumerate(searches):
            start, draft = len(search.prefix), search.draft
            k0, k1 = spans[r]
            mine = StepOutput(
                out.ids[:, k0:k1],
                out.scores[:, k0:k1],
                None if out.logits is None else out.logits[:, k0:k1],
            )
            step, accepted = confirm(search, mine, 0, 0, draft)
            steps.add(search, r, step)
            search.accepted = accepted
            self.stats["draft_offered"] += len(draft)
            self.stats["draft_accepted"] += accepted
            if step is not None:
                lengths.extend([1 + start + accepted] * len(step.tokens))
        sources = enc.attention_mask.sum(axis=1)
        kept = set(steps.kept)
        new = _Rows(
            length=np.array(lengths, dtype=np.int64),
            next=np.array(steps.tokens, dtype=np.int64),
        )
        slots: list[int] = []
        for search, own in zip(searches, owned, strict=True):
            if search in kept:
                self._owned[search] = own
                self._wide += not isinstance(search, GreedySearch)
                slots.extend(own[: search.width])
        new.slot = np.array(slots, dtype=np.int64)
        new.source = sources[steps.select].astype(np.int64)
        minimum = [s.options.min_new_tokens for s in searches]
        new.minimum = np.array(minimum, dtype=np.int64)[steps.select]
        self.searches = [*self.searches, *steps.kept]
        self._rows.extend(new)
        return steps.ended

    def execute(self) -> None:
        if not self.searches:
            self._ahead = []
            return
        state = self._rows
        rows = len(state.slot)
        capacity = self.pool.shape.capacity
        most = min(LOOKAHEAD, self.lookahead_positions // rows)
        self._ahead = self._look_ahead(min(most, capacity - 1 - int(state.length.max())))
        length = state.length
        if self._ahead:
            ids, new = lookahead_rows(state.next, self._ahead, self.model.config.pad_token_id)
            ends = length + new.sum(axis=1)
        else:
            ids, ends = state.next[:, None], length + 1
        # Each token at its own position, padding too (distinct positions: one write
        # each), masked out and written again later.
        positions = length[:, None] + np.arange(ids.shape[1])[None, :]
        # A row sees its positions up to its last real new token.
        mask = np.arange(int(ends.max()))[None, :] < ends[:, None]
        source = state.source
        encoder_mask = (np.arange(int(source.max()))[None, :] < source[:, None]).astype(np.int64)
        logits = any(search.needs_logits for search in self.searches)
        # A position is also the tokens its row has there (its next token included): eos
        # is banned where that is short of the row's minimum.
        ban = positions < state.minimum[:, None]
        self._out = self.pool.step(
            np.ascontiguousarray(ids, dtype=np.int64),
            np.ascontiguousarray(positions, dtype=np.int64),
            mask.astype(np.int64),
            encoder_mask,
            state.slot,
            ban,
            logits=logits,
        )
        state.length = length + 1
