"""The lockstep batch: rows that start together and keep one decoder length, over the
stock decoder graphs (a model whose decoder could not be rewritten with masks, or
continuous batching turned off: `engine.model.backend`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from engine.decoding.batch import DecodeBatch, Member
from engine.decoding.search import Search
from engine.model.layouts import DecoderCache, EncoderOutput, IntArray, stack_encoder_outputs
from engine.model.marian import MarianOnnx


class LockstepBatch(DecodeBatch):
    """Rows that start together and keep one decoder length, for the stock decoder graphs.

    The searches' common prefix length goes in the prefill call and the rest of each
    prefix is forced step by step (`Search.start`); searches join only when the batch is
    empty, and leave at any step."""

    def __init__(self, model: MarianOnnx) -> None:
        super().__init__()
        self.model = model
        self._enc: EncoderOutput | None = None
        self._cache: DecoderCache | None = None
        self._next: IntArray | None = None

    @property
    def joinable(self) -> bool:
        return not self.searches

    def update(self) -> list[Search]:
        if self._logits is None:
            return []
        logits, self._logits = self._logits, None
        steps = self._observe(logits)
        self._select(steps.select)
        self._next = np.array(steps.tokens, dtype=np.int64)[:, None]
        return steps.ended

    def schedule(self, joining: Sequence[Member], leaving: Collection[Search] = ()) -> list[Search]:
        select = self._without(leaving)
        if select is not None:
            assert self._next is not None
            self._next = self._next[select]
            self._select(select)
        if not joining:
            return []
        if self.searches:
            raise RuntimeError("a lockstep batch only takes searches when empty")
        searches = [member.search for member in joining]
        common = min(len(s.prefix) for s in searches)
        start = self.model.config.decoder_start_token_id
        for search in searches:
            search.start(common)
        ids = np.array([[start, *s.prefix[:common]] for s in searches], dtype=np.int64)
        enc = stack_encoder_outputs([member.enc for member in joining])
        logits, cache = self.model.prefill(enc, ids)
        self.searches, self._enc, self._cache = searches, enc, cache
        self._logits = logits[:, -1:, :]
        return self.update()

    def _select(self, select: list[int]) -> None:
        assert self._cache is not None and self._enc is not None
        if select == list(range(self._cache.tokens.shape[0])):
            return
        rows: IntArray = np.array(select, dtype=np.int64)
        self._cache, self._enc = self._cache.select(rows), self._enc.select(rows)

    def execute(self) -> None:
        if not self.searches:
            self._enc = self._cache = self._next = None
            return
        assert self._enc is not None and self._cache is not None and self._next is not None
        logits, self._cache = self.model.step(self._enc, self._cache, self._next)
        self._logits = logits[:, None, :]  # one position per row
