"""Greedy and beam search over `MarianOnnx`, with forced target prefixes.

A search is per-request state (`GreedySearch`, `BeamSearch`) that one decoder step
advances: it holds the tokens so far, the forced prefix left to feed, scores and limits,
and turns its rows' logits into the next tokens and which of its rows they extend. A
`Batch` runs the rows of many searches through one decoder call per step; searches leave
it when they end (eos, length limit) or are cancelled, and a `DecodeScheduler`
(`engine.decoding.scheduler`) admits new ones. `greedy_search` / `beam_search` run a batch of
searches that start together, which is also how a batch without per-row positions must
run (lockstep).

A forced prefix (the text the streaming controller has already committed) goes through the
decoder's no-past branch in ONE call together with the start token; decoding then continues
one token at a time with the cache. In a lockstep batch whose prefixes differ in length, the
common length goes in that first call and the rest is forced step by step.

The encoder runs once per source (the caller passes its output in), and the encoder KV of
the first decoder call is reused at every later step (see `engine.model.runtime`).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.model import (
    DecoderCache,
    EncoderOutput,
    FloatArray,
    IntArray,
    MarianOnnx,
    MaskedDecoder,
    ModelConfig,
)

# Called before each decoding step with the tokens of every live row (forced prefix included)
# and their next-token log-probabilities [rows, vocab]; returns adjusted log-probabilities.
# The streaming controller uses it to bias decoding toward the previous output.
StepHook = Callable[[Sequence[Sequence[int]], FloatArray], FloatArray]


class DecodingCancelled(Exception):
    """Raised when `should_stop` asks a running decode to give up (a newer source arrived)."""


@dataclass(frozen=True)
class DecodeOptions:
    """Search settings. Lengths count generated tokens, forced prefix included, eos excluded."""

    beam_size: int = 1
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError("beam_size must be >= 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.min_new_tokens < 0:
            raise ValueError("min_new_tokens must be >= 0")


@dataclass(frozen=True)
class Hypothesis:
    """One output: target ids without start token and eos, its score, and whether eos ended it."""

    token_ids: tuple[int, ...]
    score: float
    finished: bool


def log_softmax(logits: FloatArray) -> FloatArray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    out: FloatArray = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return out


def _length_limit(config: ModelConfig, options: DecodeOptions) -> int:
    """Most tokens the decoder may emit: its position table holds the start token too."""
    limit = min(config.max_length, config.max_position_embeddings) - 1
    if options.max_new_tokens is not None:
        limit = min(limit, options.max_new_tokens)
    return limit


def _allowed(
    logits: FloatArray,
    generated: Sequence[int],
    config: ModelConfig,
    options: DecodeOptions,
    out: FloatArray | None = None,
) -> FloatArray:
    """A float32 copy of `logits` [rows, vocab] with what may not come next at -inf: the
    model's banned tokens, and eos in a row that has generated fewer than
    `min_new_tokens` (`generated[r]` tokens so far). Written into `out` when given."""
    if out is None:
        out = logits.astype(np.float32, copy=True)
    else:
        np.copyto(out, logits, casting="same_kind")
    out[:, list(config.bad_token_ids)] = -np.inf
    for r, count in enumerate(generated):
        if count < options.min_new_tokens:
            out[r, config.eos_token_id] = -np.inf
    return out


def _scores(
    logits: FloatArray,
    rows: Sequence[Sequence[int]],
    config: ModelConfig,
    options: DecodeOptions,
    hook: StepHook | None,
) -> FloatArray:
    """Log-probabilities of the next token with banned tokens and early eos masked."""
    scores = log_softmax(_allowed(logits, [len(tokens) for tokens in rows], config, options))
    if hook is not None:
        scores = hook(rows, scores)
    return scores


_scratch = threading.local()  # per lane thread: one vocabulary-sized float32 buffer


def _scratch_row(size: int) -> FloatArray:
    row: FloatArray | None = getattr(_scratch, "row", None)
    if row is None or row.shape[0] != size:
        row = _scratch.row = np.empty(size, dtype=np.float32)
    return row


def _greedy_choice(
    logits: FloatArray, config: ModelConfig, generated: int, options: DecodeOptions
) -> tuple[int, float]:
    """The argmax of one row's `_scores` and its log-probability, with the same float32
    operations, without building the whole log-softmax row: at one row per stream that
    row (65001 floats for OPUS-MT, several passes) cost ~5% of a step. The masked copy
    and the exponentials go into one buffer kept per thread, not into two fresh
    260 kB arrays per step (fresh pages: in a running decode the copy alone took ~60 us,
    ten times its cost on warm memory)."""
    row = _allowed(
        logits[None], [generated], config, options, _scratch_row(logits.shape[-1])[None]
    )[0]
    token = int(row.argmax())
    top = row[token]  # the row's max
    np.subtract(row, top, out=row)
    np.exp(row, out=row)
    total = row.sum(dtype=np.float32)
    return token, float((top - top) - np.log(total))


# --- searches: per-request state -------------------------------------------------------


Advance = tuple[list[int], list[int]]
"""A search's step: the next token of each of its new rows, and which of its current rows
(index within the search) each new row continues."""


MAX_DRAFT = 64
"""Draft tokens verified at most. A rejected draft token costs one more position in the
prefill call (about 0.13 ms for the int8 OPUS-MT decoder, against 3.3 ms for a step), so
a long draft that the new source contradicts early is still cheap; the cap bounds it."""

LOOKAHEAD = 4
"""Draft tokens a greedy row may have verified in one cached step, after the draft was
re-aligned (`GreedySearch.lookahead`). On the committed fixture logs 4 confirms all but
1-2% of what any longer run would (examples/benchmarks/draft_bound.py)."""

LOOKAHEAD_POSITIONS = 4
"""Extra positions one cached step may compute for looked-ahead tokens, over all its rows.
Every row of a step is padded to the longest row's positions, so a lookahead costs each
row of the batch; measured on the int8 OPUS-MT-size decoder (2-core AMD EPYC), the layers
take ~0.15 ms per extra position at one row (1.71 ms for one token, 2.09 for four) and a
step saved is ~2.5 ms, while at 16 rows one more position per row costs more than the
step it could save for one of them. So a lone row looks 4 ahead, 2 rows 2 each, 3-4 rows
1 and a busier step none: speculation pays at low load, as in LLM serving. With 8 (4 rows
2 ahead, 8 rows 1), 40 real-time streams on the same machine gave update p95 221-488 ms
over five runs against 294-520 with none (capacity.py): no gain under load to pay for
the risk, so the budget stays where a saved step clearly wins."""


class Search(ABC):
    """One request's search: the rows it holds in a batch and how one step advances them.

    `start(fed)` says how many prefix tokens went into the first decoder call with the
    start token; `advance` takes the logits of the search's rows after each call.
    `draft`: tokens expected after the prefix (the stream's previous hypothesis), which a
    batch that can may verify in the prefill call instead of decoding them one step each
    (`ContinuousBatch.join`), and again, re-aligned, in later steps (`lookahead`); the
    result is the same either way.
    """

    def __init__(
        self,
        config: ModelConfig,
        prefix: Sequence[int],
        options: DecodeOptions,
        hook: StepHook | None = None,
        draft: Sequence[int] = (),
    ) -> None:
        self.config = config
        self.prefix = list(prefix)
        self.options = options
        self.hook = hook
        self.limit = _length_limit(config, options)
        # Greedy only (a beam's rows have no single draft to confirm), within the limit.
        room = min(MAX_DRAFT, self.limit - len(self.prefix))
        self.draft = list(draft)[: max(room, 0)] if options.beam_size == 1 else []
        self.accepted = 0  # draft tokens confirmed (set by the batch that verified them)
        if len(self.prefix) > self.limit:
            raise ValueError(
                f"forced prefix of {len(self.prefix)} tokens exceeds the {self.limit}-token limit"
            )

    @property
    @abstractmethod
    def width(self) -> int:
        """Rows it holds now."""

    @abstractmethod
    def rows(self) -> list[list[int]]:
        """Each row's tokens so far (forced prefix included, start token excluded)."""

    @abstractmethod
    def start(self, fed: int) -> None:
        """The first call fed the start token and `prefix[:fed]`."""

    @abstractmethod
    def advance(self, logits: FloatArray) -> Advance | None:
        """Consume its rows' last-position logits [width, vocab]; None when it has ended."""

    @abstractmethod
    def result(self) -> Hypothesis:
        """The answer, once `advance` returned None."""

    def scores(self, logits: FloatArray) -> FloatArray:
        return _scores(logits, self.rows(), self.config, self.options, self.hook)

    def lookahead(self, most: int) -> list[int]:
        """Up to `most` tokens expected after the next one fed (its last row's last
        token), for a batch that can verify them in the same cached step; none here."""
        return []


class GreedySearch(Search):
    """One row: the forced prefix, then the most likely token until eos or the limit."""

    def __init__(
        self,
        config: ModelConfig,
        prefix: Sequence[int],
        options: DecodeOptions,
        hook: StepHook | None = None,
        draft: Sequence[int] = (),
    ) -> None:
        super().__init__(config, prefix, options, hook, draft)
        self.tokens: list[int] = []
        self.score = 0.0
        self.finished = False
        self._draft_at = 0  # where the draft is expected to go on (re-alignment)
        self._looked: list[int] = []  # lookahead tokens not confirmed yet
        self.looked_ahead = 0  # lookahead tokens confirmed, over all steps

    @property
    def width(self) -> int:
        return 1

    def rows(self) -> list[list[int]]:
        return [self.tokens]

    def start(self, fed: int) -> None:
        self.tokens = self.prefix[:fed]

    def advance(self, logits: FloatArray) -> Advance | None:
        if len(self.tokens) < len(self.prefix):
            token = self.prefix[len(self.tokens)]
        elif self.hook is None:
            token, score = _greedy_choice(logits[0], self.config, len(self.tokens), self.options)
            self.score += score
        else:
            step = self.scores(logits)
            token = int(step[0].argmax())
            self.score += float(step[0, token])
        if token == self.config.eos_token_id and len(self.tokens) >= len(self.prefix):
            self.finished = True
            return None
        self.tokens.append(token)
        if self._looked and token == self._looked[0]:
            del self._looked[0]
            self._draft_at += 1
            self.looked_ahead += 1
        else:
            self._looked = []
        if len(self.tokens) >= self.limit:
            return None
        return [token], [0]

    def lookahead(self, most: int) -> list[int]:
        """The draft re-aligned after a disagreement: where the last two tokens (else the
        last one) occur in the draft, the draft's next tokens, up to `most` and the length
        limit. The first occurrence at or after where the draft was last confirmed wins,
        else the last one before it. A revision usually inserts, drops or replaces a few
        words and keeps the rest, so the previous hypothesis goes on where the new one
        meets it again: prompt-lookup decoding with the previous hypothesis as the text
        looked up. Only a guess: the batch verifies each token against the argmax."""
        most = min(most, self.limit - len(self.tokens))
        if most <= 0 or not self.draft or not self.tokens:
            return []
        start = max(self._draft_at, self.accepted)
        for n in (2, 1):
            key = self.tokens[-n:]
            if len(key) < n:
                continue
            found = [
                m + 1
                for m in range(n - 1, len(self.draft) - 1)
                if self.draft[m - n + 1 : m + 1] == key
            ]
            if found:
                later = [m for m in found if m >= start]
                at = later[0] if later else found[-1]
                self._draft_at = at
                self._looked = self.draft[at : at + most]
                return list(self._looked)
        return []

    def result(self) -> Hypothesis:
        return Hypothesis(tuple(self.tokens), self.score, self.finished)


class BeamSearch(Search):
    """Beam search with length-normalised scores (sum log-prob / generated length ** penalty).

    Starts as one row (the prefix is decoded once) and widens to `beam_size` rows.
    Hypotheses end at eos; the search ends once `beam_size` hypotheses have ended and no
    live beam can still beat the worst of them, or at the length limit.
    """

    def __init__(
        self,
        config: ModelConfig,
        prefix: Sequence[int],
        options: DecodeOptions,
        hook: StepHook | None = None,
    ) -> None:
        super().__init__(config, prefix, options, hook)
        self.beams = options.beam_size
        self.seqs: list[list[int]] = [[]]
        self.beam_scores = np.zeros(1, dtype=np.float64)
        self.done: list[tuple[float, tuple[int, ...], bool]] = []

    @property
    def width(self) -> int:
        return len(self.seqs)

    def rows(self) -> list[list[int]]:
        return self.seqs

    def start(self, fed: int) -> None:
        self.seqs = [self.prefix[:fed]]

    def _norm(self, score: float, length: int) -> float:
        return float(score / (max(length, 1) ** self.options.length_penalty))

    def advance(self, logits: FloatArray) -> Advance | None:
        beams, eos = self.beams, self.config.eos_token_id
        cur_len = len(self.seqs[0])
        if cur_len < len(self.prefix):
            # Still inside the forced prefix: every beam takes the forced token.
            token = self.prefix[cur_len]
            self.seqs = [[*seq, token] for seq in self.seqs]
            return [token] * len(self.seqs), list(range(len(self.seqs)))
        step = self.scores(logits).astype(np.float64)
        vocab = step.shape[1]
        total = (self.beam_scores[:, None] + step).reshape(-1)
        order = np.argsort(-total, kind="stable")[: 2 * beams]
        seqs: list[list[int]] = []
        parents: list[int] = []
        tokens: list[int] = []
        scores: list[float] = []
        for rank, flat in enumerate(order):
            score = float(total[flat])
            if not np.isfinite(score):
                break
            k, token = divmod(int(flat), vocab)
            if token == eos:
                if rank < beams:
                    self.done.append((self._norm(score, cur_len + 1), tuple(self.seqs[k]), True))
                continue
            seqs.append([*self.seqs[k], token])
            parents.append(k)
            tokens.append(token)
            scores.append(score)
            if len(seqs) == beams:
                break
        self.done.sort(key=lambda d: -d[0])
        del self.done[beams:]
        best_live = max(scores, default=-np.inf)
        ended = len(self.done) >= beams and (
            not np.isfinite(best_live) or self._norm(best_live, cur_len + 1) <= self.done[-1][0]
        )
        if cur_len + 1 >= self.limit:
            ended = True
            for seq, score in zip(seqs, scores, strict=True):
                self.done.append((self._norm(score, len(seq)), tuple(seq), False))
        self.seqs = seqs
        self.beam_scores = np.array(scores, dtype=np.float64)
        if ended or not seqs:
            return None
        return tokens, parents

    def result(self) -> Hypothesis:
        if self.done:
            best_score, best_seq, finished = max(self.done, key=lambda d: d[0])
            return Hypothesis(best_seq, best_score, finished)
        return Hypothesis(tuple(self.prefix), 0.0, False)


def make_search(
    config: ModelConfig,
    prefix: Sequence[int],
    options: DecodeOptions,
    hook: StepHook | None = None,
    draft: Sequence[int] = (),
) -> Search:
    """Greedy or beam search, by `options.beam_size` (a beam ignores `draft`)."""
    if options.beam_size == 1:
        return GreedySearch(config, prefix, options, hook, draft)
    return BeamSearch(config, prefix, options, hook)


# --- a batch of searches --------------------------------------------------------------


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


class Batch:
    """The rows of several searches decoded together: one decoder call per step.

    The cycle: `join` new searches (prefill: start token plus forced prefix, in one
    decoder call, then their first `advance`), `remove` cancelled ones, `forward` (one
    decoder call over every live row), `advance` (each search takes its rows' logits;
    those that ended leave), and again. This class is the lockstep batch, for the stock
    decoder graphs, which take positions from the past length and have no self-attention
    mask: every row must have the same decoder length, so searches only join an empty
    batch, their common prefix length goes in the prefill and the rest of each prefix is
    forced step by step. `ContinuousBatch` lets them join at any step.
    """

    def __init__(self, model: MarianOnnx) -> None:
        self.model = model
        self.searches: list[Search] = []
        self._enc: EncoderOutput | None = None
        self._cache: DecoderCache | None = None
        self._last: FloatArray | None = None
        self._next: IntArray | None = None

    def __len__(self) -> int:
        return len(self.searches)

    @property
    def rows(self) -> int:
        return sum(s.width for s in self.searches)

    @property
    def can_join(self) -> bool:
        """Whether `join` may be called now."""
        return not self.searches

    @property
    def has_logits(self) -> bool:
        """A decoder call ran and `advance` has not consumed its logits yet."""
        return self._last is not None

    def join(self, members: Sequence[tuple[Search, EncoderOutput]]) -> list[Search]:
        """Prefill new searches (each `EncoderOutput` holds its one source) and take their
        first step; returns those that ended at once."""
        if not self.can_join:
            raise RuntimeError("a lockstep batch only takes searches when empty")
        if not members:
            return []
        searches = [search for search, _ in members]
        common = min(len(s.prefix) for s in searches)
        start = self.model.config.decoder_start_token_id
        for search in searches:
            search.start(common)
        ids = np.array([[start, *s.prefix[:common]] for s in searches], dtype=np.int64)
        enc = stack_encoder_outputs([e for _, e in members])
        logits, cache = self.model.decode_first(enc, ids)
        self.searches, self._enc, self._cache = searches, enc, cache
        self._last = logits[:, -1, :]
        return self.advance()

    def advance(self) -> list[Search]:
        """Feed each search its rows' logits; returns the searches that ended."""
        assert self._last is not None
        ended, select, tokens = _advance_all(self, self._last)
        self._last = None
        self._reorder(select)
        self._next = np.array(tokens, dtype=np.int64)[:, None]
        return ended

    def remove(self, gone: Sequence[Search]) -> None:
        """Drop searches between `advance` and `forward` (cancelled requests)."""
        select = _rows_without(self, gone)
        if select is None:
            return
        assert self._next is not None
        self._next = self._next[select]
        self._reorder(select)

    def _reorder(self, select: list[int]) -> None:
        assert self._cache is not None and self._enc is not None
        if select == list(range(self._cache.tokens.shape[0])):
            return
        rows: IntArray = np.array(select, dtype=np.int64)
        self._cache, self._enc = self._cache.select(rows), self._enc.select(rows)

    def forward(self) -> None:
        """One decoder call over the live rows; no-op when none is left."""
        if not self.searches:
            self._enc = self._cache = self._next = None
            return
        assert self._enc is not None and self._cache is not None and self._next is not None
        self._last, self._cache = self.model.decode_next(self._enc, self._cache, self._next)


@dataclass
class _Steps:
    """What one decoder call did to a batch's searches, gathered search by search: those
    that ended, those still running, the rows to keep (in their new order: a beam reorders
    and widens its own rows) and the next token of each kept row."""

    ended: list[Search] = field(default_factory=list)
    kept: list[Search] = field(default_factory=list)
    select: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, search: Search, row: int, step: Advance | None) -> None:
        """`search`, whose rows start at `row`, took `step` (None: it ended)."""
        if step is None:
            self.ended.append(search)
            return
        new_tokens, parents = step
        self.kept.append(search)
        self.select.extend(row + p for p in parents)
        self.tokens.extend(new_tokens)


def _advance_all(
    batch: Batch | ContinuousBatch, logits: FloatArray
) -> tuple[list[Search], list[int], list[int]]:
    """Each search of the batch takes its rows' logits. Returns the searches that ended,
    the rows to keep and the next token of each kept row (`_Steps`); `batch.searches`
    keeps the searches still running."""
    steps = _Steps()
    row = 0
    for search in batch.searches:
        width = search.width  # before the step: a beam widens
        steps.add(search, row, search.advance(logits[row : row + width]))
        row += width
    batch.searches = steps.kept
    return steps.ended, steps.select, steps.tokens


def _confirm(
    search: Search, logits: FloatArray, expected: Sequence[int]
) -> tuple[Advance | None, int]:
    """Advance a one-row `search` through consecutive positions of `logits` [positions,
    vocab] while the token it picks is the `expected` one fed there (a draft in the
    prefill, a lookahead in a step: the logits after an expected token are what feeding it
    one step later would give). Returns its last step (None: it ended) and how many
    expected tokens it confirmed, whose KV the same call computed."""
    confirmed = 0
    while True:
        step = search.advance(logits[confirmed][None])
        if step is None or confirmed >= len(expected) or step[0] != [expected[confirmed]]:
            return step, confirmed
        confirmed += 1


def _rows_without(batch: Batch | ContinuousBatch, gone: Sequence[Search]) -> list[int] | None:
    """The rows left once `gone` leave (`batch.searches` updated), or None if none is
    in the batch."""
    if not any(search in gone for search in batch.searches):
        return None
    select: list[int] = []
    kept: list[Search] = []
    row = 0
    for search in batch.searches:
        if search not in gone:
            kept.append(search)
            select.extend(range(row, row + search.width))
        row += search.width
    batch.searches = kept
    return select


class ContinuousBatch:
    """A batch that searches join and leave at any step (iteration-level batching).

    Needs the rewritten decoder (`MaskedDecoder`): each row has its own length. The self
    KV of all rows is one array [rows, heads, slots, dim] whose real slots `slots` marks
    per row: a search that joins is prefilled in one call with the other newcomers
    (right-padded), then its slots are placed at the end of the batch's (right-aligned;
    the batch grows on the left if it is longer), so that every later step appends one
    slot for everyone. Positions are each row's own length. Slots no live row uses any
    more are cut off; cross-attention KV and encoder states are padded to the longest
    source with `encoder_attention_mask` 0. Same cycle and methods as `Batch`.

    Lookahead: when the step is small enough (`LOOKAHEAD_POSITIONS`), a greedy row with a
    draft feeds its next token and the tokens its re-aligned draft expects after it
    (`Search.lookahead`) in the same cached step, every row padded to the longest; the
    logits at each position are what feeding the tokens one step each would give (causal
    attention), so the row keeps the run its argmax confirms and the slots of the rest
    are masked out like padding. Those holes are squeezed out once they outnumber the
    real slots.
    """

    def __init__(
        self, model: MarianOnnx, decoder: MaskedDecoder, lookahead_positions: int = 0
    ) -> None:
        self.model = model
        self.decoder = decoder
        # Extra positions a step may compute for lookahead (0: none; the scheduler sets it).
        self.lookahead_positions = lookahead_positions if decoder.lookahead else 0
        self.stats: Counter[str] = Counter()  # draft_ and lookahead_ offered, accepted
        self._reset()

    def _reset(self) -> None:
        self.searches: list[Search] = []
        self._enc: EncoderOutput | None = None
        self._self: tuple[FloatArray, ...] = ()
        self._cross: tuple[FloatArray, ...] = ()
        self._slots: IntArray = np.zeros((0, 0), dtype=np.int64)  # 1: a real slot
        self._lengths: IntArray = np.zeros(0, dtype=np.int64)  # tokens so far, start included
        self._last: FloatArray | None = None
        self._next: IntArray = np.zeros((0, 1), dtype=np.int64)
        self._ahead: list[list[int]] = []  # per row: the lookahead fed after `_next`

    def __len__(self) -> int:
        return len(self.searches)

    @property
    def rows(self) -> int:
        return sum(s.width for s in self.searches)

    @property
    def can_join(self) -> bool:
        return self._last is None

    @property
    def has_logits(self) -> bool:
        return self._last is not None

    def join(self, members: Sequence[tuple[Search, EncoderOutput]]) -> list[Search]:
        """Prefill newcomers in one call: start token, forced prefix and draft. Each then
        takes its first step from the prefill's logits; a greedy search with a draft
        keeps taking steps there while its token equals the draft's (draft verification:
        the logits at a draft position are those step-by-step decoding would compute, as
        attention is causal), so only the tokens after the first disagreement cost a step
        each. The slots of rejected draft tokens are masked out. Returns the searches that
        ended already."""
        if self._last is not None:
            raise RuntimeError("join between advance and forward")
        if not members:
            return []
        config = self.model.config
        searches = [search for search, _ in members]
        fed = [[config.decoder_start_token_id, *s.prefix, *s.draft] for s in searches]
        width = max(map(len, fed))
        ids = np.full((len(searches), width), config.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(searches), width), dtype=np.int64)
        for r, (search, row_ids) in enumerate(zip(searches, fed, strict=True)):
            ids[r, : len(row_ids)] = row_ids
            mask[r, : len(row_ids)] = 1
            search.start(len(search.prefix))
        enc = stack_encoder_outputs([e for _, e in members])
        needed = np.array([len(s.prefix) for s in searches], dtype=np.int64)
        logits, self_kv, cross_kv = self.decoder.prefill(enc, ids, mask, needed)
        steps = _Steps()
        real = np.zeros(len(searches), dtype=np.int64)  # valid slots per prefilled row
        for r, search in enumerate(searches):
            start, draft = len(search.prefix), search.draft
            step, accepted = _confirm(search, logits[r, start:], draft)
            steps.add(search, r, step)
            real[r] = 1 + start + accepted
            search.accepted = accepted
            self.stats["draft_offered"] += len(draft)
            self.stats["draft_accepted"] += accepted
        slots = (np.arange(width)[None, :] < real[:, None]).astype(np.int64)
        newcomers = ContinuousBatch(self.model, self.decoder, self.lookahead_positions)
        newcomers.searches = steps.kept
        newcomers._enc, newcomers._self, newcomers._cross = enc, self_kv, cross_kv
        newcomers._slots, newcomers._lengths = slots, real
        newcomers._reorder(steps.select)
        newcomers._next = np.array(steps.tokens, dtype=np.int64).reshape(-1, 1)
        if newcomers.searches:
            self._merge(newcomers)
        return steps.ended

    def _merge(self, other: ContinuousBatch) -> None:
        assert other._enc is not None
        if not self.searches:
            self.searches = other.searches
            self._enc, self._self, self._cross = other._enc, other._self, other._cross
            self._slots, self._lengths, self._next = other._slots, other._lengths, other._next
            return
        assert self._enc is not None
        slots = max(self._slots.shape[1], other._slots.shape[1])
        mine_self = tuple(_pad_axis(a, slots, axis=2, left=True) for a in self._self)
        theirs_self = tuple(_pad_axis(a, slots, axis=2, left=True) for a in other._self)
        source = max(self._enc.attention_mask.shape[1], other._enc.attention_mask.shape[1])
        self._self = tuple(np.concatenate(p) for p in zip(mine_self, theirs_self, strict=True))
        self._cross = tuple(
            np.concatenate([_pad_axis(a, source, axis=2), _pad_axis(b, source, axis=2)])
            for a, b in zip(self._cross, other._cross, strict=True)
        )
        self._enc = stack_encoder_outputs([self._enc, other._enc])
        self._slots = np.concatenate(
            [
                _pad_axis(self._slots, slots, axis=1, left=True),
                _pad_axis(other._slots, slots, axis=1, left=True),
            ]
        )
        self._lengths = np.concatenate([self._lengths, other._lengths])
        self._next = np.concatenate([self._next, other._next])
        self.searches = [*self.searches, *other.searches]

    def advance(self) -> list[Search]:
        assert self._last is not None
        looked = self._last.ndim == 3
        if looked:
            ended, select, tokens = self._advance_ahead(self._last)
        else:
            ended, select, tokens = _advance_all(self, self._last)
        self._last = None
        self._reorder(select)
        self._next = np.array(tokens, dtype=np.int64).reshape(-1, 1)
        # Only rejected lookahead leaves holes (a join right-aligns, `_reorder` trims).
        slots = self._slots
        if looked and slots.shape[1] > 2 * int(slots.sum(axis=1).max(initial=0)) + LOOKAHEAD:
            self._squeeze()
        return ended

    def _advance_ahead(self, logits: FloatArray) -> tuple[list[Search], list[int], list[int]]:
        """`_advance_all` after a step with lookahead (`logits` [rows, T, vocab]): a row
        takes the positions its argmax confirms, one by one, as the prefill's draft run
        does; the slots after its last confirmed token are masked out."""
        steps = _Steps()
        fed = logits.shape[1]
        row = 0
        for search in self.searches:
            width, ahead = search.width, self._ahead[row]
            if width == 1:
                step, taken = _confirm(search, logits[row], ahead)
            else:  # a beam: never looks ahead, its rows' first positions
                step, taken = search.advance(logits[row : row + width, 0]), 0
            steps.add(search, row, step)
            self._slots[row, self._slots.shape[1] - fed + 1 + taken :] = 0
            self._lengths[row] += taken
            self.stats["lookahead_offered"] += len(ahead)
            self.stats["lookahead_accepted"] += taken
            row += width
        self.searches = steps.kept
        return steps.ended, steps.select, steps.tokens

    def _squeeze(self) -> None:
        """Drop the holes that rejected lookahead left in the self KV: each row's real
        slots moved together at the end (right-aligned, as after a join)."""
        keep = self._slots.sum(axis=1)
        width = int(keep.max(initial=0))
        order = np.argsort(self._slots, axis=1, kind="stable")[:, self._slots.shape[1] - width :]
        self._self = tuple(
            np.take_along_axis(a, order[:, None, :, None], axis=2) for a in self._self
        )
        self._slots = (np.arange(width)[None, :] >= (width - keep)[:, None]).astype(np.int64)

    def remove(self, gone: Sequence[Search]) -> None:
        select = _rows_without(self, gone)
        if select is None:
            return
        self._next = self._next[select]
        self._reorder(select)

    def _reorder(self, select: list[int]) -> None:
        if select == list(range(self._slots.shape[0])):
            return  # no row left or moved: nothing to select or trim
        rows: IntArray = np.array(select, dtype=np.int64)
        assert self._enc is not None
        self._enc = self._enc.select(rows)
        self._self = tuple(a[rows] for a in self._self)
        self._cross = tuple(a[rows] for a in self._cross)
        self._slots, self._lengths = self._slots[rows], self._lengths[rows]
        if not len(select):
            return
        # Slots no live row uses any more (rows that left were the long ones): cut off.
        used = np.flatnonzero(self._slots.any(axis=0))
        first = int(used[0]) if used.size else self._slots.shape[1]
        if first:
            self._slots = self._slots[:, first:]
            self._self = tuple(a[:, :, first:] for a in self._self)
        assert self._enc is not None
        source = int(np.flatnonzero(self._enc.attention_mask.any(axis=0))[-1]) + 1
        if source < self._enc.attention_mask.shape[1]:
            self._enc = EncoderOutput(
                self._enc.hidden_states[:, :source], self._enc.attention_mask[:, :source]
            )
            self._cross = tuple(a[:, :, :source] for a in self._cross)

    def forward(self) -> None:
        if not self.searches:
            self._reset()
            return
        assert self._enc is not None
        rows = self._slots.shape[0]
        most = min(LOOKAHEAD, self.lookahead_positions // rows)
        self._ahead = [[] for _ in range(rows)]
        if most:
            row = 0
            for search in self.searches:
                self._ahead[row] = search.lookahead(most)  # a beam's: none
                row += search.width
        fed = 1 + max(map(len, self._ahead))
        if fed == 1:  # no lookahead: the common step, kept lean (it runs once per token)
            mask = np.concatenate([self._slots, np.ones((rows, 1), dtype=np.int64)], axis=1)
            self._last, self._self = self.decoder.step(
                self._enc, self._next, self._lengths.reshape(-1, 1), mask, self._self, self._cross
            )
            self._slots, self._lengths = mask, self._lengths + 1
            return
        ids = np.full((rows, fed), self.model.config.pad_token_id, dtype=np.int64)
        new = np.zeros((rows, fed), dtype=np.int64)
        ids[:, 0], new[:, 0] = self._next[:, 0], 1
        for r, looked in enumerate(self._ahead):
            ids[r, 1 : 1 + len(looked)] = looked
            new[r, 1 : 1 + len(looked)] = 1
        # Each row's own positions; padding gets any in-range one (its own next).
        positions = self._lengths[:, None] + np.arange(fed)[None, :] * new
        mask = np.concatenate([self._slots, new], axis=1)
        self._last, self._self = self.decoder.step(
            self._enc, ids, positions, mask, self._self, self._cross
        )
        self._slots, self._lengths = mask, self._lengths + 1


def _pad_axis(a: npt.NDArray[Any], size: int, *, axis: int, left: bool = False) -> npt.NDArray[Any]:
    """`a` padded with zeros along `axis` to `size` (on the left or the right)."""
    missing = size - a.shape[axis]
    if missing <= 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (missing, 0) if left else (0, missing)
    return np.pad(a, widths)


def run_searches(
    model: MarianOnnx,
    enc: EncoderOutput,
    searches: Sequence[Search],
    should_stop: Callable[[], bool] | None = None,
) -> list[Hypothesis]:
    """Run searches that start together (row i of `enc` is search i's source) to the end."""
    if enc.batch_size != len(searches):
        raise ValueError("one prefix per source is needed")
    batch = Batch(model)
    batch.join([(s, enc.select(np.array([i]))) for i, s in enumerate(searches)])
    while batch:
        if should_stop is not None and should_stop():
            raise DecodingCancelled
        batch.forward()
        batch.advance()
    return [s.result() for s in searches]


def _searches(
    model: MarianOnnx,
    enc: EncoderOutput,
    prefixes: Sequence[Sequence[int]] | None,
    options: DecodeOptions,
    hook: StepHook | None,
) -> list[Search]:
    prefixes = prefixes if prefixes is not None else [[] for _ in range(enc.batch_size)]
    if len(prefixes) != enc.batch_size:
        raise ValueError("one prefix per source is needed")
    return [make_search(model.config, p, options, hook) for p in prefixes]


def greedy_search(
    model: MarianOnnx,
    enc: EncoderOutput,
    prefixes: Sequence[Sequence[int]] | None = None,
    options: DecodeOptions = DecodeOptions(),
    *,
    hook: StepHook | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[Hypothesis]:
    """Greedy decoding of every source in `enc`, continuing after each forced prefix."""
    greedy = DecodeOptions(1, options.max_new_tokens, options.min_new_tokens)
    searches = _searches(model, enc, prefixes, greedy, hook)
    return run_searches(model, enc, searches, should_stop)


def beam_search(
    model: MarianOnnx,
    enc: EncoderOutput,
    prefixes: Sequence[Sequence[int]] | None = None,
    options: DecodeOptions = DecodeOptions(beam_size=4),
    *,
    hook: StepHook | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[Hypothesis]:
    """Beam search of every source in `enc` (see `BeamSearch`); greedy for beam 1."""
    searches = _searches(model, enc, prefixes, options, hook)
    return run_searches(model, enc, searches, should_stop)


def search(
    model: MarianOnnx,
    enc: EncoderOutput,
    prefixes: Sequence[Sequence[int]] | None = None,
    options: DecodeOptions = DecodeOptions(),
    *,
    hook: StepHook | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[Hypothesis]:
    """Greedy or beam search, by `options.beam_size`."""
    searches = _searches(model, enc, prefixes, options, hook)
    return run_searches(model, enc, searches, should_stop)
