"""The continuous batch whose rows' keys and values are handed to every step and come
back one position longer (the KV backend `COPIED`, `engine.model.backend`): the base
the in-place batch (`engine.decoding.inplace_batch`) keeps its rows over."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from engine.decoding.batch import (
    LOOKAHEAD,
    DecodeBatch,
    Member,
    StateBytes,
    Steps,
    confirm,
    lookahead_rows,
    prefill_rows,
    stack_encoder_outputs,
)
from engine.decoding.rows import RowState, position_bytes, spanned
from engine.decoding.search import Search
from engine.model.layouts import IntArray
from engine.model.marian import MarianOnnx
from engine.model.masked import MaskedDecoder


class ContinuousBatch(DecodeBatch):
    """A batch that searches join and leave at any step (iteration-level batching).

    Needs the rewritten decoder (`MaskedDecoder`): each row has its own length and its own
    real slots in one shared self-KV array (`RowState`). Newcomers are prefilled together
    (right-padded), then their slots are placed at the end of the batch's (right-aligned),
    so that every later step appends one slot for everyone.

    Draft: a newcomer's prefill also feeds its draft; it keeps observing positions there
    while its token equals the draft's (`_confirm`), so only the tokens after the first
    disagreement cost a step each. Lookahead: when the step is small enough
    (`LOOKAHEAD_POSITIONS`), a greedy row feeds its next token and the tokens its
    re-aligned draft expects after it (`Search.take_lookahead`) in the same cached step,
    every row padded to the longest, and keeps the run its argmax confirms. The slots of
    rejected tokens are masked out like padding; those holes are squeezed out once they
    outnumber the real slots.
    """

    def __init__(
        self, model: MarianOnnx, decoder: MaskedDecoder, lookahead_positions: int = 0
    ) -> None:
        super().__init__()
        self.model = model
        self.decoder = decoder
        # Extra positions a step may compute for lookahead (0: none; the scheduler sets it).
        self.lookahead_positions = lookahead_positions if decoder.lookahead else 0
        self._slots: RowState | None = None
        self._fed = 1  # tokens the last step fed per row: 1, or more with lookahead

    @property
    def joinable(self) -> bool:
        return self._logits is None

    def update(self) -> list[Search]:
        """The searches observe the last step's logits; the rows' state keeps what they
        confirmed of a lookahead (`_confirmed`), then the rows still running, in their
        new order, with their next tokens (`_keep`). One skeleton for this batch and
        `InPlaceBatch`, which keep their rows' state differently."""
        if self._logits is None:
            return []
        logits, self._logits = self._logits, None
        steps = self._observe(logits, self._ahead)
        if self._fed > 1:
            self._confirmed(steps.confirmed)
            self._count_lookahead(self._ahead, steps)
        self._keep(steps.select, np.array(steps.tokens, dtype=np.int64).reshape(-1, 1))
        return steps.ended

    def state_bytes(self) -> StateBytes | None:
        """The self-attention slots the rows' masks mark real and the sources' real
        positions (`live`); the arrays, padding and holes included (`reserved`)."""
        state = self._slots
        if state is None or not self.searches:
            return StateBytes(0, 0)
        live = int(state.real.sum()) * position_bytes(state.self_kv)
        live += int(state.enc.attention_mask.sum()) * position_bytes(state.cross_kv)
        return StateBytes(live, spanned((*state.self_kv, *state.cross_kv)))

    def _confirmed(self, confirmed: Sequence[tuple[int, int]]) -> None:
        """After a step fed rows tokens ahead: each (row, tokens it confirmed). The slots
        after a row's last confirmed token are masked out (rejected lookahead)."""
        state = self._slots
        assert state is not None
        fed, width = self._fed, state.real.shape[1]
        for row, taken in confirmed:
            state.real[row, width - fed + 1 + taken :] = 0
            state.lengths[row] += taken

    def _keep(self, select: list[int], tokens: IntArray) -> None:
        """Keep the rows `select` names, in its order, each going on with `tokens` [rows, 1]."""
        state = self._slots
        assert state is not None
        state.select(select)
        state.next = tokens
        # Only rejected lookahead leaves holes (a join right-aligns, `select` trims).
        real = state.real
        if self._fed > 1 and real.shape[1] > 2 * int(real.sum(axis=1).max(initial=0)) + LOOKAHEAD:
            state.squeeze()

    def schedule(self, joining: Sequence[Member], leaving: Collection[Search] = ()) -> list[Search]:
        if self._logits is not None:
            raise RuntimeError("schedule between execute and update")
        select = self._without(leaving)
        if select is not None:
            assert self._slots is not None
            self._slots.select(select)
        if not joining:
            return []
        ended, kept, slots = self._prefill(joining)
        if kept:
            if self.searches and self._slots is not None:
                self._slots.extend(slots)
            else:
                self._slots = slots
            self.searches = [*self.searches, *kept]
        return ended

    def _prefill(self, joining: Sequence[Member]) -> tuple[list[Search], list[Search], RowState]:
        """One call over the newcomers: start token, forced prefix and draft, right-padded.
        Each takes its first step there and goes on through its draft while the draft is
        confirmed. Returns those that ended, those that go on and their rows' state."""
        searches = [member.search for member in joining]
        ids, mask = prefill_rows(searches, self.model.config)
        width = ids.shape[1]
        enc = stack_encoder_outputs([member.enc for member in joining])
        needed = np.array([len(s.prefix) for s in searches], dtype=np.int64)
        logits, self_kv, cross_kv = self.decoder.prefill(enc, ids, mask, needed, alone=self.alone)
        steps = Steps()
        real = np.zeros(len(searches), dtype=np.int64)  # valid slots per prefilled row
        for r, search in enumerate(searches):
            start, draft = len(search.prefix), search.draft
            step, accepted = confirm(search, logits.row(r, start), draft)
            steps.add(search, r, step)
            real[r] = 1 + start + accepted
            search.accepted = accepted
            self.stats["draft_offered"] += len(draft)
            self.stats["draft_accepted"] += accepted
        used = (np.arange(width)[None, :] < real[:, None]).astype(np.int64)
        next_ids = np.zeros((len(searches), 1), dtype=np.int64)
        slots = RowState(enc, self_kv, cross_kv, used, real, next_ids)
        slots.select(steps.select)
        slots.next = np.array(steps.tokens, dtype=np.int64).reshape(-1, 1)
        return steps.ended, steps.kept, slots

    def execute(self) -> None:
        if not self.searches:
            self._slots, self._ahead = None, []
            return
        state = self._slots
        assert state is not None
        rows = state.real.shape[0]
        self._ahead = self._look_ahead(min(LOOKAHEAD, self.lookahead_positions // rows))
        fed = self._fed = 1 + max(map(len, self._ahead), default=0)
        if fed == 1:  # no lookahead: the common step, kept lean (it runs once per token)
            mask = np.concatenate([state.real, np.ones((rows, 1), dtype=np.int64)], axis=1)
            positions = state.lengths.reshape(-1, 1)
            logits, state.self_kv = self.decoder.step(
                state.enc,
                state.next,
                positions,
                mask,
                state.self_kv,
                state.cross_kv,
                alone=self.alone,
            )
            self._logits = logits[:, None, :]  # one position per row
            state.real, state.lengths = mask, state.lengths + 1
            return
        ids, new = lookahead_rows(state.next[:, 0], self._ahead, self.model.config.pad_token_id)
        # Each row's own positions; padding gets any in-range one (its own next).
        positions = state.lengths[:, None] + np.arange(fed)[None, :] * new
        mask = np.concatenate([state.real, new], axis=1)
        self._logits, state.self_kv = self.decoder.step(
            state.enc, ids, positions, mask, state.self_kv, state.cross_kv, alone=self.alone
        )
        state.real, state.lengths = mask, state.lengths + 1
