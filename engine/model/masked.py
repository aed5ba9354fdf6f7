"""The batchable decoder: the masks rewrite of the no-past and with-past graphs
(`engine.model.passes.masks`), each row at its own length, so that rows of different
lengths share a call (continuous batching); `MaskedLayout` runs it as a plain layout for
rows of equal length (lockstep). Built once by the load and never changed after: the KV
backends' own graphs (`engine.model.kv.inplace.steps`, `engine.model.kv.slots.pool`) are
objects of their own beside it (`engine.model.backend`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import onnxruntime as ort

from engine.model.config import ModelConfig
from engine.model.layouts import (
    DecoderCache,
    EncoderOutput,
    FloatArray,
    IntArray,
    KvNames,
    LayoutDecoder,
)
from engine.model.logits import CutGraph, RowLogits, head_logits, project_runs
from engine.model.names import (
    ENCODER_ATTENTION_MASK,
    ENCODER_HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    MASK_INPUT,
    POSITIONS_INPUT,
)


class MaskedSources(NamedTuple):
    """What the load opened the masked decoder from, kept only until the KV backend's
    own graphs are built from it (`engine.model.backend`): the rewritten no-past, with-past
    and one-token graphs as serialised bytes (int8 per token where `per_token`; the
    one-token graph with the files' own quantization, None without one), and the whole
    (uncut) sessions of the two step graphs, which the backend's graphs are checked
    against."""

    no_past: bytes
    with_past: bytes
    one_token: bytes | None
    step_session: ort.InferenceSession
    one_token_session: ort.InferenceSession | None
    per_token: bool


@dataclass(frozen=True, eq=False)
class MaskedDecoder:
    """The batchable decoder layout: the model's no-past and with-past decoders rewritten
    to take `decoder_attention_mask` [B, past + cur] and `decoder_position_ids` [B, cur]
    (`engine.model.passes.masks`), so that each row has its own length: padding slots in
    the self-attention cache are masked out (they must hold finite values: zeros) and each
    row's positions are its own.

    `prefill` runs start token + forced prefix of new rows (right-padded) in one call and
    returns their self and cross KV; `step` runs one token for every row of a batch, or
    several (lookahead) where `lookahead` says the graph is causal among new tokens. A row
    joins a batch with its self KV zero-padded to the batch's slot count, masked 0 there.
    Frozen: what the load checked is what runs.
    """

    # The no-past graph, and the with-past one for steps (`one_token`: see below), each
    # whole or cut at its output projection.
    prefills: CutGraph
    steps: CutGraph
    layers: int
    max_difference: float
    calls: Counter[str] = field(compare=False)  # the model's call counter, shared
    # Whether a step may take several tokens per row (lookahead).
    lookahead: bool = False
    # A call of one token (one row, no lookahead) where that has a faster graph of its own
    # (int8 per token: the files' fused quantization gives the same values).
    one_token: CutGraph | None = None
    _prefill_inputs: frozenset[str] = field(init=False, repr=False, compare=False)
    _step_inputs: frozenset[str] = field(init=False, repr=False, compare=False)
    _names: KvNames = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        derived = {
            "_prefill_inputs": frozenset(i.name for i in self.prefills.session.get_inputs()),
            "_step_inputs": frozenset(i.name for i in self.steps.session.get_inputs()),
            "_names": KvNames(self.layers),
        }
        for name, value in derived.items():  # a frozen dataclass sets its own fields so
            object.__setattr__(self, name, value)

    @property
    def head(self) -> tuple[ort.InferenceSession, str] | None:
        """(session, input name): the step's output projection run apart."""
        return self.steps.head

    def _feed(self, declared: frozenset[str], values: dict[str, Any]) -> dict[str, Any]:
        return {name: value for name, value in values.items() if name in declared}

    def prefill(
        self,
        enc: EncoderOutput,
        input_ids: IntArray,
        mask: IntArray,
        needed_from: IntArray | None = None,
        *,
        alone: bool = False,
    ) -> tuple[RowLogits, tuple[FloatArray, ...], tuple[FloatArray, ...]]:
        """Logits and the rows' self and cross KV, for right-padded `input_ids` whose real
        tokens `mask` marks (1). `needed_from` [B]: each row's first position whose logits
        the caller reads (after the forced prefix); where the projection runs apart, the
        earlier ones and the padding are not computed (`RowLogits` holds the rest).

        Why: a forced prefix is often longer than the draft and the tail read after it,
        and the vocabulary projection is most of a position's cost. `alone`: no other lane
        is running, the projection may run on every core (`CutGraph.alone`)."""
        batch, length = input_ids.shape
        positions = np.arange(length, dtype=np.int64)[None, :]  # `np.tile`, less its Python
        if batch > 1:
            positions = np.repeat(positions, batch, axis=0)
        values: dict[str, Any] = {
            ENCODER_ATTENTION_MASK: enc.attention_mask,
            INPUT_IDS: input_ids,
            ENCODER_HIDDEN_STATES: enc.hidden_states,
            MASK_INPUT: mask,
            POSITIONS_INPUT: positions,
        }
        self.calls["decoder"] += 1
        feed = self._feed(self._prefill_inputs, values)
        kv = self._names.present
        n = len(self._names.self_out)
        session, head, everyone = self.prefills
        if head is None:
            out = session.run([LOGITS, *kv], feed)
            return RowLogits.whole(out[0]), tuple(out[1 : 1 + n]), tuple(out[1 + n :])
        out = session.run([head[1], *kv], feed)  # the body's output: the head's input
        # Right-padded: row r's real tokens are its first `lengths[r]`; those read from
        # `needed_from[r]` on are one run.
        lengths = np.add.reduce(mask, axis=1)  # `mask.sum`, less its Python wrapper
        if needed_from is None:
            firsts = np.zeros(batch, dtype=np.int64)
        else:
            firsts = needed_from.astype(np.int64, copy=False)
        counts = np.maximum(lengths - firsts, 0)
        chosen = everyone if alone and everyone is not None else head
        logits = project_runs(chosen, out[0], firsts, counts)
        return logits, tuple(out[1 : 1 + n]), tuple(out[1 + n :])

    def step(
        self,
        enc: EncoderOutput,
        input_ids: IntArray,
        positions: IntArray,
        mask: IntArray,
        self_kv: tuple[FloatArray, ...],
        cross_kv: tuple[FloatArray, ...],
        *,
        alone: bool = False,
    ) -> tuple[FloatArray, tuple[FloatArray, ...]]:
        """One token per row: logits [B, V] and the self KV grown by one slot. Several per
        row (`input_ids` [B, T], T > 1: lookahead, whose padding `mask` marks 0 in its
        last T columns): logits [B, T, V], meaningless at padding, and T more slots.
        `alone`: as for `prefill`."""
        values: dict[str, Any] = {
            ENCODER_ATTENTION_MASK: enc.attention_mask,
            INPUT_IDS: input_ids,
            ENCODER_HIDDEN_STATES: enc.hidden_states,
            MASK_INPUT: mask,
            POSITIONS_INPUT: positions,
        }
        values.update(zip(self._names.self_in, self_kv, strict=True))
        values.update(zip(self._names.cross_in, cross_kv, strict=True))
        self.calls["decoder"] += 1
        feed = self._feed(self._step_inputs, values)
        fed = input_ids.shape[1]
        graph = self.one_token if self.one_token is not None and input_ids.size == 1 else self.steps
        self_out = self._names.self_out
        if graph.head is None:
            out = graph.session.run([LOGITS, *self_out], feed)
            return (out[0][:, -1, :] if fed == 1 else out[0]), tuple(out[1:])
        hidden = graph.head[1]  # the body's output
        out = graph.session.run([hidden, *self_out], feed)
        return head_logits(graph, out[0], mask[:, -fed:].astype(bool), alone), tuple(out[1:])


class MaskedLayout(LayoutDecoder):
    """The batchable rewrite (`MaskedDecoder`) run as a plain layout, for calls whose rows
    all have the same length (lockstep batches): an all-ones mask and consecutive
    positions, with which it gives the original graphs' logits."""

    def __init__(
        self,
        masked: MaskedDecoder,
        config: ModelConfig,
        float_type: type[np.floating[Any]],
        calls: Counter[str],
    ) -> None:
        super().__init__(masked.prefills.session, masked.steps.session, config, float_type, calls)
        self.masked = masked

    def prefill(self, enc: EncoderOutput, input_ids: IntArray) -> tuple[FloatArray, DecoderCache]:
        mask = np.ones(input_ids.shape, dtype=np.int64)
        logits, self_kv, cross_kv = self.masked.prefill(enc, input_ids, mask)
        return logits.dense(input_ids.shape[1]), DecoderCache(self_kv, cross_kv, input_ids)

    def step(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        batch, past = input_ids.shape[0], cache.length
        mask = np.ones((batch, past + 1), dtype=np.int64)
        positions = np.full((batch, 1), past, dtype=np.int64)
        logits, self_kv = self.masked.step(
            enc, input_ids, positions, mask, cache.self_kv, cache.cross_kv
        )
        tokens = np.concatenate([cache.tokens, input_ids], axis=1)
        return logits, DecoderCache(self_kv, cache.cross_kv, tokens)
