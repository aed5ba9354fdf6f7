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
- `MaskedDecoder`: the masks rewrite of the first two, each row at its own length
  (continuous batching); `MaskedLayout` runs it for rows of equal length.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from engine.model.config import ModelConfig
from engine.model.names import (
    ENCODER_ATTENTION_MASK,
    ENCODER_HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    MASK_INPUT,
    POSITIONS_INPUT,
    PRESENT,
    SEQLENS_INPUT,
    TOTAL_INPUT,
    USE_CACHE_BRANCH,
    kv_names,
)

if TYPE_CHECKING:
    from engine.model.slots import SlotGraphs

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


class _KvNames:
    """The KV input and output names of a decoder with `layers` layers."""

    def __init__(self, layers: int) -> None:
        self.self_in = kv_names(layers, "decoder")
        self.cross_in = kv_names(layers, "encoder")
        self.self_out = kv_names(layers, "decoder", PRESENT)
        self.cross_out = kv_names(layers, "encoder", PRESENT)


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
        self.names = _KvNames(config.decoder_layers)
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


# -- the batchable layout -----------------------------------------------------------------


class CutGraph(NamedTuple):
    """One rewritten decoder graph (no-past or with-past) as the scheduler runs it: whole
    (`session`, `head` None), or its body (`session`) with the output projection apart
    (`head`: the projection's session and the input it takes, `passes.head`), and the
    projection on every core (`alone`, the same kind) for a lane that runs alone."""

    session: ort.InferenceSession
    head: tuple[ort.InferenceSession, str] | None
    alone: tuple[ort.InferenceSession, str] | None = None


HEAD_POSITIONS = 32
"""Positions per call of an output projection run apart (`CutGraph.head`). Its int32
products and float logits are positions x vocabulary (8 MiB each at 32 x 65k), and
ONNX Runtime's arena keeps the largest block it ever served for the session's life: in one
call, a prefill of 94 positions left 380 MiB held after a 32-stream run. Calls of 32 cost
no more than one call over everything (`examples/benchmarks/prefill_cost.py`), and each
writes straight into its buffer (I/O binding), with no copy."""


class _Logits(Protocol):
    """Where a `RowLogits`' packed positions come from."""

    def position(self, index: int) -> FloatArray:
        """Packed position `index`'s logits [V]; valid until the next read on this thread."""
        ...

    def all(self) -> FloatArray:
        """Every packed position [K, V], in an array of its own (not a thread's buffer)."""
        ...


@dataclass(frozen=True)
class _Computed:
    """Logits computed in the call: [K, V]."""

    values: FloatArray

    def position(self, index: int) -> FloatArray:
        row: FloatArray = self.values[index]
        return row

    def all(self) -> FloatArray:
        return self.values


_chunks = threading.local()  # per thread: `held` (owner, chunk, logits) and `buffers`


class _Projected:
    """Logits of hidden states `picked` [K, d], projected `HEAD_POSITIONS` at a time when a
    position of the chunk is first read, into one buffer per thread.

    Why: a prefill's searches read each row's positions in order and stop at the first
    draft token the model does not confirm. Projected all at once, the positions of every
    row took a fresh [K, V] array per prefill (25 MiB at 96 positions, on pages the kernel
    must fault in and zero), held until the last row was read, on each lane at once; and
    the chunks past every row's first mismatch were projected for nothing."""

    def __init__(
        self, head: tuple[ort.InferenceSession, str], vocab: int, dtype: Any, picked: FloatArray
    ) -> None:
        self._session, self._input = head
        self._picked = picked
        self._chunk = HEAD_POSITIONS
        self._vocab, self._dtype = vocab, dtype
        self._values: FloatArray | None = None
        # What the thread's buffer says it holds (not `self`: the buffer would keep it alive)
        self._token = object()

    def _into(self, begin: int, out: FloatArray) -> None:
        """Project packed positions [begin, begin + len(out)) into `out` (contiguous)."""
        binding = self._session.io_binding()
        binding.bind_cpu_input(self._input, self._picked[None, begin : begin + len(out)])
        binding.bind_output(
            LOGITS, "cpu", 0, self._dtype, [1, len(out), self._vocab], out.ctypes.data
        )
        self._session.run_with_iobinding(binding)

    def position(self, index: int) -> FloatArray:
        if self._values is not None:
            row: FloatArray = self._values[index]
            return row
        chunk = index // self._chunk
        held: tuple[object, int, FloatArray] | None = getattr(_chunks, "held", None)
        if held is None or held[0] is not self._token or held[1] != chunk:
            key = (self._chunk, self._vocab, self._dtype)
            buffers: dict[tuple[int, int, Any], FloatArray] = getattr(_chunks, "buffers", {})
            _chunks.buffers = buffers
            if key not in buffers:
                buffers.clear()  # one buffer per thread: the newest head's shape
                buffers[key] = np.empty((self._chunk, self._vocab), dtype=self._dtype)
            begin = chunk * self._chunk
            out = buffers[key][: min(self._chunk, len(self._picked) - begin)]
            self._into(begin, out)
            held = _chunks.held = (self._token, chunk, out)
        row = held[2][index - chunk * self._chunk]
        return row

    def all(self) -> FloatArray:
        if self._values is None:
            values = np.empty((len(self._picked), self._vocab), dtype=self._dtype)
            for begin in range(0, len(values), self._chunk):
                self._into(begin, values[begin : begin + self._chunk])
            self._values = values
        return self._values


class RowRun:
    """One row's logits from a position on: `run[i]` [V] is the i-th (valid until the next
    read on this thread: a search copies what it observes)."""

    def __init__(self, source: _Logits, begin: int, end: int) -> None:
        self._source, self._begin, self._end = source, begin, end

    def __len__(self) -> int:
        return self._end - self._begin

    def __getitem__(self, index: int) -> FloatArray:
        if not 0 <= index < self._end - self._begin:
            raise IndexError(f"position {index} of a run of {self._end - self._begin}")
        return self._source.position(self._begin + index)


@dataclass(frozen=True)
class RowLogits:
    """Logits at a run of consecutive positions of each row, packed: row r's start at its
    position `firsts[r]` and are packed positions `offsets[r]:offsets[r + 1]`.

    Why packed: a prefill reads only each row's draft and the position after it, and
    spreading those over a zeroed [rows, positions, vocab] array cost a copy of every
    logit (5 ms of a 21 ms projection at 94 positions) and as much memory again. A
    projection run apart is computed as rows are read (`_Projected`)."""

    source: _Logits
    firsts: IntArray
    offsets: IntArray

    @classmethod
    def whole(cls, logits: FloatArray) -> RowLogits:
        """Every position of logits [B, T, V]."""
        batch, length, vocab = logits.shape
        return cls(
            _Computed(logits.reshape(batch * length, vocab)),
            np.zeros(batch, dtype=np.int64),
            np.arange(batch + 1, dtype=np.int64) * length,
        )

    @property
    def values(self) -> FloatArray:
        """Every packed position's logits [K, V] (all projected, once)."""
        return self.source.all()

    def row(self, row: int, start: int) -> RowRun:
        """Row `row`'s logits from its position `start` on."""
        first = int(self.firsts[row])
        begin, end = int(self.offsets[row]), int(self.offsets[row + 1])
        if not first <= start < first + (end - begin):
            raise IndexError(f"row {row}: position {start} was not projected")
        return RowRun(self.source, begin + start - first, end)

    def dense(self, length: int) -> FloatArray:
        """As [B, `length`, V], zeros where nothing was projected (a view when every
        position was)."""
        values = self.values
        batch, vocab = len(self.firsts), values.shape[-1]
        counts = np.diff(self.offsets)
        if not self.firsts.any() and np.all(counts == length):
            return values.reshape(batch, length, vocab)
        logits = np.zeros((batch, length, vocab), dtype=values.dtype)
        for r in range(batch):
            first, begin = int(self.firsts[r]), int(self.offsets[r])
            logits[r, first : first + counts[r]] = values[begin : begin + counts[r]]
        return logits


def _project(
    head: tuple[ort.InferenceSession, str], states: FloatArray, wanted: npt.NDArray[np.bool_]
) -> RowLogits:
    """Logits from a cut graph's hidden `states` [B, T, d], computed only at the positions
    `wanted` marks, one run of consecutive positions per row: the output projection is
    most of a position's cost, and padding, lookahead slots past a row's own and a forced
    prefix are never read. In calls of `HEAD_POSITIONS`, as the positions are read."""
    session, hidden = head
    counts = wanted.sum(axis=1)
    firsts = np.argmax(wanted, axis=1)
    last = np.where(counts > 0, wanted.shape[1] - 1 - np.argmax(wanted[:, ::-1], axis=1), -1)
    if np.any(counts != np.where(counts > 0, last - firsts + 1, 0)):
        raise ValueError("the positions to project must be consecutive in each row")
    picked = np.ascontiguousarray(states[wanted])  # [K, d]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    output = session.get_outputs()[0]
    vocab = output.shape[-1]
    source: _Logits
    if not isinstance(vocab, int):  # a symbolic vocabulary: one call, its own output
        source = _Computed(session.run([LOGITS], {hidden: picked[None]})[0][0])
    else:
        dtype = np.float16 if output.type == "tensor(float16)" else np.float32
        source = _Projected(head, vocab, dtype, picked)
    return RowLogits(source, firsts.astype(np.int64), offsets)


class InPlaceBinding:
    """One caller's I/O binding of an in-place step (`MaskedDecoder.step_in_place`), kept
    between its steps with what it binds: the session, the arrays bound by reference (the
    encoder outputs and cross-attention keys and values, compared by identity, then the
    contiguous arrays actually bound, all held here so that the memory bound stays
    alive) and each buffer view's address and shape.

    Why: a step binds about 30 inputs and outputs, 0.1-0.15 ms of Python and ONNX Runtime
    calls, 3-5% of a one-row step; between joins and leaves only the tokens and positions
    change."""

    def __init__(self) -> None:
        self._session: ort.InferenceSession | None = None
        self._state: tuple[object, ...] = ()
        self._views: tuple[tuple[int, tuple[int, ...]], ...] = ()
        self._binding: ort.IOBinding | None = None
        self._held: tuple[object, ...] = ()

    def holds(
        self,
        session: ort.InferenceSession,
        state: tuple[object, ...],
        views: tuple[tuple[int, tuple[int, ...]], ...],
    ) -> bool:
        """Whether the kept binding is of `session` with these arrays and buffer views."""
        return (
            self._binding is not None
            and self._session is session
            and len(state) == len(self._state)
            and all(a is b for a, b in zip(state, self._state, strict=True))
            and views == self._views
        )

    def keep(
        self,
        session: ort.InferenceSession,
        state: tuple[object, ...],
        views: tuple[tuple[int, tuple[int, ...]], ...],
        binding: ort.IOBinding,
        held: tuple[object, ...],
    ) -> None:
        """Keep `binding`, of `session` with these arrays and views; `held`: the arrays it
        reads (copies where `state`'s were not contiguous), kept alive with it."""
        self._session, self._state, self._views, self._binding = session, state, views, binding
        self._held = held

    @property
    def binding(self) -> ort.IOBinding:
        assert self._binding is not None
        return self._binding


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
    """

    def __init__(
        self,
        prefills: CutGraph,
        steps: CutGraph,
        layers: int,
        max_difference: float,
        calls: Counter[str],
        lookahead: bool = False,
        one_token: CutGraph | None = None,
    ) -> None:
        # The no-past graph, and the with-past one for steps (`one_token`: see below),
        # each whole or cut at its output projection.
        self.prefills = prefills
        self.steps = steps
        # A call of one token (one row, no lookahead) where that has a faster graph of its
        # own (int8 per token: the files' fused quantization gives the same values).
        self.one_token = one_token
        # The step over KV slots, where the graphs allow it (`engine.model.slots`).
        self.slots: SlotGraphs | None = None
        # The step with self-attention in place (`passes.inplace`, `step_in_place`), and
        # its one-row form where `one_token` has one; None where the load did not build it.
        self.inplace: CutGraph | None = None
        self.inplace_one: CutGraph | None = None
        # Whether a step may take several tokens per row (`ContinuousBatch` lookahead).
        self.lookahead = lookahead
        self.max_difference = max_difference
        self._prefill_inputs = {i.name for i in prefills.session.get_inputs()}
        self._step_inputs = {i.name for i in steps.session.get_inputs()}
        self._inplace_inputs: dict[int, set[str]] = {}
        self._names = _KvNames(layers)
        self.calls = calls  # the model's call counter, shared

    @property
    def head(self) -> tuple[ort.InferenceSession, str] | None:
        """(session, input name): the step's output projection run apart."""
        return self.steps.head

    def _feed(self, declared: set[str], values: dict[str, Any]) -> dict[str, Any]:
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
        positions = np.tile(np.arange(length, dtype=np.int64), (batch, 1))
        values: dict[str, Any] = {
            ENCODER_ATTENTION_MASK: enc.attention_mask,
            INPUT_IDS: input_ids,
            ENCODER_HIDDEN_STATES: enc.hidden_states,
            MASK_INPUT: mask,
            POSITIONS_INPUT: positions,
        }
        self.calls["decoder"] += 1
        feed = self._feed(self._prefill_inputs, values)
        kv = [*self._names.self_out, *self._names.cross_out]
        n = len(self._names.self_out)
        session, head, everyone = self.prefills
        if head is None:
            out = session.run([LOGITS, *kv], feed)
            return RowLogits.whole(out[0]), tuple(out[1 : 1 + n]), tuple(out[1 + n :])
        out = session.run([head[1], *kv], feed)  # the body's output: the head's input
        wanted = mask.astype(bool)
        if needed_from is not None:
            wanted &= np.arange(length)[None, :] >= needed_from[:, None]
        logits = _project(everyone if alone and everyone is not None else head, out[0], wanted)
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
        return _head_logits(graph, out[0], mask[:, -fed:].astype(bool), alone), tuple(out[1:])

    def step_in_place(
        self,
        enc: EncoderOutput,
        input_ids: IntArray,
        lengths: IntArray,
        buffers: Sequence[FloatArray],
        cross_kv: tuple[FloatArray, ...],
        *,
        alone: bool = False,
        bound: InPlaceBinding | None = None,
    ) -> FloatArray:
        """One token per row over self-attention buffers (`inplace`): `buffers` are each
        layer's key and value, `[rows, heads, capacity, head_dim]` in `kv_names` order,
        row r's first `lengths[r]` positions real; the step writes position `lengths[r]`
        of every buffer in place (the caller then counts it) and returns logits [B, V].
        One row may take several tokens (`input_ids` [1, T], lookahead): logits
        [1, T, V], positions `lengths[0]` to `lengths[0] + T - 1` written.

        Why: the ordinary `step` copies every row's keys and values into new arrays
        at every step (`Concat`); here they never move (docs/performance.md).
        `bound`: the caller's binding, kept from its last step: the buffers, the
        cross-attention state and the encoder outputs are bound again only when they
        changed (rows joined or left, the buffers grew), the tokens and positions at
        every step. One per caller (a lane): a binding is not shared between threads."""
        rows, fed = input_ids.shape
        if fed > 1 and rows > 1:
            raise ValueError("several tokens per row take one row (GroupQueryAttention)")
        one = self.inplace_one if input_ids.size == 1 else None
        graph = one if one is not None else self.inplace
        assert graph is not None
        session = graph.session
        declared = self._inplace_inputs.get(id(session))
        if declared is None:
            declared = self._inplace_inputs[id(session)] = {i.name for i in session.get_inputs()}
        state = (enc.attention_mask, enc.hidden_states, *cross_kv)
        views = tuple((b.ctypes.data, b.shape) for b in buffers)
        result = graph.head[1] if graph.head is not None else LOGITS
        if bound is None or not bound.holds(session, state, views):
            binding = session.io_binding()
            binding.bind_output(result)  # first: the run's output 0
            values: dict[str, Any] = {
                ENCODER_ATTENTION_MASK: enc.attention_mask,
                ENCODER_HIDDEN_STATES: enc.hidden_states,
            }
            values.update(zip(self._names.cross_in, cross_kv, strict=True))
            held = {n: np.ascontiguousarray(v) for n, v in values.items() if n in declared}
            for name, value in held.items():
                binding.bind_cpu_input(name, value)
            pairs = zip(self._names.self_in, self._names.self_out, buffers, strict=True)
            for past, present, buffer in pairs:
                shape, address = list(buffer.shape), buffer.ctypes.data
                binding.bind_input(past, "cpu", 0, buffer.dtype, shape, address)
                binding.bind_output(present, "cpu", 0, buffer.dtype, shape, address)
            if bound is not None:  # with the arrays bound (copies where not contiguous)
                bound.keep(session, state, views, binding, tuple(held.values()))
        else:
            binding = bound.binding
            binding.bind_output(result)  # again: allocated by this run, not the last step's
        steps: dict[str, Any] = {
            INPUT_IDS: input_ids,
            POSITIONS_INPUT: lengths.reshape(-1, 1) + np.arange(fed, dtype=np.int64)[None, :],
            SEQLENS_INPUT: (lengths + fed - 1).astype(np.int32),
            TOTAL_INPUT: np.array(int(lengths.max()) + fed, dtype=np.int32),
        }
        for name, value in steps.items():
            if name in declared:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        self.calls["decoder"] += 1
        session.run_with_iobinding(binding)
        out = binding.get_outputs()[0].numpy()
        if graph.head is None:
            logits: FloatArray = out[:, -1, :] if fed == 1 else out
            return logits
        return _head_logits(graph, out, np.ones((rows, fed), dtype=bool), alone)


def _head_logits(
    graph: CutGraph, hidden: FloatArray, real: npt.NDArray[np.bool_], alone: bool
) -> FloatArray:
    """A cut step's logits from its body's `hidden` [B, T, D]: [B, V] for one token per
    row, else [B, T, V] with the positions `real` [B, T] marks projected (the others are
    meaningless); on every core where the lane runs `alone` and the graph has that head."""
    assert graph.head is not None
    projection = graph.alone if alone and graph.alone is not None else graph.head
    if hidden.shape[1] == 1:
        head, head_input = projection
        logits: FloatArray = head.run([LOGITS], {head_input: hidden})[0][:, -1, :]
        return logits
    return _project(projection, hidden, real).dense(hidden.shape[1])


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
