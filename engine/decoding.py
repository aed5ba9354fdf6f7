"""Greedy and beam search over `MarianOnnx`, with forced target prefixes.

A forced prefix (the text the streaming controller has already committed) goes through the
decoder's no-past branch in ONE call together with the start token; decoding then continues
one token at a time with the cache. In a batch whose prefixes differ in length, the common
length goes in that first call and the rest is forced step by step.

The encoder runs once per source (the caller passes its output in), and the encoder KV of
the first decoder call is reused at every later step (see `engine.runtime`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.config import ModelConfig
from engine.runtime import DecoderCache, EncoderOutput, FloatArray, IntArray, MarianOnnx

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


def _scores(
    logits: FloatArray,
    rows: Sequence[Sequence[int]],
    config: ModelConfig,
    options: DecodeOptions,
    hook: StepHook | None,
) -> FloatArray:
    """Log-probabilities of the next token with banned tokens and early eos masked."""
    logits = logits.astype(np.float32, copy=True)
    logits[:, list(config.bad_token_ids)] = -np.inf
    for r, tokens in enumerate(rows):
        if len(tokens) < options.min_new_tokens:
            logits[r, config.eos_token_id] = -np.inf
    scores = log_softmax(logits)
    if hook is not None:
        scores = hook(rows, scores)
    return scores


def _first_call(
    model: MarianOnnx, enc: EncoderOutput, prefixes: Sequence[Sequence[int]]
) -> tuple[FloatArray, DecoderCache, int]:
    """Start token plus the prefix length all rows share, in one no-past decoder call."""
    common = min(len(p) for p in prefixes)
    start = model.config.decoder_start_token_id
    ids = np.array([[start, *p[:common]] for p in prefixes], dtype=np.int64)
    logits, cache = model.decode_first(enc, ids)
    return logits[:, -1, :], cache, common


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
    batch = enc.batch_size
    prefixes = [list(p) for p in prefixes] if prefixes is not None else [[] for _ in range(batch)]
    if len(prefixes) != batch:
        raise ValueError("one prefix per source is needed")
    config = model.config
    limit = _length_limit(config, options)
    for p in prefixes:
        if len(p) > limit:
            raise ValueError(f"forced prefix of {len(p)} tokens exceeds the {limit}-token limit")
    last, cache, common = _first_call(model, enc, prefixes)
    tokens: list[list[int]] = [list(p[:common]) for p in prefixes]
    scores = [0.0] * batch
    finished = [False] * batch
    live = list(range(batch))  # source index of each row still decoding
    while True:
        rows = [tokens[i] for i in live]
        step = _scores(last, rows, config, options, hook)
        next_ids = np.empty((len(live), 1), dtype=np.int64)
        keep: list[int] = []
        for r, i in enumerate(live):
            forced = prefixes[i]
            if len(tokens[i]) < len(forced):
                token = forced[len(tokens[i])]
            else:
                token = int(step[r].argmax())
                scores[i] += float(step[r, token])
            next_ids[r, 0] = token
            if token == config.eos_token_id and len(tokens[i]) >= len(forced):
                finished[i] = True
                continue
            tokens[i].append(token)
            if len(tokens[i]) < limit:
                keep.append(r)
        if not keep:
            break
        if should_stop is not None and should_stop():
            raise DecodingCancelled
        if len(keep) < len(live):
            rows_kept: IntArray = np.array(keep, dtype=np.int64)
            cache, enc, next_ids = cache.select(rows_kept), enc.select(rows_kept), next_ids[keep]
            live = [live[r] for r in keep]
        last, cache = model.decode_next(enc, cache, next_ids)
    return [Hypothesis(tuple(t), s, f) for t, s, f in zip(tokens, scores, finished, strict=True)]


def beam_search(
    model: MarianOnnx,
    enc: EncoderOutput,
    prefixes: Sequence[Sequence[int]] | None = None,
    options: DecodeOptions = DecodeOptions(beam_size=4),
    *,
    hook: StepHook | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[Hypothesis]:
    """Beam search with length-normalised scores (sum log-prob / generated length ** penalty).

    Hypotheses end at eos; a source is done once `beam_size` hypotheses have ended and no
    live beam can still beat the worst of them, or at the length limit.
    """
    beams = options.beam_size
    if beams == 1:
        return greedy_search(model, enc, prefixes, options, hook=hook, should_stop=should_stop)
    batch = enc.batch_size
    prefixes = [list(p) for p in prefixes] if prefixes is not None else [[] for _ in range(batch)]
    config = model.config
    limit = _length_limit(config, options)
    eos = config.eos_token_id
    penalty = options.length_penalty

    last, cache, common = _first_call(model, enc, prefixes)
    # Every source's prefix is decoded once, then its rows are copied to the beams.
    expand: IntArray = np.repeat(np.arange(batch, dtype=np.int64), beams)
    cache, enc, last = cache.select(expand), enc.select(expand), last[expand]
    seqs: list[list[int]] = [list(prefixes[b][:common]) for b in range(batch) for _ in range(beams)]
    beam_scores = np.full((batch, beams), -np.inf, dtype=np.float64)
    beam_scores[:, 0] = 0.0  # identical copies: only the first may expand at the first step
    done: list[list[tuple[float, tuple[int, ...], bool]]] = [[] for _ in range(batch)]
    closed = [False] * batch

    def norm(score: float, length: int) -> float:
        return float(score / (max(length, 1) ** penalty))

    while True:
        step = _scores(last, seqs, config, options, hook).astype(np.float64)
        vocab = step.shape[1]
        new_seqs: list[list[int]] = []
        new_rows: list[int] = []
        new_tokens: list[int] = []
        new_scores = np.full((batch, beams), -np.inf, dtype=np.float64)
        for b in range(batch):
            base = b * beams
            forced = prefixes[b]
            cur_len = len(seqs[base])
            if closed[b]:
                for k in range(beams):
                    new_seqs.append(seqs[base + k])
                    new_rows.append(base + k)
                    new_tokens.append(eos)
                continue
            if cur_len < len(forced):
                # Still inside the forced prefix: every beam takes the forced token.
                token = forced[cur_len]
                for k in range(beams):
                    new_seqs.append([*seqs[base + k], token])
                    new_rows.append(base + k)
                    new_tokens.append(token)
                new_scores[b] = beam_scores[b]
                continue
            total = (beam_scores[b][:, None] + step[base : base + beams]).reshape(-1)
            order = np.argsort(-total, kind="stable")[: 2 * beams]
            chosen = 0
            for rank, flat in enumerate(order):
                score = float(total[flat])
                if not np.isfinite(score):
                    break
                k, token = divmod(int(flat), vocab)
                if token == eos:
                    if rank < beams:
                        done[b].append((norm(score, cur_len + 1), tuple(seqs[base + k]), True))
                    continue
                new_seqs.append([*seqs[base + k], token])
                new_rows.append(base + k)
                new_tokens.append(token)
                new_scores[b, chosen] = score
                chosen += 1
                if chosen == beams:
                    break
            while chosen < beams:  # fewer live candidates than beams: pad with dead copies
                new_seqs.append([*seqs[base], eos])
                new_rows.append(base)
                new_tokens.append(eos)
                chosen += 1
            done[b].sort(key=lambda d: -d[0])
            del done[b][beams:]
            best_live = float(new_scores[b].max())
            if len(done[b]) >= beams and (
                not np.isfinite(best_live) or norm(best_live, cur_len + 1) <= done[b][-1][0]
            ):
                closed[b] = True
            if cur_len + 1 >= limit:
                closed[b] = True
                for k in range(beams):
                    if np.isfinite(new_scores[b, k]):
                        seq = new_seqs[base + k]
                        done[b].append((norm(float(new_scores[b, k]), len(seq)), tuple(seq), False))
        seqs = new_seqs
        beam_scores = new_scores
        if all(closed):
            break
        if should_stop is not None and should_stop():
            raise DecodingCancelled
        rows: IntArray = np.array(new_rows, dtype=np.int64)
        ids: IntArray = np.array(new_tokens, dtype=np.int64)[:, None]
        last, cache = model.decode_next(enc, cache.select(rows), ids)

    results: list[Hypothesis] = []
    for b in range(batch):
        if done[b]:
            best_score, best_seq, finished = max(done[b], key=lambda d: d[0])
            results.append(Hypothesis(best_seq, best_score, finished))
        else:
            results.append(Hypothesis(tuple(prefixes[b]), 0.0, False))
    return results


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
    fn = greedy_search if options.beam_size == 1 else beam_search
    return fn(model, enc, prefixes, options, hook=hook, should_stop=should_stop)
