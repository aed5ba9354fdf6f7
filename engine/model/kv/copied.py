"""The KV backend that hands every row's keys and values to each step and gets them back
one position longer (the masked decoder's `step`): `engine.model.backend.Backend.COPIED`.

Each row has its own length and its own real slots in one shared self-KV array
(`engine.model.kv.arrays.RowState`). Newcomers' slots are placed at the end of the batch's
(right-aligned), so that every later step appends one slot for everyone. A step with
lookahead pads every row to the longest; the slots of rejected tokens are masked out like
padding, and those holes are squeezed out once they outnumber the real slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.model.kv.arrays import RowState, position_bytes, prefilled, spanned
from engine.model.kv.base import (
    LOOKAHEAD,
    KvBackend,
    Newcomer,
    Output,
    Owner,
    Prefill,
    StateBytes,
    lookahead_rows,
    masked_prefill,
)
from engine.model.layouts import EncoderOutput, IntArray
from engine.model.marian import MarianOnnx
from engine.model.masked import MaskedDecoder


class CopiedKv(KvBackend):
    """Rows' state copied through every step (module docstring)."""

    def __init__(self, model: MarianOnnx, decoder: MaskedDecoder) -> None:
        self.model = model
        self.decoder = decoder
        self.state: RowState | None = None
        self._fed = 1  # tokens the last step fed per row: 1, or more with lookahead

    def lookahead_most(self, rows: int, budget: int) -> int:
        """Every row of a step is padded to the longest: the budget is shared."""
        return budget // rows

    def state_bytes(self) -> StateBytes | None:
        """The self-attention slots the rows' masks mark real and the sources' real
        positions (`live`); the arrays, padding and holes included (`reserved`)."""
        state = self.state
        if state is None or not state.lengths.size:
            return StateBytes(0, 0)
        live = int(state.real.sum()) * position_bytes(state.self_kv)
        live += int(state.enc.attention_mask.sum()) * position_bytes(state.cross_kv)
        return StateBytes(live, spanned((*state.self_kv, *state.cross_kv)))

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
        enc, self_kv, cross_kv = prefill.pending
        new = prefilled(enc, self_kv, cross_kv, select, lengths)
        if self.state is None or not self.state.lengths.size:
            self.state = new
        else:
            self.state.extend(new)

    def step(
        self,
        next_ids: IntArray,
        ahead: Sequence[Sequence[int]],
        *,
        logits: bool,
        alone: bool,
    ) -> Output:
        state = self.state
        assert state is not None
        rows = len(next_ids)
        fed = self._fed = 1 + max(map(len, ahead), default=0)
        if fed == 1:  # no lookahead: the common step, kept lean (it runs once per token)
            mask = np.concatenate([state.real, np.ones((rows, 1), dtype=np.int64)], axis=1)
            positions = state.lengths.reshape(-1, 1)
            out, state.self_kv = self.decoder.step(
                state.enc,
                next_ids[:, None],
                positions,
                mask,
                state.self_kv,
                state.cross_kv,
                alone=alone,
            )
            state.real, state.lengths = mask, state.lengths + 1
            return out[:, None, :]  # one position per row
        ids, new = lookahead_rows(next_ids, ahead, self.model.config.pad_token_id)
        # Each row's own positions; padding gets any in-range one (its own next).
        positions = state.lengths[:, None] + np.arange(fed)[None, :] * new
        mask = np.concatenate([state.real, new], axis=1)
        out, state.self_kv = self.decoder.step(
            state.enc, ids, positions, mask, state.self_kv, state.cross_kv, alone=alone
        )
        state.real, state.lengths = mask, state.lengths + 1
        return out

    def confirmed(self, confirmed: Sequence[tuple[int, int]]) -> None:
        """The slots after a row's last confirmed token are masked out (rejected
        lookahead)."""
        state = self.state
        assert state is not None
        fed, width = self._fed, state.real.shape[1]
        for row, taken in confirmed:
            state.real[row, width - fed + 1 + taken :] = 0
            state.lengths[row] += taken

    def keep(self, select: Sequence[int], owners: Sequence[Owner]) -> None:
        state = self.state
        assert state is not None
        state.select(list(select))
        # Only rejected lookahead leaves holes (a join right-aligns, `select` trims).
        real = state.real
        if self._fed > 1 and real.shape[1] > 2 * int(real.sum(axis=1).max(initial=0)) + LOOKAHEAD:
            state.squeeze()

    def release(self) -> None:
        self.state = None
