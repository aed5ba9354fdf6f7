"""The KV backend that keeps a continuous batch's self-attention keys and values in lane
buffers that each step reads and extends in place: its sessions (`InPlaceSteps`, the
step rewritten by `engine.model.kv.inplace.rewrite`, checked against the masked decoder's
step at load), its I/O binding kept between steps (`InPlaceBinding`), and how the load
opens them (`open_inplace`). The rows' bookkeeping is `engine.model.kv.inplace.rows`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engine.model.checks import KERNEL_INT8_TOLERANCE, REWRITE_TOLERANCE, check_rewrite
from engine.model.config import ModelConfig
from engine.model.cut import cut_graph
from engine.model.kv.inplace.rewrite import rewrite_inplace
from engine.model.layouts import EncoderOutput, FloatArray, IntArray, KvNames
from engine.model.logits import CutGraph, head_logits
from engine.model.masked import MaskedDecoder, MaskedSources
from engine.model.names import (
    ENCODER_ATTENTION_MASK,
    ENCODER_HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    POSITIONS_INPUT,
    SEQLENS_INPUT,
    TOTAL_INPUT,
)
from engine.model.sessions import RuntimeOptions, open_session

log = logging.getLogger(__name__)


class InPlaceBinding:
    """One caller's I/O binding of an in-place step (`InPlaceSteps.step`), kept
    between its steps with what it binds: the session, the arrays bound by reference (the
    encoder outputs and cross-attention keys and values, compared by identity, then the
    contiguous arrays actually bound, all held here so that the memory bound stays
    alive) and each buffer view's address and shape.

    Why: a step binds about 30 inputs and outputs, a few percent of a one-row step in
    Python and ONNX Runtime calls (docs/performance.md); between joins and leaves only the
    tokens and positions change."""

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


@dataclass(frozen=True, eq=False)
class InPlaceSteps:
    """The in-place step (`graph`) and its one-row, one-token form (`one`, where the model
    has a faster graph for one token), each whole or cut at its projection as the masked
    decoder's twin is, sharing that twin's projection. Frozen once opened."""

    graph: CutGraph
    one: CutGraph | None
    layers: int
    calls: Counter[str] = field(compare=False)  # the model's call counter, shared
    _names: KvNames = field(init=False, repr=False)
    _declared: dict[int, frozenset[str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        declared = {
            id(g.session): frozenset(i.name for i in g.session.get_inputs())
            for g in (self.graph, self.one)
            if g is not None
        }
        object.__setattr__(self, "_names", KvNames(self.layers))
        object.__setattr__(self, "_declared", declared)

    def step(
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
        """One token per row over self-attention buffers: `buffers` are each
        layer's key and value, `[rows, heads, capacity, head_dim]` in `kv_names` order,
        row r's first `lengths[r]` positions real; the step writes position `lengths[r]`
        of every buffer in place (the caller then counts it) and returns logits [B, V].
        One row may take several tokens (`input_ids` [1, T], lookahead): logits
        [1, T, V], positions `lengths[0]` to `lengths[0] + T - 1` written.

        Why: the masked decoder's `step` copies every row's keys and values into new
        arrays at every step (`Concat`); here they never move (docs/performance.md).
        `bound`: the caller's binding, kept from its last step: the buffers, the
        cross-attention state and the encoder outputs are bound again only when they
        changed (rows joined or left, the buffers grew), the tokens and positions at
        every step. One per caller (a lane): a binding is not shared between threads."""
        rows, fed = input_ids.shape
        if fed > 1 and rows > 1:
            raise ValueError("several tokens per row take one row (GroupQueryAttention)")
        graph = self.one if self.one is not None and input_ids.size == 1 else self.graph
        session = graph.session
        declared = self._declared[id(session)]
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
        return head_logits(graph, out, np.ones((rows, fed), dtype=bool), alone)


def open_inplace(
    masked: MaskedDecoder,
    sources: MaskedSources,
    config: ModelConfig,
    options: RuntimeOptions,
    model_dir: Path,
) -> InPlaceSteps | None:
    """The in-place steps (the batched step and, for the one-token graph, its own) where
    the step's self-attention can be rewritten in place (`passes.inplace`) and the
    rewrite gives the masked decoder's logits on a probe; None otherwise, logged."""
    per_token = sources.per_token
    # The projection is not rewritten: each graph shares its ordinary twin's head. The
    # batched step is per token where int8 is; the one-token graph has the files' kernels.
    step = _inplace_twin(
        "step",
        sources.with_past,
        sources.step_session,
        masked.steps,
        rows=2,
        per_token=per_token,
        masked=masked,
        config=config,
        options=options,
        model_dir=model_dir,
    )
    if step is None:
        return None
    one_token, one = sources.one_token, sources.one_token_session
    alone_step = None
    if one_token is not None and one is not None and masked.one_token is not None:
        alone_step = _inplace_twin(
            "one-token step",
            one_token,
            one,
            masked.one_token,
            rows=1,
            per_token=False,
            masked=masked,
            config=config,
            options=options,
            model_dir=model_dir,
        )
    log.info("%s: steps with self-attention in place (passes.inplace)", model_dir)
    return InPlaceSteps(step, alone_step, config.decoder_layers, masked.calls)


def _inplace_twin(
    label: str,
    source: bytes,
    session: ort.InferenceSession,
    twin: CutGraph,
    *,
    rows: int,
    per_token: bool,
    masked: MaskedDecoder,
    config: ModelConfig,
    options: RuntimeOptions,
    model_dir: Path,
) -> CutGraph | None:
    """One graph's in-place rewrite, opened, checked against its ordinary `session` on a
    probe of `rows` rows and cut at its projection as its `twin` is; None, logged, where
    the rewrite does not apply, ONNX Runtime refuses it or it differs."""
    rewritten = rewrite_inplace(source, f"{model_dir} ({label})")
    if rewritten is None:
        return None
    quantized = options.quantized
    try:
        opened = open_session(rewritten, options, per_token=per_token)
        worst = check_rewrite(
            session, opened, past_len=4, cur_len=1, batch=rows, relative=quantized
        )
    except Exception as exc:  # a kernel or graph ONNX Runtime refuses: keep the ordinary
        log.warning("%s: %s with self-attention in place not used (%s)", model_dir, label, exc)
        return None
    if not worst <= (KERNEL_INT8_TOLERANCE if quantized else REWRITE_TOLERANCE):
        log.warning(
            "%s: %s with self-attention in place differs by %.3g: not used",
            model_dir,
            label,
            worst,
        )
        return None
    if ENCODER_HIDDEN_STATES in {i.name for i in opened.get_inputs()}:
        # The in-place batch keeps only the encoder mask and cross-attention keys and
        # values of its rows (`engine.model.kv.inplace.rows`); a step that reads the
        # hidden states too keeps the copied state.
        log.warning(
            "%s: %s with self-attention in place reads the encoder's hidden states: not used",
            model_dir,
            label,
        )
        return None
    return cut_graph(
        model_dir,
        rewritten,
        opened,
        config,
        options,
        per_token=per_token,
        alone=masked.steps.alone,
        rows=rows,
        label=f"in-place {label}",
        head=twin.head,
    )
