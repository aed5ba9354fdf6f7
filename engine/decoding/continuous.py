"""The one batch, written once over any KV backend (`engine.model.kv`): over a `ragged`
backend searches join and leave at any step (iteration-level batching, as in Orca and
vLLM); over the stock graphs' (`engine.model.kv.lockstep`), whose rows advance together,
the same batch honours the backend's flag: newcomers join only an empty batch and are
fed their common prefix, the rest forced step by step, with neither draft nor lookahead.

What it does, whatever keeps the rows' state:

- **Prefill with drafts.** Newcomers are prefilled together (start token, forced prefix
  and draft, right-padded); each takes its first step there and goes on through its draft
  while the draft is confirmed (`confirm`), so only the tokens after the first
  disagreement cost a step each.
- **Lookahead.** When the step is small enough (`LOOKAHEAD_POSITIONS`, and what the
  backend allows: `KvBackend.lookahead_most`), a greedy row feeds its next token and the
  tokens its re-aligned draft expects after it (`Search.take_lookahead`) in the same
  cached step, and keeps the run its choice confirms.
- **Beams** reorder and widen their own rows: the backend keeps rows in the new order.
- **Early-eos bans** are the searches' (`DecodeOptions.bans_eos`); a backend whose model
  chooses (KV slots) applies the same rule in its graph.
- **The timeline's counts**: drafts and lookahead offered and accepted (`stats`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from engine.decoding.batch import DecodeBatch, Member, Steps, common_prefill_rows, prefill_rows
from engine.decoding.search import Extension, GreedySearch, Search
from engine.model.kv.base import (
    LOOKAHEAD,
    KvBackend,
    Newcomer,
    Output,
    Positions,
    StateBytes,
    positions_of,
)
from engine.model.kv.slots.pool import StepOutput
from engine.model.layouts import IntArray, stack_encoder_outputs
from engine.model.marian import MarianOnnx

__all__ = ["LOOKAHEAD", "ContinuousBatch", "confirm", "take"]


def take(search: Search, positions: Positions, index: int) -> Extension | None:
    """A one-row `search`'s step from position `index` of `positions`: the model's choice
    where it made one and the search takes it (greedy, no hook), else the logits."""
    if isinstance(search, GreedySearch) and not search.needs_logits:
        chosen = positions.choice(index)
        if chosen is not None:
            return search.take(*chosen)
    return search.observe(positions.logits(index))


def confirm(
    search: Search, positions: Positions, expected: Sequence[int]
) -> tuple[Extension | None, int]:
    """Let a one-row `search` observe consecutive positions of `positions` while the token it
    picks is the `expected` one fed there (a draft in the prefill, a lookahead in a step:
    the outputs after an expected token are what feeding it one step later would give,
    attention being causal). Returns its last step (None: it ended) and how many expected
    tokens it confirmed, whose KV the same call computed. A prefill's logits are projected
    as they are read: none past where this stops."""
    confirmed = 0
    while True:
        step = take(search, positions, confirmed)
        if step is None or confirmed >= len(expected) or step.tokens != [expected[confirmed]]:
            return step, confirmed
        confirmed += 1


class ContinuousBatch(DecodeBatch):
    """Searches that join and leave at any step over `kv`, the rows' KV backend (module
    docstring). `lookahead_positions`: extra positions a step may compute for tokens fed
    ahead (0: none; the scheduler sets it; none where the model's steps are not causal
    among new tokens)."""

    def __init__(self, model: MarianOnnx, kv: KvBackend, lookahead_positions: int = 0) -> None:
        super().__init__()
        self.model = model
        self.kv = kv
        masked = model.masked
        lookahead = masked is not None and masked.lookahead
        self.lookahead_positions = lookahead_positions if lookahead else 0
        self._next: IntArray = np.zeros(0, dtype=np.int64)  # each row's next token
        self._out: Output | None = None  # the last step's, until `update` takes it
        self._wide = 0  # searches that are not greedy (beams): rows that may reorder

    @property
    def joinable(self) -> bool:
        return self._out is None and (self.kv.ragged or not self.searches)

    def state_bytes(self) -> StateBytes | None:
        return self.kv.state_bytes()

    def quiet_in(self) -> float | None:
        return None if self.searches else self.kv.quiet_in()

    def settle(self) -> None:
        if not self.searches:
            self.kv.settle()

    def update(self) -> list[Search]:
        out, self._out = self._out, None
        if out is None:
            return []
        ahead, self._ahead = self._ahead, []
        if not ahead and not self._wide and isinstance(out, StepOutput) and out.logits is None:
            return self._take_choices(out)
        steps = Steps()
        row = 0
        for search in self.searches:
            width = search.width  # before the step: a beam widens
            if ahead and ahead[row]:  # a greedy row fed tokens ahead
                step, taken = confirm(search, positions_of(out, row), ahead[row])
                steps.confirmed.append((row, taken))
            elif isinstance(out, StepOutput):
                if width == 1:
                    step = take(search, positions_of(out, row), 0)
                else:
                    assert out.logits is not None
                    step = search.observe(out.logits[row : row + width, 0])
            else:
                step = search.observe(out[row : row + width, 0])
            steps.add(search, row, step)
            row += width
        if ahead:
            self.kv.confirmed(steps.confirmed)
            self._count_lookahead(ahead, steps)
        self._set_searches(steps.kept)
        self._next = np.array(steps.tokens, dtype=np.int64)
        self.kv.keep(steps.select, self.searches)
        return steps.ended

    def _take_choices(self, out: StepOutput) -> list[Search]:
        """The common step over a backend that chooses, kept lean (it runs once per
        token, for every row): each row a greedy search that takes the model's own
        choice, one position per row, the rows in place but those that ended."""
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
        self._next = np.array(tokens, dtype=np.int64)
        if gone:
            kept = np.ones(len(self.searches), dtype=bool)
            kept[gone] = False
            self.searches = [s for s, keep in zip(self.searches, kept, strict=True) if keep]
            self.kv.keep(np.flatnonzero(kept).tolist(), self.searches)
        return ended

    def _set_searches(self, searches: list[Search]) -> None:
        self.searches = searches
        self._wide = sum(not isinstance(s, GreedySearch) for s in searches)

    def schedule(self, joining: Sequence[Member], leaving: Collection[Search] = ()) -> list[Search]:
        if self._out is not None:
            raise RuntimeError("schedule between execute and update")
        select = self._without(leaving)
        if select is not None:
            self._set_searches(self.searches)
            self._next = self._next[select]
            self.kv.keep(select, self.searches)
        if not joining:
            return []
        ragged = self.kv.ragged
        if not ragged and self.searches:
            raise RuntimeError("a lockstep batch only takes searches when empty")
        searches = [member.search for member in joining]
        rows = prefill_rows if ragged else common_prefill_rows
        ids, mask = rows(searches, self.model.config)
        enc = stack_encoder_outputs([member.enc for member in joining])
        newcomers = self._newcomers(joining, mask)
        prefill = self.kv.prefill(newcomers, enc, ids, mask, alone=self.alone)
        steps = Steps()
        lengths: list[int] = []
        for r, (search, newcomer) in enumerate(zip(searches, newcomers, strict=True)):
            start = newcomer.start
            draft = search.draft if ragged else []
            step, accepted = confirm(search, prefill.positions(r, start), draft)
            steps.add(search, r, step)
            search.accepted = accepted
            self.stats["draft_offered"] += len(draft)
            self.stats["draft_accepted"] += accepted
            if step is not None:  # its rows' own positions: start token, prefix, confirmed
                lengths.extend([1 + start + accepted] * len(step.tokens))
        if steps.kept:
            self.kv.join(prefill, steps.select, np.array(lengths, dtype=np.int64), steps.kept)
            self._set_searches([*self.searches, *steps.kept])
            self._next = np.concatenate([self._next, np.array(steps.tokens, dtype=np.int64)])
        return steps.ended

    def _newcomers(self, joining: Sequence[Member], mask: IntArray) -> list[Newcomer]:
        """What the backend's prefill needs of each newcomer (`Newcomer`): the eos bans
        at the positions it reads only where the model chooses (the rule is the search
        options' `bans_eos`)."""
        fed = mask.sum(axis=1).tolist() if self.kv.chooses else [0] * len(joining)
        start = len(mask[0]) - 1  # not ragged: every newcomer's common prefix
        newcomers = []
        for member, length in zip(joining, fed, strict=True):
            search = member.search
            if self.kv.ragged:
                start = len(search.prefix)
            bans = tuple(search.options.bans_eos(t) for t in range(start, length))
            newcomers.append(
                Newcomer(
                    start,
                    tuple(member.slots),
                    search.options.min_new_tokens,
                    bans,
                    search.needs_logits,
                )
            )
        return newcomers

    def execute(self) -> None:
        if not self.searches:
            self._ahead, self._next = [], self._next[:0]
            self.kv.release()
            return
        most = self.kv.lookahead_most(len(self._next), self.lookahead_positions)
        self._ahead = self._look_ahead(min(LOOKAHEAD, most))
        logits = self.kv.chooses and any(search.needs_logits for search in self.searches)
        self._out = self.kv.step(self._next, self._ahead, logits=logits, alone=self.alone)
