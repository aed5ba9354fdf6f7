"""Batches: the rows of many searches run through shared decoder calls.

A scheduler lane drives its batch through the same cycle whatever its kind
(`DecodeBatch`), so that it never asks which kind it holds or what shape a call returned:

1. `update()`: each search takes its rows' logits from the last call; those that ended leave;
2. `schedule(joining, leaving)`: searches whose request was aborted leave, new ones join
   (prefilled in one call: start token, forced prefix, draft) and take their first step;
3. `execute()`: one decoder call over every live row.

`LockstepBatch` runs the stock decoder graphs, which take positions from the past length
and have no self-attention mask, so all its rows keep one length: searches join only an
empty batch. `ContinuousBatch` runs the rewritten decoder (`MaskedDecoder`: positions per
row, a mask over cache slots), so searches join and leave at any step (iteration-level
batching, as in Orca and vLLM). The encoder runs once per source, before: a search joins
with its source's encoder output. On the CPU its rows' self-attention state stays in the
lane's buffers, extended in place (`engine.decoding.inplace_batch.InPlaceBatch`); over KV
slots, `engine.decoding.slot_batch.SlotBatch`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from engine.decoding.search import Extension, Search
from engine.model.config import ModelConfig
from engine.model.layouts import (
    DecoderCache,
    EncoderOutput,
    FloatArray,
    IntArray,
    MaskedDecoder,
    RowRun,
)
from engine.model.marian import MarianOnnx


class Member(NamedTuple):
    """A search joining a batch, with the encoder output of its one source and, for a
    batch that keeps rows in KV slots (`engine.decoding.slot_batch`), the slots its
    request was given (one per row it may hold)."""

    search: Search
    enc: EncoderOutput
    slots: tuple[int, ...] = ()


LOOKAHEAD = 4
"""Draft tokens a greedy row may have verified in one cached step, after the draft was
re-aligned (`GreedySearch.take_lookahead`): on the committed fixture logs, longer runs
confirm almost nothing more (examples/benchmarks/draft_bound.py)."""

LOOKAHEAD_POSITIONS = 4
"""Extra positions one cached step may compute for looked-ahead tokens, over all its rows.
Every row of a step is padded to the longest row's positions, so a lookahead costs each
row of the batch: an extra position is cheap next to a saved step for a lone row, but at
many rows one more position each costs more than the step it could save for one of them.
So a lone row looks 4 ahead, 2 rows 2 each, 3-4 rows 1 and a busier step none:
speculation pays at low load, as in LLM serving; a larger budget gained nothing under
load (examples/benchmarks/capacity.py measures it)."""


def stack_encoder_outputs(outputs: Sequence[EncoderOutput]) -> EncoderOutput:
    """One batch from single-source outputs of different lengths: right-padded with zeros
    and `attention_mask` 0, which cross-attention ignores exactly."""
    width = max(int(o.hidden_states.shape[1]) for o in outputs)
    rows = sum(o.batch_size for o in outputs)
    first = outputs[0].hidden_states
    hidden = np.zeros((rows, width, first.shape[2]), dtype=first.dtype)
    mask = np.zeros((rows, width), dtype=np.int64)
    r = 0
    for o in outputs:
        n, length = o.batch_size, int(o.hidden_states.shape[1])
        hidden[r : r + n, :length] = o.hidden_states
        mask[r : r + n, :length] = o.attention_mask
        r += n
    return EncoderOutput(hidden, mask)


@dataclass
class _Steps:
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


def _confirm(
    search: Search, logits: FloatArray | RowRun, expected: Sequence[int]
) -> tuple[Extension | None, int]:
    """Let a one-row `search` observe consecutive positions of `logits` [positions, vocab]
    while the token it picks is the `expected` one fed there (a draft in the prefill, a
    lookahead in a step: the logits after an expected token are what feeding it one step
    later would give, attention being causal). Returns its last step (None: it ended) and
    how many expected tokens it confirmed, whose KV the same call computed. A prefill's
    `RowRun` projects positions as they are read: none past where this stops."""
    confirmed = 0
    while True:
        step = search.observe(logits[confirmed][None])
        if step is None or confirmed >= len(expected) or step.tokens != [expected[confirmed]]:
            return step, confirmed
        confirmed += 1


class StateBytes(NamedTuple):
    """A batch's decoder state in bytes: `live`, what its rows' positions and sources
    occupy now; `reserved`, what the arrays holding them span (buffers kept for more rows
    and positions than run now: their pages are mapped as they are written, so resident
    memory lies between the two)."""

    live: int
    reserved: int


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

    def _observe(self, logits: FloatArray, ahead: Sequence[Sequence[int]]) -> _Steps:
        """Each search observes its rows' logits [rows, positions, vocab]: a greedy row fed
        `ahead[row]` after its own token confirms them position by position, every other
        row reads its first position. `searches` keeps the searches still running."""
        steps = _Steps()
        row = 0
        for search in self.searches:
            width = search.width  # before the step: a beam widens
            if ahead and ahead[row]:  # a greedy row fed tokens ahead
                step, taken = _confirm(search, logits[row], ahead[row])
                steps.confirmed.append((row, taken))
            else:
                step = search.observe(logits[row : row + width, 0])
            steps.add(search, row, step)
            row += width
        self.searches = steps.kept
        return steps

    def _count_lookahead(self, ahead: Sequence[Sequence[int]], steps: _Steps) -> None:
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
        steps = self._observe(logits, ())
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


def lookahead_rows(
    next_ids: IntArray, ahead: Sequence[Sequence[int]], pad: int
) -> tuple[IntArray, IntArray]:
    """What a step with lookahead feeds: each row's next token (`next_ids` [B]) then its
    `ahead` tokens, right-padded with `pad` (`ids` [B, T]), and `new` [B, T], 1 on the
    real ones."""
    rows, fed = len(next_ids), 1 + max(map(len, ahead))
    ids = np.full((rows, fed), pad, dtype=np.int64)
    new = np.zeros((rows, fed), dtype=np.int64)
    ids[:, 0], new[:, 0] = next_ids, 1
    for r, looked in enumerate(ahead):
        ids[r, 1 : 1 + len(looked)] = looked
        new[r, 1 : 1 + len(looked)] = 1
    return ids, new


def prefill_rows(searches: Sequence[Search], config: ModelConfig) -> tuple[IntArray, IntArray]:
    """What a continuous batch's prefill feeds its newcomers, right-padded: the start token,
    forced prefix and draft of each (`ids`, with `mask` 1 on real tokens); each search is
    told that its whole prefix went in (`Search.start`)."""
    fed = [[config.decoder_start_token_id, *s.prefix, *s.draft] for s in searches]
    width = max(map(len, fed))
    ids = np.full((len(searches), width), config.pad_token_id, dtype=np.int64)
    mask = np.zeros((len(searches), width), dtype=np.int64)
    for r, (search, row_ids) in enumerate(zip(searches, fed, strict=True)):
        ids[r, : len(row_ids)] = row_ids
        mask[r, : len(row_ids)] = 1
        search.start(len(search.prefix))
    return ids, mask


def _stacked(
    parts: Sequence[npt.NDArray[Any]], size: int, *, axis: int, left: bool = False
) -> npt.NDArray[Any]:
    """`parts` one after the other along axis 0, each padded with zeros along `axis` to
    `size` (on the left or the right), in one new array.

    Why not pad each and concatenate: that holds the state three times at once (the rows,
    their padded copies and the result), and a join is when a batch's state is largest."""
    shape = list(parts[0].shape)
    shape[0], shape[axis] = sum(p.shape[0] for p in parts), size
    out = np.empty(shape, dtype=parts[0].dtype)
    row = 0
    for part in parts:
        rows, have = part.shape[0], part.shape[axis]
        real = [slice(row, row + rows)] + [slice(None)] * (out.ndim - 1)
        pad = list(real)
        real[axis] = slice(size - have, size) if left else slice(0, have)
        pad[axis] = slice(0, size - have) if left else slice(have, size)
        out[tuple(real)] = part
        out[tuple(pad)] = 0
        row += rows
    return out


def _kept(arrays: tuple[FloatArray, ...], rows: IntArray) -> tuple[FloatArray, ...]:
    """`a[rows]` of each array. Where `rows` only drops some (increasing), in place: the
    rows after the first gap move down and the result views the first `len(rows)`.

    Why: rows leave at most steps of a busy batch, and copying every other row's keys and
    values each time held the state twice, in fresh blocks, at the moment of the copy
    (memray at the peak of a 32-stream `capacity.py` run: 69 of 253 MB). Only for arrays
    the batch owns: its decoder calls' outputs and its own `_stacked` results."""
    if rows.size == 0 or bool(np.any(rows[1:] <= rows[:-1])):
        return tuple(a[rows] for a in arrays)
    moved = np.flatnonzero(rows != np.arange(rows.size))
    if moved.size == 0:
        return tuple(a[: rows.size] for a in arrays)
    first = int(moved[0])
    for a in arrays:
        a[first : rows.size] = a[rows[first:]]
    return tuple(a[: rows.size] for a in arrays)


def _position_bytes(arrays: Sequence[FloatArray]) -> int:
    """Bytes one position of one row takes over keys and values `arrays`, each
    [rows, heads, positions, head_dim]."""
    return sum(int(a.shape[1]) * int(a.shape[3]) * a.itemsize for a in arrays)


def _spanned(arrays: Sequence[FloatArray]) -> int:
    """Bytes of the arrays `arrays` view (a row selection in place leaves a view of the
    first rows of a larger array, which keeps all of it)."""
    total = 0
    for a in arrays:
        root: np.ndarray[Any, Any] = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        total += root.nbytes
    return total


def _source_width(attention_mask: IntArray) -> int:
    """Source positions up to the last one any row of `attention_mask` marks real (0 for
    none)."""
    used = np.flatnonzero(attention_mask.any(axis=0))
    return int(used[-1]) + 1 if used.size else 0


def _sources_trimmed(
    enc: EncoderOutput, cross_kv: tuple[FloatArray, ...]
) -> tuple[EncoderOutput, tuple[FloatArray, ...]]:
    """A batch's sources cut to its longest (after the rows with longer ones left)."""
    source = _source_width(enc.attention_mask)
    if source == enc.attention_mask.shape[1]:
        return enc, cross_kv
    trimmed = EncoderOutput(enc.hidden_states[:, :source], enc.attention_mask[:, :source])
    return trimmed, tuple(a[:, :, :source] for a in cross_kv)


def _sources_stacked(
    enc: EncoderOutput,
    cross_kv: tuple[FloatArray, ...],
    other: EncoderOutput,
    other_kv: tuple[FloatArray, ...],
) -> tuple[EncoderOutput, tuple[FloatArray, ...]]:
    """Two batches' sources as one, each padded to the longer (`attention_mask` 0)."""
    source = max(enc.attention_mask.shape[1], other.attention_mask.shape[1])
    stacked = tuple(_stacked(pair, source, axis=2) for pair in zip(cross_kv, other_kv, strict=True))
    return stack_encoder_outputs([enc, other]), stacked


@dataclass
class _Slots:
    """A continuous batch's decoder state, row by row: its sources, the self KV of every
    row in one array [rows, heads, slots, dim] whose real slots `real` marks (1), the
    cross-attention KV, how many tokens each row was fed (start token included) and the
    token it is fed next."""

    enc: EncoderOutput
    self_kv: tuple[FloatArray, ...]
    cross_kv: tuple[FloatArray, ...]
    real: IntArray  # [rows, slots]
    lengths: IntArray  # [rows]
    next: IntArray  # [rows, 1]

    def select(self, select: list[int]) -> None:
        """Keep these rows, in this order; then cut off the slots no row uses any more (the
        rows that left were the long ones) and the source positions past the longest."""
        if select == list(range(self.real.shape[0])):
            return  # no row left or moved: nothing to select or trim
        rows: IntArray = np.array(select, dtype=np.int64)
        self.enc = self.enc.select(rows)
        self.self_kv = _kept(self.self_kv, rows)
        self.cross_kv = _kept(self.cross_kv, rows)
        self.real, self.lengths, self.next = self.real[rows], self.lengths[rows], self.next[rows]
        if not len(select):
            return
        used = np.flatnonzero(self.real.any(axis=0))
        first = int(used[0]) if used.size else self.real.shape[1]
        if first:
            self.real = self.real[:, first:]
            self.self_kv = tuple(a[:, :, first:] for a in self.self_kv)
        self.enc, self.cross_kv = _sources_trimmed(self.enc, self.cross_kv)

    def extend(self, other: _Slots) -> None:
        """Append `other`'s rows: the self KV right-aligned (the shorter side grows on the
        left), sources padded to the longest with `attention_mask` 0."""
        slots = max(self.real.shape[1], other.real.shape[1])
        self.self_kv = tuple(
            _stacked(pair, slots, axis=2, left=True)
            for pair in zip(self.self_kv, other.self_kv, strict=True)
        )
        self.enc, self.cross_kv = _sources_stacked(
            self.enc, self.cross_kv, other.enc, other.cross_kv
        )
        self.real = _stacked((self.real, other.real), slots, axis=1, left=True)
        self.lengths = np.concatenate([self.lengths, other.lengths])
        self.next = np.concatenate([self.next, other.next])

    def squeeze(self) -> None:
        """Drop the holes that rejected lookahead left in the self KV: each row's real
        slots moved together at the end (right-aligned, as after a join)."""
        keep = self.real.sum(axis=1)
        width = int(keep.max(initial=0))
        order = np.argsort(self.real, axis=1, kind="stable")[:, self.real.shape[1] - width :]
        self.self_kv = tuple(
            np.take_along_axis(a, order[:, None, :, None], axis=2) for a in self.self_kv
        )
        self.real = (np.arange(width)[None, :] >= (width - keep)[:, None]).astype(np.int64)


class ContinuousBatch(DecodeBatch):
    """A batch that searches join and leave at any step (iteration-level batching).

    Needs the rewritten decoder (`MaskedDecoder`): each row has its own length and its own
    real slots in one shared self-KV array (`_Slots`). Newcomers are prefilled together
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
        self._slots: _Slots | None = None
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
        live = int(state.real.sum()) * _position_bytes(state.self_kv)
        live += int(state.enc.attention_mask.sum()) * _position_bytes(state.cross_kv)
        return StateBytes(live, _spanned((*state.self_kv, *state.cross_kv)))

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

    def _prefill(self, joining: Sequence[Member]) -> tuple[list[Search], list[Search], _Slots]:
        """One call over the newcomers: start token, forced prefix and draft, right-padded.
        Each takes its first step there and goes on through its draft while the draft is
        confirmed. Returns those that ended, those that go on and their rows' state."""
        searches = [member.search for member in joining]
        ids, mask = prefill_rows(searches, self.model.config)
        width = ids.shape[1]
        enc = stack_encoder_outputs([member.enc for member in joining])
        needed = np.array([len(s.prefix) for s in searches], dtype=np.int64)
        logits, self_kv, cross_kv = self.decoder.prefill(enc, ids, mask, needed, alone=self.alone)
        steps = _Steps()
        real = np.zeros(len(searches), dtype=np.int64)  # valid slots per prefilled row
        for r, search in enumerate(searches):
            start, draft = len(search.prefix), search.draft
            step, accepted = _confirm(search, logits.row(r, start), draft)
            steps.add(search, r, step)
            real[r] = 1 + start + accepted
            search.accepted = accepted
            self.stats["draft_offered"] += len(draft)
            self.stats["draft_accepted"] += accepted
        used = (np.arange(width)[None, :] < real[:, None]).astype(np.int64)
        next_ids = np.zeros((len(searches), 1), dtype=np.int64)
        slots = _Slots(enc, self_kv, cross_kv, used, real, next_ids)
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
