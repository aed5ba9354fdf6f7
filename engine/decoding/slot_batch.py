"""A continuous batch whose decoder state stays in KV slots (`engine.model.slots`).

Each running row owns a slot, given by the scheduling policy when its request joins:
its keys and values are written there by its prefill and by every step, at its own
absolute positions, and never move. A step sends each row's token, position and slot and
gets each row's argmax back; a search that needs more (a beam, a hook) gets its rows'
logits. So a step's cost does not grow with what the rows have decoded so far, and no
state is concatenated, copied or reallocated between steps.

Draft and lookahead are as in `engine.decoding.batch.ContinuousBatch`, with one
simplification the slots allow: a rejected lookahead token leaves nothing to squeeze, its
position is written again by the row's next token.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from engine.decoding.batch import LOOKAHEAD, DecodeBatch, Member, _Steps, stack_encoder_outputs
from engine.decoding.batch import _confirm as confirm_logits
from engine.decoding.search import Extension, Search
from engine.model.layouts import IntArray, MaskedDecoder
from engine.model.marian import MarianOnnx
from engine.model.slots import KvSlots, StepOutput


def _take(search: Search, out: StepOutput, row: int, position: int) -> Extension | None:
    """A one-row search's step from the model's choice at `position` of `row`."""
    if out.logits is not None and search.needs_logits:
        return search.observe(out.logits[row : row + 1, position])
    return search.take(int(out.ids[row, position]), float(out.scores[row, position]))


def _confirm(
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
        self.decoder = decoder
        self.pool = pool
        self.lookahead_positions = lookahead_positions if decoder.lookahead else 0
        self._owned: dict[Search, tuple[int, ...]] = {}  # each search's slots
        # Row by row: its slot, positions written (the next one's index), next token and
        # its source's length.
        self._slot: IntArray = np.zeros(0, dtype=np.int64)
        self._length: IntArray = np.zeros(0, dtype=np.int64)
        self._next: IntArray = np.zeros(0, dtype=np.int64)
        self._source: IntArray = np.zeros(0, dtype=np.int64)
        self._out: StepOutput | None = None  # the last step's, until `update` takes it

    @property
    def joinable(self) -> bool:
        return self._out is None

    def update(self) -> list[Search]:
        out, self._out = self._out, None
        if out is None:
            return []
        steps = _Steps()
        row = 0
        ahead = self._ahead
        for search in self.searches:
            width = search.width
            if ahead and ahead[row]:
                step, taken = _confirm(search, out, row, 0, ahead[row])
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
                self._length[r] += taken
            self.stats["lookahead_offered"] += sum(map(len, ahead))
            self.stats["lookahead_accepted"] += sum(taken for _, taken in steps.confirmed)
        self._ahead = []
        self.searches = steps.kept
        self._arrange(steps)
        return steps.ended

    def _arrange(self, steps: _Steps) -> None:
        """The rows of the searches kept, in their new order: a beam's row continues a
        parent row, whose state is copied into the row's own slot when it is another."""
        select = steps.select
        length, source = self._length[select], self._source[select]
        slots: list[int] = []
        sources: list[int] = []
        targets: list[int] = []
        for search in self.searches:
            own = self._owned[search]
            mine = own[: search.width]
            parents = self._slot[select[len(slots) : len(slots) + len(mine)]]
            for slot, parent in zip(mine, parents, strict=True):
                if slot != parent:
                    sources.append(int(parent))
                    targets.append(slot)
            slots.extend(mine)
        if targets:
            self.pool.copy(sources, targets, int(length.max()))
        self._slot = np.array(slots, dtype=np.int64)
        self._length, self._source = length, source
        self._next = np.array(steps.tokens, dtype=np.int64)

    def schedule(self, joining: Sequence[Member], leaving: Collection[Search] = ()) -> list[Search]:
        if self._out is not None:
            raise RuntimeError("schedule between execute and update")
        kept = self._without(leaving)
        if kept is not None:
            self._slot, self._length = self._slot[kept], self._length[kept]
            self._next, self._source = self._next[kept], self._source[kept]
        for search in leaving:
            self._owned.pop(search, None)
        if not joining:
            return []
        return self._prefill(joining)

    def _prefill(self, joining: Sequence[Member]) -> list[Search]:
        """One call over the newcomers (start token, forced prefix, draft; right-padded),
        their keys and values written into every slot they own; each takes its first
        step there and goes on through its draft while the draft is confirmed."""
        config = self.model.config
        searches = [member.search for member in joining]
        fed = [[config.decoder_start_token_id, *s.prefix, *s.draft] for s in searches]
        width = max(map(len, fed))
        ids = np.full((len(searches), width), config.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(searches), width), dtype=np.int64)
        for r, (search, row_ids) in enumerate(zip(searches, fed, strict=True)):
            ids[r, : len(row_ids)] = row_ids
            mask[r, : len(row_ids)] = 1
            search.start(len(search.prefix))
        enc = stack_encoder_outputs([member.enc for member in joining])
        needed = np.array([len(s.prefix) for s in searches], dtype=np.int64)
        logits, self_kv, cross_kv = self.decoder.prefill(enc, ids, mask, needed)
        owned = [tuple(member.slots) for member in joining]
        copies = np.repeat(np.arange(len(searches)), [len(o) for o in owned])
        self.pool.write(
            np.array([slot for own in owned for slot in own], dtype=np.int64),
            [a[copies] for a in self_kv],
            [a[copies] for a in cross_kv],
        )
        steps = _Steps()
        lengths: list[int] = []
        for r, search in enumerate(searches):
            start, draft = len(search.prefix), search.draft
            step, accepted = confirm_logits(search, logits[r, start:], draft)
            steps.add(search, r, step)
            search.accepted = accepted
            self.stats["draft_offered"] += len(draft)
            self.stats["draft_accepted"] += accepted
            if step is not None:
                lengths.extend([1 + start + accepted] * len(step.tokens))
        sources = enc.attention_mask.sum(axis=1)
        kept = set(steps.kept)
        new_slots: list[int] = []
        new_sources: list[int] = []
        for r, (search, own) in enumerate(zip(searches, owned, strict=True)):
            if search in kept:
                self._owned[search] = own
                new_slots.extend(own[: search.width])
                new_sources.extend([int(sources[r])] * search.width)
        self.searches = [*self.searches, *steps.kept]
        self._slot = np.concatenate([self._slot, np.array(new_slots, dtype=np.int64)])
        self._length = np.concatenate([self._length, np.array(lengths, dtype=np.int64)])
        self._next = np.concatenate([self._next, np.array(steps.tokens, dtype=np.int64)])
        self._source = np.concatenate([self._source, np.array(new_sources, dtype=np.int64)])
        return steps.ended

    def execute(self) -> None:
        if not self.searches:
            self._ahead = []
            return
        rows = len(self._slot)
        capacity = self.pool.shape.capacity
        most = min(LOOKAHEAD, self.lookahead_positions // rows)
        most = min(most, capacity - 1 - int(self._length.max()))
        self._ahead = []
        if most > 0:
            self._ahead = [[] for _ in range(rows)]
            row = 0
            for search in self.searches:
                self._ahead[row] = search.take_lookahead(most)  # a beam's: none
                row += search.width
        fed = 1 + max(map(len, self._ahead), default=0)
        length = self._length
        if fed == 1:
            ids = self._next[:, None]
            positions = length[:, None]
            new = np.ones((rows, 1), dtype=bool)
        else:
            ids = np.full((rows, fed), self.model.config.pad_token_id, dtype=np.int64)
            ids[:, 0] = self._next
            new = np.zeros((rows, fed), dtype=bool)
            new[:, 0] = True
            for r, looked in enumerate(self._ahead):
                ids[r, 1 : 1 + len(looked)] = looked
                new[r, 1 : 1 + len(looked)] = True
            # Each token at its own position, padding too (distinct positions: one
            # write each), masked out and written again later.
            positions = length[:, None] + np.arange(fed)[None, :]
        width = int(length.max()) + fed
        columns = np.arange(width)[None, :]
        mask = columns < length[:, None]
        ends = length + new.sum(axis=1)
        mask |= (columns >= length[:, None]) & (columns < ends[:, None])
        source = self._source
        encoder_mask = (np.arange(int(source.max()))[None, :] < source[:, None]).astype(np.int64)
        logits = any(search.needs_logits for search in self.searches)
        self._out = self.pool.step(
            np.ascontiguousarray(ids, dtype=np.int64),
            np.ascontiguousarray(positions, dtype=np.int64),
            mask.astype(np.int64),
            encoder_mask,
            self._slot,
            logits=logits,
        )
        self._length = length + 1
