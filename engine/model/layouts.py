"""The decoder layouts: one class per shape of export, each saying what its calls are fed
and what they return, so that no call site switches on the layout.

Every layout has two calls: `prefill` (the start token and any forced prefix, no past) and
`step` (more tokens after the cache). Only the prefill returns real cross-attention KV
(`present.*.encoder.*`): it is kept for the whole decode and fed at every step, whose own
encoder presents come back empty and are never asked for.

- `MergedLayout`: one file, an `If` on `use_cache_branch`, decoder and encoder KV;
- `SplitLayout`: a no-past file and a with-past file (or the merged file's branches);
- `SelfKvOnlyLayout`: decoder KV only, cross-attention recomputed at every step;
- `NoCacheLayout`: no cache, every step re-runs the whole target prefix;
- `MaskedLayout` (`engine.model.masked`): the masks rewrite of the first two run for rows
  of equal length; `MaskedDecoder` there runs each row at its own length.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from engine.model.config import ModelConfig
from engine.model.names import (
    ENCODER_ATTENTION_MASK,
    ENCODER_HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    PRESENT,
    USE_CACHE_BRANCH,
    kv_names,
)

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]


class DecoderLayout(str, Enum):
    """How the decoder export handles its KV cache."""

    MERGED = "merged"
    SPLIT = "split"
    SELF_KV_ONLY = "self_kv_only"
    NO_CACHE = "no_cache"


@dataclass(frozen=True)
class EncoderOutput:
    """Encoder states for a batch of sources, plus the mask the decoder attends with."""

    hidden_states: FloatArray
    attention_mask: IntArray

    @property
    def batch_size(self) -> int:
        return int(self.hidden_states.shape[0])

    def select(self, rows: IntArray) -> EncoderOutput:
        return EncoderOutput(self.hidden_states[rows], self.attention_mask[rows])


def stack_encoder_outputs(outputs: Sequence[EncoderOutput]) -> EncoderOutput:
    """One batch from single-source outputs of different lengths: right-padded with zeros
    and `attention_mask` 0, which cross-attention ignores exactly. A lone output whose
    arrays a call takes as they are (contiguous, the mask int64) is its own batch: no
    copy."""
    if len(outputs) == 1:
        only = outputs[0]
        mask = only.attention_mask
        if (
            mask.dtype == np.int64
            and mask.flags.c_contiguous
            and only.hidden_states.flags.c_contiguous
        ):
            return only
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


@dataclass(frozen=True)
class DecoderCache:
    """Everything the next decoder step needs besides the new token.

    `self_kv` grows every step; `cross_kv` is the prefill's encoder KV, reused unchanged;
    `tokens` is the whole decoder input so far (the no-cache layout re-feeds it).
    """

    self_kv: tuple[FloatArray, ...]
    cross_kv: tuple[FloatArray, ...]
    tokens: IntArray

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def select(self, rows: IntArray) -> DecoderCache:
        """Rows of the cache, in the given order (beam reordering, dropping finished rows)."""
        return DecoderCache(
            tuple(a[rows] for a in self.self_kv),
            tuple(a[rows] for a in self.cross_kv),
            self.tokens[rows],
        )


class KvNames:
    """The KV input and output names of a decoder with `layers` layers."""

    def __init__(self, layers: int) -> None:
        self.self_in = kv_names(layers, "decoder")
        self.cross_in = kv_names(layers, "encoder")
        self.self_out = kv_names(layers, "decoder", PRESENT)
        self.cross_out = kv_names(layers, "encoder", PRESENT)
        self.present = [*self.self_out, *self.cross_out]  # a prefill's outputs, in order


class LayoutDecoder:
    """One decoder layout's calls over its sessions: `no_past` (the prefill's graph) and
    `with_past` (the steps' graph; the same session for a merged or self-KV-only file,
    None without a cache)."""

    layout: DecoderLayout

    def __init__(
        self,
        no_past: ort.InferenceSession,
        with_past: ort.InferenceSession | None,
        config: ModelConfig,
        float_type: type[np.floating[Any]],
        calls: Counter[str],
    ) -> None:
        self.no_past = no_past
        self.with_past = with_past
        self.config = config
        self.float_type = float_type
        self.calls = calls
        self.names = KvNames(config.decoder_layers)
        self.step_inputs = set() if with_past is None else {i.name for i in with_past.get_inputs()}

    def _run(
        self, session: ort.InferenceSession, outputs: list[str], feed: dict[str, Any]
    ) -> list[Any]:
        self.calls["decoder"] += 1
        return list(session.run(outputs, feed))

    def _empty(self, batch: int) -> FloatArray:
        heads, dim = self.config.decoder_attention_heads, self.config.head_dim
        return np.zeros((batch, heads, 0, dim), dtype=self.float_type)

    def prefill_feed(self, enc: EncoderOutput, input_ids: IntArray) -> dict[str, Any]:
        """What the prefill (no past) is fed."""
        return {
            ENCODER_ATTENTION_MASK: enc.attention_mask,
            INPUT_IDS: input_ids,
            ENCODER_HIDDEN_STATES: enc.hidden_states,
        }

    def prefill(self, enc: EncoderOutput, input_ids: IntArray) -> tuple[FloatArray, DecoderCache]:
        """Logits [B, T, V] and the cache: the self KV, and the encoder KV that every later
        call is fed (only this call's `present.*.encoder.*` are real)."""
        names = self.names
        out = self._run(
            self.no_past,
            [LOGITS, *names.self_out, *names.cross_out],
            self.prefill_feed(enc, input_ids),
        )
        n = len(names.self_out)
        return out[0], DecoderCache(tuple(out[1 : 1 + n]), tuple(out[1 + n :]), input_ids)

    def step_feed(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> dict[str, Any]:
        """What a step is fed: the new token, the self KV, the prefill's encoder KV."""
        feed: dict[str, Any] = {ENCODER_ATTENTION_MASK: enc.attention_mask, INPUT_IDS: input_ids}
        feed.update(zip(self.names.self_in, cache.self_kv, strict=True))
        if cache.cross_kv:  # the prefill's encoder KV, unless the layout has none
            feed.update(zip(self.names.cross_in, cache.cross_kv, strict=True))
        return feed

    def step(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        """One token per row: last-position logits [B, V] and the cache grown by it."""
        assert self.with_past is not None
        tokens = np.concatenate([cache.tokens, input_ids], axis=1)
        out = self._run(
            self.with_past,
            [LOGITS, *self.names.self_out],
            self.step_feed(enc, cache, input_ids),
        )
        return out[0][:, -1, :], DecoderCache(tuple(out[1:]), cache.cross_kv, tokens)


class SplitLayout(LayoutDecoder):
    """The no-past file, then the with-past file. A with-past file that also declares
    `encoder_hidden_states` gets them, besides the encoder KV."""

    layout = DecoderLayout.SPLIT

    def step_feed(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> dict[str, Any]:
        feed = super().step_feed(enc, cache, input_ids)
        if ENCODER_HIDDEN_STATES in self.step_inputs:
            feed[ENCODER_HIDDEN_STATES] = enc.hidden_states
        return feed


class MergedLayout(LayoutDecoder):
    """The merged file: one `If` on `use_cache_branch`; both branches declare every input,
    so the prefill gets empty pasts and steps zero-length states."""

    layout = DecoderLayout.MERGED

    def prefill_feed(self, enc: EncoderOutput, input_ids: IntArray) -> dict[str, Any]:
        feed = super().prefill_feed(enc, input_ids)
        feed[USE_CACHE_BRANCH] = np.zeros((1,), dtype=np.bool_)
        for name in (*self.names.self_in, *self.names.cross_in):
            feed[name] = self._empty(input_ids.shape[0])
        return feed

    def step_feed(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> dict[str, Any]:
        feed = super().step_feed(enc, cache, input_ids)
        feed[USE_CACHE_BRANCH] = np.ones((1,), dtype=np.bool_)
        # Ignored on the cached branch, but the graph still declares the input.
        batch = input_ids.shape[0]
        feed[ENCODER_HIDDEN_STATES] = np.zeros(
            (batch, 0, self.config.d_model), dtype=self.float_type
        )
        return feed


class SelfKvOnlyLayout(LayoutDecoder):
    """A decoder with its own KV but no encoder KV: cross-attention is recomputed from
    `encoder_hidden_states` at every step, so there is no encoder KV to keep."""

    layout = DecoderLayout.SELF_KV_ONLY

    def prefill_feed(self, enc: EncoderOutput, input_ids: IntArray) -> dict[str, Any]:
        feed = super().prefill_feed(enc, input_ids)
        for name in self.names.self_in:
            feed[name] = self._empty(input_ids.shape[0])
        return feed

    def prefill(self, enc: EncoderOutput, input_ids: IntArray) -> tuple[FloatArray, DecoderCache]:
        out = self._run(
            self.no_past, [LOGITS, *self.names.self_out], self.prefill_feed(enc, input_ids)
        )
        return out[0], DecoderCache(tuple(out[1:]), (), input_ids)

    def step_feed(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> dict[str, Any]:
        feed = super().step_feed(enc, cache, input_ids)
        feed[ENCODER_HIDDEN_STATES] = enc.hidden_states
        return feed


class NoCacheLayout(LayoutDecoder):
    """No KV cache: every call re-runs the whole target prefix through the no-past graph
    (a decoder exported without past, or `use_cache=False` on any layout, fed as its
    native layout's prefill)."""

    layout = DecoderLayout.NO_CACHE

    def __init__(self, native: LayoutDecoder) -> None:
        super().__init__(native.no_past, None, native.config, native.float_type, native.calls)
        self.native = native

    def prefill_feed(self, enc: EncoderOutput, input_ids: IntArray) -> dict[str, Any]:
        return self.native.prefill_feed(enc, input_ids)

    def prefill(self, enc: EncoderOutput, input_ids: IntArray) -> tuple[FloatArray, DecoderCache]:
        (logits,) = self._run(self.no_past, [LOGITS], self.prefill_feed(enc, input_ids))
        return logits, DecoderCache((), (), input_ids)

    def step(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        tokens = np.concatenate([cache.tokens, input_ids], axis=1)
        logits, _ = self.prefill(enc, tokens)
        return logits[:, -1, :], DecoderCache((), (), tokens)


LAYOUTS: dict[DecoderLayout, type[LayoutDecoder]] = {
    DecoderLayout.MERGED: MergedLayout,
    DecoderLayout.SPLIT: SplitLayout,
    DecoderLayout.SELF_KV_ONLY: SelfKvOnlyLayout,
    DecoderLayout.NO_CACHE: SplitLayout,  # a no-past file is fed like the split pair's first
}
"""The class that feeds each native layout (`NoCacheLayout` wraps one of them)."""
