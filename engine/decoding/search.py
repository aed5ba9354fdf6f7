"""Searches: one request's decoding state, which the logits of each decoder call extend.

A search (`GreedySearch`, `BeamSearch`) holds the tokens so far, the forced prefix still
to feed, scores and limits, and turns its rows' logits into the next tokens and the rows
they continue (`Search.observe`). It runs no model: a batch (`engine.decoding.batch`) feeds
the rows of many searches through shared decoder calls, and the scheduler
(`engine.decoding.scheduler`) decides which searches are in the batch. Keeping the two
apart lets one search run in either kind of batch and be checked on its own.

A forced prefix is the text the streaming controller has already committed: the batch
feeds it with the start token in the first call, and the search forces whatever of it
that call did not take (`Search.start`).
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from engine.model.config import ModelConfig
from engine.model.layouts import FloatArray

# Called before each decoding step with the tokens of every live row (forced prefix included)
# and their next-token log-probabilities [rows, vocab]; returns adjusted log-probabilities.
# The streaming controller uses it to bias decoding toward the previous output.
StepHook = Callable[[Sequence[Sequence[int]], FloatArray], FloatArray]


class DecodingCancelled(Exception):
    """Raised for a request aborted before its end (`DecodeScheduler.abort`: a newer
    source of its stream arrived, so its answer is no longer wanted)."""


@dataclass(frozen=True)
class DecodeOptions:
    """Search settings. Lengths count generated tokens, forced prefix included, eos excluded."""

    beam_size: int = 1
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    length_penalty: float = 1.0
    # Whether a greedy hypothesis carries its log-probability (`Hypothesis.score`). Without
    # it, each token is the argmax of the logits as they are (one pass over the
    # vocabulary, where the log-probability takes four: a tenth of the lanes' time under
    # load), the same token; the score is nan. The streaming controller's partials, whose
    # updates carry no score, decode so. A beam always scores.
    scores: bool = True
    # Guards against a model that never ends (noise a recogniser misheard makes real
    # OPUS-MT models loop: "你不不不..." to the length limit). A hypothesis stops at
    # ceil(max_length_factor * source tokens) + max_length_extra tokens (the source's
    # tokens as the encoder sees them, eos and language token included; None: no cap
    # but the model's), and where its last tokens are one n-gram of up to `LOOP_NGRAM`
    # tokens `repeat_limit` times in a row it ends after the first of them (None: never).
    # Neither ends a hypothesis before `min_new_tokens`, nor cuts its forced prefix.
    # The defaults, and the profile of real translations that chose them: docs/streaming.md.
    max_length_factor: float | None = 2.0
    max_length_extra: int = 10
    repeat_limit: int | None = 4

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError("beam_size must be >= 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.min_new_tokens < 0:
            raise ValueError("min_new_tokens must be >= 0")
        if self.max_length_factor is not None and not self.max_length_factor > 0:
            raise ValueError("max_length_factor must be > 0 (None: no cap)")
        if self.max_length_extra < 0:
            raise ValueError("max_length_extra must be >= 0")
        if self.repeat_limit is not None and self.repeat_limit < 2:
            raise ValueError("repeat_limit must be >= 2 (None: no guard)")

    def source_cap(self, source_tokens: int) -> int | None:
        """Most tokens a hypothesis of a source of `source_tokens` tokens may have by
        `max_length_factor` and `max_length_extra` (never below `min_new_tokens`); None
        without a factor."""
        if self.max_length_factor is None:
            return None
        cap = math.ceil(self.max_length_factor * source_tokens) + self.max_length_extra
        return max(cap, self.min_new_tokens)

    def bans_eos(self, generated: int) -> bool:
        """Whether eos may not come after `generated` tokens: fewer than `min_new_tokens`.
        The searches' masks (`_allowed`), their scalar check (`may_follow`) and a KV-slot
        prefill's per-position flags ask it; a KV-slot step graph compares a row's length
        with its minimum itself (`SlotBatch`)."""
        return generated < self.min_new_tokens


@dataclass(frozen=True)
class Hypothesis:
    """One output: target ids without start token and eos, its score, and whether eos ended it."""

    token_ids: tuple[int, ...]
    score: float
    finished: bool
    # Where tokens begin that a constrained search added where the model would have ended
    # (`engine.decoding.constraints`): a glossary term the model had not reached, which a
    # partial shows but does not commit. None: every token is the model's own choice.
    appended: int | None = None
    # What a later decode of a longer source is expected to write, where that is not
    # `token_ids` (its draft: `engine.decoding.constraints`, a term put in by the room
    # rule). Drafts only verify: the output does not depend on it.
    draft: tuple[int, ...] | None = None


def log_softmax(logits: FloatArray) -> FloatArray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    out: FloatArray = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return out


def _length_limit(
    config: ModelConfig, options: DecodeOptions, source_tokens: int | None, prefix: int
) -> int:
    """Most tokens the decoder may emit: its position table holds the start token too;
    `max_new_tokens`, and the source's cap (`DecodeOptions.source_cap`), which never cuts
    the `prefix` tokens forced."""
    limit = min(config.max_length, config.max_position_embeddings) - 1
    if options.max_new_tokens is not None:
        limit = min(limit, options.max_new_tokens)
    cap = None if source_tokens is None else options.source_cap(source_tokens)
    if cap is not None:
        limit = min(limit, max(cap, prefix))
    return limit


LOOP_NGRAM = 8
"""Longest n-gram whose repeats `DecodeOptions.repeat_limit` looks for; longer loops end
at the source's length cap."""


def loop_start(tokens: Sequence[int], repeats: int, floor: int) -> int | None:
    """Where `tokens` should end when their last tokens are one n-gram (n <= `LOOP_NGRAM`)
    `repeats` times in a row: after its first occurrence, never before `floor` (the
    forced prefix, `min_new_tokens`); None when they are not."""
    size = len(tokens)
    last = tokens[-1] if tokens else None
    for n in range(1, LOOP_NGRAM + 1):
        span = n * repeats
        if span > size:
            break
        if tokens[size - 1 - n] != last:
            continue  # cheap reject: the last token does not recur n back
        gram = tokens[size - n :]
        if all(tokens[size - k * n : size - (k - 1) * n] == gram for k in range(2, repeats + 1)):
            return max(size - span + n, floor)
    return None


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
    out[:, _banned(config)] = -np.inf
    for r, count in enumerate(generated):
        if options.bans_eos(count):
            out[r, config.eos_token_id] = -np.inf
    return out


_banned_ids: dict[tuple[int, ...], npt.NDArray[np.intp]] = {}


def _banned(config: ModelConfig) -> npt.NDArray[np.intp]:
    """The model's banned tokens as an index array, made once per set of them: indexing
    with a list built per call converted it anew at every step of every row."""
    ids = _banned_ids.get(config.bad_token_ids)
    if ids is None:
        ids = _banned_ids[config.bad_token_ids] = np.array(config.bad_token_ids, dtype=np.intp)
    return ids


def may_follow(token: int, generated: int, config: ModelConfig, options: DecodeOptions) -> bool:
    """Whether `token` may come after `generated` tokens: not one of the model's banned
    tokens, nor eos while `options` bans it (`_allowed` masks the same)."""
    if token in config.bad_token_ids:
        return False
    return not (token == config.eos_token_id and options.bans_eos(generated))


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
    operations, without building the whole log-softmax row (a vocabulary-sized row, in
    several passes, is a visible share of a one-row step). The masked copy and the
    exponentials go into one buffer kept per thread: fresh vocabulary-sized arrays at
    every step land on cold pages, which cost far more than the arithmetic."""
    row = allowed_row(logits, config, generated, options)
    token = int(row.argmax())
    top = row[token]  # the row's max
    np.subtract(row, top, out=row)
    np.exp(row, out=row)
    total = np.add.reduce(row, dtype=np.float32)  # `row.sum`, less its Python wrapper
    return token, float((top - top) - np.log(total))


def allowed_row(
    logits: FloatArray, config: ModelConfig, generated: int, options: DecodeOptions
) -> FloatArray:
    """One row's logits [V] with what may not come next at -inf (`_allowed`, on the row
    itself rather than through [1, V] views), in this thread's buffer (`_greedy_choice`'s,
    valid until the next call): what a search that carries no score compares tokens by,
    in the order of their log-probabilities without the log-softmax's passes over the
    vocabulary."""
    row = _scratch_row(logits.shape[-1])
    np.copyto(row, logits, casting="same_kind")
    row[_banned(config)] = -np.inf
    if options.bans_eos(generated):
        row[config.eos_token_id] = -np.inf
    return row


def _greedy_token(
    logits: FloatArray, config: ModelConfig, generated: int, options: DecodeOptions
) -> int:
    """`_greedy_choice`'s token without its log-probability: the argmax of the logits as
    they are, when that token may come next. It is then the masked row's argmax too (the
    first of the row's largest values is allowed, so no allowed one comes before it);
    when it may not (a banned token, an early eos), the masked row decides."""
    token = int(logits.argmax())
    if not may_follow(token, generated, config, options):
        token = _greedy_choice(logits, config, generated, options)[0]
    return token


class Extension(NamedTuple):
    """What one decoder call's logits did to a search that goes on: the next token of each
    of its new rows, and which of its current rows (index within the search) each new row
    continues (a beam reorders and widens its rows; a greedy search has one)."""

    tokens: list[int]
    parents: list[int]


MAX_DRAFT = 64
"""Draft tokens verified at most. A rejected draft token costs one more position in the
prefill call, far less than a step, so a long draft that the new source contradicts
early is still cheap; the cap bounds it."""


class Search(ABC):
    """One request's search: the rows it holds in a batch and how logits extend them.

    `start(fed)` says how many prefix tokens went into the first decoder call with the
    start token; `observe` takes the logits of the search's rows after each call.
    `draft`: tokens expected after the prefix (the stream's previous hypothesis), which a
    batch that can may verify in the prefill call instead of decoding them one step each
    (`ContinuousBatch`), and again, re-aligned, in later steps (`take_lookahead`); the
    result is the same either way.
    """

    def __init__(
        self,
        config: ModelConfig,
        prefix: Sequence[int],
        options: DecodeOptions,
        hook: StepHook | None = None,
        draft: Sequence[int] = (),
        source_tokens: int | None = None,
    ) -> None:
        self.config = config
        self.prefix = list(prefix)
        self.options = options
        self.hook = hook
        self.limit = _length_limit(config, options, source_tokens, len(self.prefix))
        # Greedy only (a beam's rows have no single draft to confirm), within the limit.
        room = min(MAX_DRAFT, self.limit - len(self.prefix))
        self.draft = list(draft)[: max(room, 0)] if options.beam_size == 1 else []
        self.accepted = 0  # draft tokens confirmed (set by the batch that verified them)
        if len(self.prefix) > self.limit:
            raise ValueError(
                f"forced prefix of {len(self.prefix)} tokens exceeds the {self.limit}-token limit"
            )
        self._begin()

    @abstractmethod
    def _begin(self) -> None:
        """Set up the kind's own state (once, at the end of `__init__`)."""

    def _loop_end(self, tokens: Sequence[int]) -> int | None:
        """Where a row of these tokens ends by `DecodeOptions.repeat_limit`, else None."""
        repeats = self.options.repeat_limit
        if repeats is None or len(tokens) <= len(self.prefix):
            return None
        if self.options.bans_eos(len(tokens)):
            return None
        return loop_start(tokens, repeats, max(len(self.prefix), self.options.min_new_tokens))

    @property
    @abstractmethod
    def width(self) -> int:
        """Rows it holds now."""

    @abstractmethod
    def rows(self) -> list[list[int]]:
        """Each row's tokens so far (forced prefix included, start token excluded)."""

    @property
    def draft_confirmed(self) -> bool:
        """Whether a prefill verified a draft and confirmed all of it: the search then
        has only the tokens past its draft left to take."""
        return bool(self.draft) and self.accepted >= len(self.draft)

    @abstractmethod
    def start(self, fed: int) -> None:
        """The first call fed the start token and `prefix[:fed]`."""

    @abstractmethod
    def observe(self, logits: FloatArray) -> Extension | None:
        """Take its rows' logits [width, vocab] from a decoder call and pick the next
        tokens; None when it has ended."""

    @abstractmethod
    def result(self) -> Hypothesis:
        """The answer, once `observe` returned None."""

    def scores(self, logits: FloatArray) -> FloatArray:
        return _scores(logits, self.rows(), self.config, self.options, self.hook)

    @property
    def needs_logits(self) -> bool:
        """Whether its next step needs the whole logits (a beam ranks every token)."""
        return True

    def take_lookahead(self, most: int) -> list[int]:
        """Up to `most` tokens expected after the next one fed (its last row's last
        token), for a batch that can verify them in the same cached step; the search
        remembers them, so that the next `observe` counts those confirmed. None here."""
        return []


class GreedySearch(Search):
    """One row: the forced prefix, then the most likely token until eos or the limit."""

    def _begin(self) -> None:
        self.tokens: list[int] = []
        self.score = 0.0
        self.finished = False
        self._draft_at = 0  # where the draft is expected to go on (re-alignment)
        self._offered: list[int] = []  # lookahead tokens taken, not confirmed yet
        self.looked_ahead = 0  # lookahead tokens confirmed, over all steps

    @property
    def width(self) -> int:
        return 1

    def rows(self) -> list[list[int]]:
        return [self.tokens]

    def start(self, fed: int) -> None:
        self.tokens = self.prefix[:fed]

    @property
    def needs_logits(self) -> bool:
        """Whether its next step needs the whole logits: a hook rewrites them; else the
        model's own argmax and its log-probability, eos banned below `min_new_tokens`,
        decide the same token (`take`)."""
        return self.hook is not None

    def observe(self, logits: FloatArray) -> Extension | None:
        if len(self.tokens) < len(self.prefix):
            return self.take(self.prefix[len(self.tokens)], 0.0)
        if self.hook is None and not self.options.scores:
            return self.take(
                _greedy_token(logits[0], self.config, len(self.tokens), self.options), math.nan
            )
        if self.hook is None:
            token, score = _greedy_choice(logits[0], self.config, len(self.tokens), self.options)
            return self.take(token, score)
        step = self.scores(logits)
        token = int(step[0].argmax())
        return self.take(token, float(step[0, token]))

    def take(self, token: int, score: float) -> Extension | None:
        """Extend by `token` of log-probability `score` (chosen from the logits, or by the
        model as `observe` would: `needs_logits` False); a forced token is taken as it
        is, whatever is given."""
        if len(self.tokens) < len(self.prefix):
            token, score = self.prefix[len(self.tokens)], 0.0
        self.score += score
        if token == self.config.eos_token_id and len(self.tokens) >= len(self.prefix):
            self.finished = True
            return None
        self.tokens.append(token)
        if self._offered and token == self._offered[0]:
            del self._offered[0]
            self._draft_at += 1
            self.looked_ahead += 1
        else:
            self._offered = []
        end = self._loop_end(self.tokens)
        if end is not None:
            del self.tokens[end:]
            return None
        if len(self.tokens) >= self.limit:
            return None
        return Extension([token], [0])

    def take_lookahead(self, most: int) -> list[int]:
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
                self._offered = self.draft[at : at + most]
                return list(self._offered)
        return []

    def result(self) -> Hypothesis:
        return Hypothesis(tuple(self.tokens), self.score, self.finished)


class BeamSearch(Search):
    """Beam search with length-normalised scores (sum log-prob / generated length ** penalty).

    Starts as one row (the prefix is decoded once) and widens to `beam_size` rows.
    Hypotheses end at eos; the search ends once `beam_size` hypotheses have ended and no
    live beam can still beat the worst of them, or at the length limit.
    """

    def _begin(self) -> None:
        self.beams = self.options.beam_size
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

    def observe(self, logits: FloatArray) -> Extension | None:
        beams, eos = self.beams, self.config.eos_token_id
        cur_len = len(self.seqs[0])
        if cur_len < len(self.prefix):
            # Still inside the forced prefix: every beam takes the forced token.
            token = self.prefix[cur_len]
            self.seqs = [[*seq, token] for seq in self.seqs]
            return Extension([token] * len(self.seqs), list(range(len(self.seqs))))
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
            seq = [*self.seqs[k], token]
            end = self._loop_end(seq)
            if end is not None:
                # A looping row ends like one at the length limit, its repeats dropped.
                if rank < beams:
                    self.done.append((self._norm(score, len(seq)), tuple(seq[:end]), False))
                continue
            seqs.append(seq)
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
        return Extension(tokens, parents)

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
    source_tokens: int | None = None,
) -> Search:
    """Greedy or beam search, by `options.beam_size` (a beam ignores `draft`).
    `source_tokens`: the source's length, for `DecodeOptions.source_cap`."""
    if options.beam_size == 1:
        return GreedySearch(config, prefix, options, hook, draft, source_tokens)
    return BeamSearch(config, prefix, options, hook, source_tokens=source_tokens)
