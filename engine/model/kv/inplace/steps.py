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
from engine.model.fused import packed
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
from engine.model.passes.graph import load_model
from engine.model.sessions import RuntimeOptions, open_session

log = logging.getLogger(__name__)


class InPlaceBinding:
    """One caller's I/O bindings of an in-place step (`InPlaceSteps.step`), kept
    between its steps, one per session and row count (`BOUND_COUNTS` at most), each with
    what it binds: the arrays the state is bound from (the encoder outputs, the
    cross-attention keys and values and the self-attention buffers' views, compared by
    identity and held here, with the contiguous copies actually bound where one was not,
    so that the memory bound stays alive), and the inputs of one token a row (tokens,
    positions, lengths: `TokenInputs`), written in place at every step rather than bound
    again.

    Why: a step binds about 30 inputs and outputs, a few percent of a one-row step in
    Python and ONNX Runtime calls (docs/performance.md); between joins and leaves only the
    tokens and positions change, and those go into arrays bound once. Why one per row
    count: under load a lane's rows go 1 -> 2 -> 1 (and through 0) from turn to turn:
    kept for one count only, about half the steps bound anew (docs/performance.md). The
    caller's views of its buffers' first rows are the same objects for a count while the
    buffers are (`InPlaceKv._views`), so each count's binding is found again; `forget`
    drops them all when the buffers are replaced, so that none keeps old buffers alive."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int], KeptBinding] = {}
        self._current: KeptBinding | None = None

    def find(
        self, session: ort.InferenceSession, rows: int, state: tuple[object, ...]
    ) -> KeptBinding | None:
        """The kept binding of `session` for `rows` rows with these very arrays, now the
        current one; None where none is kept. (Compared by their ids: a kept binding holds
        its arrays, so no other live object has one of those ids.)"""
        kept = self._kept.get((id(session), rows))
        if kept is None or kept.ids != tuple(map(id, state)):
            return None
        self._current = kept
        return kept

    def keep(
        self,
        session: ort.InferenceSession,
        rows: int,
        state: tuple[object, ...],
        binding: ort.IOBinding,
        held: tuple[object, ...],
    ) -> KeptBinding:
        """Keep `binding`, of `session` for `rows` rows with the arrays of `state` (in
        place of the one of the same session and rows), now the current one; `held`: what
        it reads (copies where `state`'s were not contiguous), kept alive with it. Its
        inputs of one token a row are bound to it at the next step."""
        key = (id(session), rows)
        if key not in self._kept and len(self._kept) >= BOUND_COUNTS:
            self._kept.clear()  # a lane that ran every count: start again
        kept = KeptBinding(session, state, tuple(map(id, state)), binding, held)
        self._current = self._kept[key] = kept
        return kept

    def forget(self) -> None:
        """Drop every kept binding (the arrays they bind were replaced)."""
        self._kept.clear()
        self._current = None

    @property
    def binding(self) -> ort.IOBinding:
        """The last step's binding."""
        assert self._current is not None
        return self._current.binding


BOUND_COUNTS = 64
"""Bindings an `InPlaceBinding` keeps at most (per session and row count)."""


@dataclass(eq=False)
class KeptBinding:
    """One binding an `InPlaceBinding` keeps: of `session` with the arrays of `state`,
    holding `held` alive; its inputs of one token a row (`tokens`), and whether they are
    not bound to it (`unbound`: a new one, or a step of several tokens bound its own over
    them)."""

    session: ort.InferenceSession
    state: tuple[object, ...]
    ids: tuple[int, ...]  # the ids of `state`'s arrays
    binding: ort.IOBinding
    held: tuple[object, ...]
    tokens: TokenInputs | None = None
    unbound: bool = True


class TokenInputs:
    """The step inputs of one token a row for `rows` rows, in arrays bound once to a kept
    binding and written at each step: the tokens [rows, 1], their positions [rows, 1], each
    row's length so far (int32, `SEQLENS_INPUT`) and the longest after the step
    (`TOTAL_INPUT`); and, where its size is known, the step's output [rows, 1, size]: a cut
    step's body output, read by the projection in the same call, or a whole step's
    logits, copied out by the step that wrote them."""

    def __init__(self, rows: int, output: tuple[str, int, Any] | None) -> None:
        self.rows, self.output = rows, output
        self.ids = np.zeros((rows, 1), dtype=np.int64)
        self.positions = np.zeros((rows, 1), dtype=np.int64)
        self.seqlens = np.zeros(rows, dtype=np.int32)
        self.total = np.zeros((), dtype=np.int32)
        self.hidden: FloatArray | None = None
        self._value: ort.OrtValue | None = None
        if output is not None:
            _, size, dtype = output
            self.hidden = np.zeros((rows, 1, size), dtype=dtype)
            self._value = ort.OrtValue.ortvalue_from_numpy(self.hidden)

    def bind(self, binding: ort.IOBinding, declared: frozenset[str]) -> None:
        """Bind these arrays to `binding`, of a session that declares `declared`."""
        arrays = {
            INPUT_IDS: self.ids,
            POSITIONS_INPUT: self.positions,
            SEQLENS_INPUT: self.seqlens,
            TOTAL_INPUT: self.total,
        }
        for name, value in arrays.items():
            if name in declared:
                binding.bind_cpu_input(name, value)
        if self.output is not None and self._value is not None:
            binding.bind_ortvalue_output(self.output[0], self._value)

    def write(self, input_ids: IntArray, lengths: IntArray) -> None:
        """This step's tokens [rows, 1] and the rows' lengths so far [rows]."""
        self.ids[...] = input_ids
        self.positions[:, 0] = lengths
        self.seqlens[...] = lengths
        self.total[...] = int(lengths.max()) + 1


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
    _hidden: dict[int, tuple[str, int, Any] | None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        graphs = [g for g in (self.graph, self.one) if g is not None]
        declared = {
            id(g.session): frozenset(i.name for i in g.session.get_inputs()) for g in graphs
        }
        object.__setattr__(self, "_names", KvNames(self.layers))
        object.__setattr__(self, "_declared", declared)
        object.__setattr__(self, "_hidden", {id(g.session): _hidden_output(g) for g in graphs})

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
        `bound`: the caller's binding, kept from its last step: the state (buffers,
        cross-attention keys and values, encoder outputs: the same array objects as the
        last step's, or they are bound again) is bound when it changed (rows joined or
        left, the buffers grew), and one token a row is written into inputs bound once
        (`TokenInputs`). One per caller (a lane): a binding is not shared between
        threads."""
        rows, fed = input_ids.shape
        if fed > 1 and rows > 1:
            raise ValueError("several tokens per row take one row (GroupQueryAttention)")
        graph = self.one if self.one is not None and input_ids.size == 1 else self.graph
        session = graph.session
        declared = self._declared[id(session)]
        state = (enc.attention_mask, enc.hidden_states, *cross_kv, *buffers)
        result = graph.head[1] if graph.head is not None else LOGITS
        kept = bound.find(session, rows, state) if bound is not None else None
        if kept is None:
            binding, kept = self._bind(
                session, declared, result, enc, cross_kv, buffers, bound, state
            )
        else:
            binding = kept.binding
        tokens: TokenInputs | None = None
        output = self._hidden[id(session)]
        hidden: FloatArray | None = None  # the step's output, where bound to an array
        if kept is not None and fed == 1:
            tokens = kept.tokens
            if tokens is None or tokens.rows != rows or tokens.output != output:
                tokens = kept.tokens = TokenInputs(rows, output)
                kept.unbound = True
            if kept.unbound:
                tokens.bind(binding, declared)
                kept.unbound = False
            tokens.write(input_ids, lengths)
            hidden = tokens.hidden
            if hidden is None:
                binding.bind_output(result)  # allocated by this run, not the last step's
        else:
            if kept is not None:
                kept.unbound = True  # its inputs are bound over here: bound again after
            if output is not None:  # an array of this call's own (no output to fetch)
                hidden = np.empty((rows, fed, output[1]), dtype=output[2])
                value = ort.OrtValue.ortvalue_from_numpy(hidden)
                binding.bind_ortvalue_output(output[0], value)
            else:
                binding.bind_output(result)
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
        out = hidden if hidden is not None else binding.get_outputs()[0].numpy()
        if graph.head is None:
            logits: FloatArray = out[:, -1, :] if fed == 1 else out
            if tokens is not None and hidden is not None:  # the binding's: the next step's too
                return logits.copy()
            return logits
        return head_logits(graph, out, np.ones((rows, fed), dtype=bool), alone)

    def _bind(
        self,
        session: ort.InferenceSession,
        declared: frozenset[str],
        result: str,
        enc: EncoderOutput,
        cross_kv: tuple[FloatArray, ...],
        buffers: Sequence[FloatArray],
        bound: InPlaceBinding | None,
        state: tuple[object, ...],
    ) -> tuple[ort.IOBinding, KeptBinding | None]:
        """A new binding of the step's state, and where `bound` is given, what keeps it
        there: each buffer one value bound as its layer's past and its present, so that
        ONNX Runtime writes the new position in place."""
        binding = session.io_binding()
        if self._hidden[id(session)] is None:  # fetched after each run: its output 0
            binding.bind_output(result)
        values: dict[str, Any] = {
            ENCODER_ATTENTION_MASK: enc.attention_mask,
            ENCODER_HIDDEN_STATES: enc.hidden_states,
        }
        values.update(zip(self._names.cross_in, cross_kv, strict=True))
        held: list[object] = []
        for name, value in values.items():
            if name in declared:
                array = np.ascontiguousarray(value)
                binding.bind_cpu_input(name, array)
                held.append(array)
        pairs = zip(self._names.self_in, self._names.self_out, buffers, strict=True)
        for past, present, buffer in pairs:
            if not buffer.flags.c_contiguous:
                raise ValueError("a self-attention buffer view must be contiguous")
            value = ort.OrtValue.ortvalue_from_numpy(buffer)
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
            held.append(value)
        if bound is None:
            return binding, None
        return binding, bound.keep(session, len(enc.attention_mask), state, binding, tuple(held))


def _hidden_output(graph: CutGraph) -> tuple[str, int, Any] | None:
    """The step's output, its last axis's size and type, where the graph declares them
    (`TokenInputs` binds it to an array of its own): the body's of a step cut at its
    projection, the logits of a whole one; None for a size the graph leaves open.

    Why the logits too: ONNX Runtime allocating them at every run and the binding's
    output fetched and copied to NumPy cost a whole one-row step more than the cut step's
    two calls (docs/performance.md, issue 54's fifth pass)."""
    name = graph.head[1] if graph.head is not None else LOGITS
    for output in graph.session.get_outputs():
        if output.name == name and isinstance(output.shape[-1], int):
            kinds = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
            kind = kinds.get(output.type)
            return None if kind is None else (name, int(output.shape[-1]), kind)
    return None


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
    if options.packs and not options.quantized:  # int8 products are other ops
        rewritten = packed(load_model(rewritten), f"{model_dir} ({label})").SerializeToString()
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
