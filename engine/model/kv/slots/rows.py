"""The KV backend whose rows' decoder state stays in KV slots (`engine.model.kv.slots.pool`):
`engine.model.backend.Backend.SLOTS`, a GPU's default.

Each running row owns a slot, given by the scheduler's slot manager when its request
joins (`engine.model.kv.slots.manager`): its keys and values are written there by its prefill
and by every step, at its own absolute positions, and never move. A step sends each row's
token, position and slot and gets each row's choice back (the model chooses, eos banned
below a row's minimum length as `DecodeOptions.bans_eos` says); a search that needs more
(a beam, a hook) gets its rows' logits. No state is concatenated, reallocated or sent
between steps; a beam's reordered rows copy their parents' state between slots. (Reading
a row's positions is a `Gather` inside the graph, which on the CPU copies them as a
concatenation would: docs/performance.md#kv-slots.) A rejected lookahead token leaves
nothing to squeeze: its position is written again by the row's next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.model.kv.base import KvBackend, Newcomer, Output, Owner, Prefill, lookahead_rows
from engine.model.kv.slots.pool import KvSlots
from engine.model.layouts import EncoderOutput, IntArray
from engine.model.marian import MarianOnnx


@dataclass
class _Rows:
    """The rows, as arrays: each row's slot, positions written (the next one's index),
    source length and minimum length (`min_new_tokens`)."""

    slot: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    length: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    source: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    minimum: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def take(self, select: Sequence[int]) -> None:
        """Keep these rows, in this order."""
        rows = np.asarray(select, dtype=np.int64)
        for name in ("slot", "length", "source", "minimum"):
            setattr(self, name, getattr(self, name)[rows])

    def extend(self, other: _Rows) -> None:
        for name in ("slot", "length", "source", "minimum"):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(other, name)]))


@dataclass(frozen=True)
class _Joining:
    """What a prefill keeps for `SlotKv.join`: each newcomer's slots, source length and
    minimum length, by prefill row."""

    slots: tuple[tuple[int, ...], ...]
    sources: IntArray
    minimum: IntArray


class SlotKv(KvBackend):
    """Rows in KV slots of `pool` (module docstring). The slots of a `Newcomer` are its
    request's, one per row it may hold (a beam's width)."""

    chooses = True

    def __init__(self, model: MarianOnnx, pool: KvSlots) -> None:
        self.model = model
        self.pool = pool
        self._owned: dict[Owner, tuple[int, ...]] = {}  # each row group's slots
        self._rows = _Rows()

    def lookahead_most(self, rows: int, budget: int) -> int:
        """The step's budget shared by its rows, and no position past a slot's capacity."""
        longest = int(self._rows.length.max(initial=0))
        return min(budget // rows, self.pool.shape.capacity - 1 - longest)

    def prefill(
        self,
        newcomers: Sequence[Newcomer],
        enc: EncoderOutput,
        ids: IntArray,
        mask: IntArray,
        *,
        alone: bool,
    ) -> Prefill:
        """The newcomers' keys and values written into every slot they own; what each
        row reads chosen in the graph: its positions from its first free choice (after
        its forced prefix) to its last fed token, flat over rows x width, eos banned
        where its `bans` say."""
        width = ids.shape[1]
        reads: list[int] = []
        ban: list[bool] = []
        firsts: list[int] = []
        for r, newcomer in enumerate(newcomers):
            firsts.append(len(reads))
            reads.extend(r * width + newcomer.start + t for t in range(len(newcomer.bans)))
            ban.extend(newcomer.bans)
        out = self.pool.prefill(
            enc,
            ids,
            mask,
            np.array([slot for n in newcomers for slot in n.slots], dtype=np.int64),
            np.repeat(np.arange(len(newcomers)), [len(n.slots) for n in newcomers]),
            np.array(reads, dtype=np.int64),
            np.array(ban, dtype=np.bool_),
            logits=any(newcomer.logits for newcomer in newcomers),
        )
        pending = _Joining(
            tuple(newcomer.slots for newcomer in newcomers),
            enc.attention_mask.sum(axis=1).astype(np.int64),
            np.array([newcomer.minimum for newcomer in newcomers], dtype=np.int64),
        )
        return Prefill(pending, choices=out, firsts=tuple(firsts))

    def join(
        self,
        prefill: Prefill,
        select: Sequence[int],
        lengths: IntArray,
        owners: Sequence[Owner],
    ) -> None:
        pending: _Joining = prefill.pending
        slots: list[int] = []
        row = 0
        for owner in owners:  # each owner's rows are consecutive in `select`
            own = self._owned[owner] = pending.slots[select[row]]
            slots.extend(own[: owner.width])
            row += owner.width
        rows = np.asarray(select, dtype=np.int64)
        self._rows.extend(
            _Rows(
                np.array(slots, dtype=np.int64),
                lengths.astype(np.int64),
                pending.sources[rows],
                pending.minimum[rows],
            )
        )

    def step(
        self,
        next_ids: IntArray,
        ahead: Sequence[Sequence[int]],
        *,
        logits: bool,
        alone: bool,
    ) -> Output:
        state = self._rows
        length = state.length
        if ahead:
            ids, new = lookahead_rows(next_ids, ahead, self.model.config.pad_token_id)
            ends = length + new.sum(axis=1)
        else:
            ids, ends = next_ids[:, None], length + 1
        # Each token at its own position, padding too (distinct positions: one write
        # each), masked out and written again later.
        positions = length[:, None] + np.arange(ids.shape[1])[None, :]
        # A row sees its positions up to its last real new token.
        mask = np.arange(int(ends.max()))[None, :] < ends[:, None]
        source = state.source
        encoder_mask = (np.arange(int(source.max()))[None, :] < source[:, None]).astype(np.int64)
        # A position is also the tokens its row has there (its next token included): eos
        # is banned where that is short of the row's minimum.
        ban = positions < state.minimum[:, None]
        out = self.pool.step(
            np.ascontiguousarray(ids, dtype=np.int64),
            np.ascontiguousarray(positions, dtype=np.int64),
            mask.astype(np.int64),
            encoder_mask,
            state.slot,
            ban,
            logits=logits,
        )
        state.length = length + 1
        return out

    def confirmed(self, confirmed: Sequence[tuple[int, int]]) -> None:
        for row, taken in confirmed:
            self._rows.length[row] += taken

    def keep(self, select: Sequence[int], owners: Sequence[Owner]) -> None:
        """The rows of `owners`, in their new order: a beam's row continues a parent
        row, whose state is copied into the row's own slot when it is another."""
        rows = self._rows
        if len(self._owned) != len(owners):  # row groups left: their slots are not theirs
            self._owned = {owner: self._owned[owner] for owner in owners}
        parents = rows.slot[np.asarray(select, dtype=np.int64)]
        rows.take(select)
        rows.slot = np.array(
            [slot for owner in owners for slot in self._owned[owner][: owner.width]],
            dtype=np.int64,
        )
        moved = np.flatnonzero(rows.slot != parents)
        if moved.size:
            positions = int(rows.length[moved].max())
            self.pool.copy(parents[moved].tolist(), rows.slot[moved].tolist(), positions)

    def release(self) -> None:
        self._owned, self._rows = {}, _Rows()
