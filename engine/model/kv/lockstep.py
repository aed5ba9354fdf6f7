"""The lockstep KV backend: the stock decoder graphs (`MarianOnnx.prefill` and `step`),
`engine.model.backend.Backend.LOCKSTEP`, for a model whose decoder could not be rewritten
with masks, or with continuous batching turned off.

The stock graphs take each row's positions from the cache's one past length and have no
self-attention mask, so every row must keep one length: the backend is not `ragged`. The
one continuous batch honours that through the flag (`KvBackend.ragged`): newcomers join
only an empty batch, are fed the start token and their common prefix (the rest of each
prefix forced step by step, no draft), and no step feeds tokens ahead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.model.kv.base import KvBackend, Newcomer, Output, Owner, Prefill
from engine.model.layouts import DecoderCache, EncoderOutput, IntArray
from engine.model.logits import RowLogits
from engine.model.marian import MarianOnnx


class LockstepKv(KvBackend):
    """Rows of one length over the stock graphs' cache (module docstring)."""

    ragged = False

    def __init__(self, model: MarianOnnx) -> None:
        self.model = model
        self._enc: EncoderOutput | None = None
        self._cache: DecoderCache | None = None

    def lookahead_most(self, rows: int, budget: int) -> int:
        """None: a token fed ahead would need its own position and a mask to undo."""
        return 0

    def prefill(
        self,
        newcomers: Sequence[Newcomer],
        enc: EncoderOutput,
        ids: IntArray,
        mask: IntArray,
        *,
        alone: bool,
    ) -> Prefill:
        """`ids` unpadded (the batch feeds every newcomer the same length: `ragged`)."""
        if not mask.all():
            raise ValueError("a lockstep prefill takes rows of one length, unpadded")
        logits, cache = self.model.prefill(enc, ids)
        return Prefill((enc, cache), logits=RowLogits.whole(logits))

    def join(
        self,
        prefill: Prefill,
        select: Sequence[int],
        lengths: IntArray,
        owners: Sequence[Owner],
    ) -> None:
        if self._cache is not None and self._cache.tokens.shape[0]:
            raise RuntimeError("a lockstep batch only takes rows when empty")
        self._enc, self._cache = prefill.pending
        self._select(select)

    def step(
        self,
        next_ids: IntArray,
        ahead: Sequence[Sequence[int]],
        *,
        logits: bool,
        alone: bool,
    ) -> Output:
        assert self._enc is not None and self._cache is not None
        assert not any(ahead), "a lockstep step feeds no token ahead"
        out, self._cache = self.model.step(self._enc, self._cache, next_ids[:, None])
        return out[:, None, :]  # one position per row

    def confirmed(self, confirmed: Sequence[tuple[int, int]]) -> None:
        """Nothing is fed ahead (`lookahead_most`)."""

    def keep(self, select: Sequence[int], owners: Sequence[Owner]) -> None:
        self._select(select)

    def release(self) -> None:
        self._enc = self._cache = None

    def _select(self, select: Sequence[int]) -> None:
        assert self._cache is not None and self._enc is not None
        if len(select) == self._cache.tokens.shape[0] and list(select) == list(range(len(select))):
            return
        rows: IntArray = np.array(select, dtype=np.int64)
        self._cache, self._enc = self._cache.select(rows), self._enc.select(rows)
