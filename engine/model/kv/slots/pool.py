"""The KV slot pool: preallocated buffers of every layer's keys and values, the sessions
that read and write them in place, and their ONNX Runtime I/O bindings.

Sized once, when the scheduler starts (`SlotShape` x `slots`), on the device the model
runs on: a running row owns a slot (the scheduling policy hands them out) and its state
never moves. The prefill (`prefill`) writes a newcomer's positions and its source's
cross-attention keys and values into its slots; a step (`step`) passes token ids,
positions, masks and slot ids in and gets the argmax and its log-probability back (the
whole logits only when a search needs them); a beam's reordered rows copy their parents'
state between slots (`copy`). The same code serves the CPU and CUDA providers: on the
CPU the buffers are numpy arrays the bindings share, on a GPU device memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from onnx import TensorProto
from onnxruntime.capi.onnxruntime_pybind11_state import Fail as OrtFail
from onnxruntime.capi.onnxruntime_pybind11_state import (
    RuntimeException as OrtRuntimeException,
)

from engine.errors import ModelLoadError
from engine.model.checks import REWRITE_TOLERANCE
from engine.model.config import ModelConfig
from engine.model.kv.slots.graphed import GraphedSteps, bind_slot_buffers
from engine.model.kv.slots.rewrite import (
    SlotShape,
    copy_graph,
    rewrite_prefill,
    rewrite_step,
)
from engine.model.layouts import EncoderOutput, FloatArray, IntArray
from engine.model.masked import MaskedDecoder
from engine.model.memory import available_memory, size_text
from engine.model.names import (
    BAN_EOS,
    COPY_POSITIONS,
    COPY_TARGETS,
    ENCODER_ATTENTION_MASK,
    ENCODER_HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    MASK_INPUT,
    NEXT_IDS,
    NEXT_SCORES,
    POSITIONS_INPUT,
    PREFILL_READS,
    SLOT_ROWS,
    SLOT_SOURCES,
    slot_names,
)
from engine.model.sessions import RuntimeOptions, device_of, open_session

log = logging.getLogger(__name__)

FP16_TOLERANCE = 0.05
"""Largest logit difference accepted between fp16 graphs over KV slots and the masked
decoder's; the greedy choices must agree besides (`check_slots`)."""


class SlotsExhausted(RuntimeError):
    """More rows than the KV slot pool holds were asked for at once."""


@dataclass(frozen=True)
class StepOutput:
    """What a slot step returns: the argmax [B, T] and its log-probability [B, T] under
    the model's banned tokens, and the logits [B, T, V] when they were asked for. (On the
    CPU too the choice is the graph's: it costs less there than returning the logits
    and choosing in numpy.)"""

    ids: IntArray
    scores: FloatArray
    logits: FloatArray | None


def slot_bytes(shape: SlotShape, itemsize: int) -> int:
    """Bytes one slot takes: self and cross keys and values of every layer."""
    per_position = shape.layers * 2 * shape.heads * shape.head_dim * itemsize
    return per_position * (shape.capacity + shape.source_capacity)


class KvSlots:
    """`slots` KV slots of `shape` and the graphs that use them in place.

    `prefill`: the slot-rewritten no-past graph (`passes.slots.rewrite_prefill`); `step`:
    the slot-rewritten with-past graph (`passes.slots.rewrite_step`); `one_token`:
    the same for one-token calls where the model has a faster graph for them (int8 per
    token); `copier`: `passes.slots.copy_graph`; `graphed`: the step as CUDA graphs
    replay it (`passes.slots.rewrite_step(..., graphed=True)`), which greedy steps then take
    (`engine.model.kv.slots.graphed`), captured where `capture`: the pool then has one slot more,
    the scratch slot that rows padding a bucket write into.
    `device`: ("cpu", 0) or ("cuda", N)."""

    def __init__(
        self,
        shape: SlotShape,
        slots: int,
        float_type: type[np.floating[Any]],
        prefill: ort.InferenceSession,
        step: ort.InferenceSession,
        copier: ort.InferenceSession,
        one_token: ort.InferenceSession | None = None,
        device: tuple[str, int] = ("cpu", 0),
        graphed: ort.InferenceSession | None = None,
        capture: bool = False,
    ) -> None:
        if slots < 1:
            raise ValueError("the KV slot pool needs at least one slot")
        self.shape = shape
        self.slots = slots
        self.float_type = float_type
        self.device = device
        self.sessions = {"prefill": prefill, "step": step, "copier": copier}
        if one_token is not None:
            self.sessions["one_token"] = one_token
        allocated = slots + (graphed is not None)  # the scratch slot last
        self.bytes = allocated * slot_bytes(shape, np.dtype(float_type).itemsize)
        self._arrays: list[npt.NDArray[Any]] = []  # the CPU buffers the values share
        self.buffers: dict[str, ort.OrtValue] = {}
        for side, capacity in (("decoder", shape.capacity), ("encoder", shape.source_capacity)):
            rows = allocated * shape.heads * capacity
            for name in slot_names(shape.layers, side):
                self.buffers[name] = self._allocate((rows, shape.head_dim))
        self._local = threading.local()  # per lane thread: its bindings
        self._declared = {
            role: {i.name for i in session.get_inputs()} for role, session in self.sessions.items()
        }
        self.graphed = (
            None
            if graphed is None
            else GraphedSteps(graphed, shape, self.buffers, slots, device, capture)
        )

    def _allocate(self, dims: tuple[int, int]) -> ort.OrtValue:
        kind, index = self.device
        if kind == "cpu":
            array = np.zeros(dims, dtype=self.float_type)  # pages come as they are written
            self._arrays.append(array)
            return ort.OrtValue.ortvalue_from_numpy(array)
        # Device memory as zeros, not uninitialised: a masked position weighs 0, and 0 x NaN
        # would not be 0. (The host's zero pages are only read for the copy.)
        return ort.OrtValue.ortvalue_from_numpy(np.zeros(dims, self.float_type), kind, index)

    def _binding(self, role: str, wanted: tuple[str, ...]) -> ort.IOBinding:
        """This thread's binding of one session for these outputs: its buffers bound
        once, in and out (in place), then `wanted`, bound to host memory at every call."""
        bindings: dict[tuple[str, tuple[str, ...]], ort.IOBinding] | None = getattr(
            self._local, "bindings", None
        )
        if bindings is None:
            bindings = self._local.bindings = {}
        binding = bindings.get((role, wanted))
        if binding is None:
            session = self.sessions[role]
            binding = bindings[(role, wanted)] = session.io_binding()
            outputs = {o.name for o in session.get_outputs()}
            bind_slot_buffers(
                binding, self.buffers, self.shape.layers, self._declared[role], outputs
            )
        return binding

    def _run(
        self, role: str, inputs: dict[str, npt.NDArray[Any]], wanted: tuple[str, ...] = ()
    ) -> list[Any]:
        """Run one session with those of `inputs` it declares (a rewrite drops the inputs
        its graph no longer reads), from host memory; returns `wanted` on the host."""
        binding = self._binding(role, wanted)
        declared = self._declared[role]
        for name, value in inputs.items():
            if name in declared:
                binding.bind_cpu_input(name, value)
        for name in wanted:
            binding.bind_output(name, "cpu")
        self.sessions[role].run_with_iobinding(binding)
        if not wanted:
            return []
        # Outputs come in binding order: the buffers (bound first), then `wanted`.
        return [value.numpy() for value in binding.get_outputs()[-len(wanted) :]]

    def step(
        self,
        input_ids: IntArray,
        positions: IntArray,
        mask: IntArray,
        encoder_mask: IntArray,
        rows: IntArray,
        ban_eos: npt.NDArray[np.bool_] | None = None,
        *,
        logits: bool = False,
    ) -> StepOutput:
        """One cached step of the rows in slots `rows` [B]: `input_ids` [B, T] at
        `positions` [B, T] (written there), seeing the slot positions `mask` [B, W]
        marks; cross-attention over the first `encoder_mask` [B, S] positions; eos not
        chosen where `ban_eos` [B, T] says."""
        if ban_eos is None:
            ban_eos = np.zeros(input_ids.shape, dtype=np.bool_)
        inputs: dict[str, npt.NDArray[Any]] = {
            BAN_EOS: ban_eos,
            INPUT_IDS: input_ids,
            POSITIONS_INPUT: positions,
            MASK_INPUT: mask,
            ENCODER_ATTENTION_MASK: encoder_mask,
            SLOT_ROWS: rows,
        }
        role = "one_token" if "one_token" in self.sessions and input_ids.size == 1 else "step"
        if self.graphed is not None and not logits and role == "step":
            try:
                chosen = self.graphed.step(input_ids, positions, mask, encoder_mask, rows, ban_eos)
            except Exception as exc:  # a shape whose capture failed: step as before from now
                log.warning("CUDA graphs off: a step of shape %s failed (%s)", mask.shape, exc)
                self.graphed = None
            else:
                return StepOutput(chosen.ids, chosen.scores, None)
        return self._choices(role, inputs, logits)

    def _choices(self, role: str, inputs: dict[str, npt.NDArray[Any]], logits: bool) -> StepOutput:
        """A prefill's or step's greedy choices, and its logits where asked for."""
        wanted = (NEXT_IDS, NEXT_SCORES, *((LOGITS,) if logits else ()))
        out = self._run(role, inputs, wanted)
        return StepOutput(out[0], out[1], out[2] if logits else None)

    def prefill(
        self,
        enc: EncoderOutput,
        input_ids: IntArray,
        mask: IntArray,
        slots: IntArray,
        sources: IntArray,
        reads: IntArray,
        ban_eos: npt.NDArray[np.bool_],
        *,
        logits: bool = False,
    ) -> StepOutput:
        """Start token, forced prefix and draft of new rows, right-padded (`mask`), in one
        call: each row's keys and values go into the slots `slots` [R] whose `sources`
        [R] name it; the flat positions `reads` [K] (row x width + position) are projected
        and chosen from (eos not where `ban_eos` [K] says). Returns [1, K] choices."""
        batch, length = input_ids.shape
        inputs: dict[str, npt.NDArray[Any]] = {
            ENCODER_ATTENTION_MASK: enc.attention_mask,
            INPUT_IDS: input_ids,
            ENCODER_HIDDEN_STATES: enc.hidden_states,
            MASK_INPUT: mask,
            POSITIONS_INPUT: np.tile(np.arange(length, dtype=np.int64), (batch, 1)),
            SLOT_ROWS: slots,
            SLOT_SOURCES: sources,
            PREFILL_READS: reads,
            BAN_EOS: ban_eos.reshape(1, -1),
        }
        return self._choices("prefill", inputs, logits)

    def copy(self, sources: Sequence[int], targets: Sequence[int], positions: int) -> None:
        """Slot `targets[k]`'s first `positions` self-attention positions become those of
        slot `sources[k]` (all read before any is written)."""
        inputs = {
            SLOT_ROWS: np.asarray(sources, dtype=np.int64),
            COPY_TARGETS: np.asarray(targets, dtype=np.int64),
            COPY_POSITIONS: np.arange(positions, dtype=np.int64),
        }
        self._run("copier", inputs)


@dataclass(frozen=True)
class SlotGraphs:
    """A model's sessions over KV slots, opened at load; `pool` gives them buffers."""

    shape: SlotShape
    float_type: type[np.floating[Any]]
    prefill: ort.InferenceSession
    step: ort.InferenceSession
    copier: ort.InferenceSession
    one_token: ort.InferenceSession | None = None
    device: tuple[str, int] = ("cpu", 0)
    # The step for CUDA graphs (`rewrite_step(..., graphed=True)`), captured where `capture`.
    graphed: ort.InferenceSession | None = None
    capture: bool = False

    def slot_bytes(self) -> int:
        return slot_bytes(self.shape, np.dtype(self.float_type).itemsize)

    def pool(self, slots: int, *, graphs: bool = True) -> KvSlots:
        """`slots` slots of this model's shape, allocated now; its greedy steps replay
        CUDA graphs where the model has them and `graphs` (one lane: see
        `engine.model.kv.slots.graphed`). Raises `ModelLoadError` (saying how many fit) for a pool
        larger than the host memory available, and when the allocation fails."""
        each = self.slot_bytes()
        allocated = slots + (graphs and self.graphed is not None)
        where = "cpu" if self.device[0] == "cpu" else f"{self.device[0]}:{self.device[1]}"
        room = available_memory()
        # On a GPU the host holds each buffer's zeros once, on the way to the device.
        host = allocated * each if self.device[0] == "cpu" else each * 2
        if room is not None and host > room:
            raise ModelLoadError(
                f"{slots} KV slots need {size_text(allocated * each)} ({size_text(each)} "
                f"each) and {size_text(room)} of memory is available, which "
                f"{max(0, room // each - (allocated - slots))} would fill (--kv-slots)"
            )
        try:
            return self._allocate(slots, graphs)
        except (MemoryError, RuntimeError, OrtFail, OrtRuntimeException) as exc:
            raise ModelLoadError(
                f"{slots} KV slots ({size_text(allocated * each)}, {size_text(each)} each) "
                f"could not be allocated on {where}: {str(exc).strip().splitlines()[0]} "
                "(--kv-slots)"
            ) from exc

    def _allocate(self, slots: int, graphs: bool) -> KvSlots:
        return KvSlots(
            self.shape,
            slots,
            self.float_type,
            self.prefill,
            self.step,
            self.copier,
            self.one_token,
            self.device,
            self.graphed if graphs else None,
            self.capture,
        )


def check_slots(masked: MaskedDecoder, graphs: SlotGraphs, config: ModelConfig) -> float:
    """The largest logit difference between the slot graphs and the masked decoder they
    came from, on a prefill and a cached step of two rows of different lengths and source
    lengths, in swapped slots, the step seeing a wider mask than its rows need; inf when
    a greedy choice differs from the logits' argmax. Where the model has a graphed step,
    that step is run three times too (on a GPU: uncaptured, then once more, then
    captured and replayed) and its choices must be the ordinary step's."""
    pool = graphs.pool(3)
    rng = np.random.default_rng(0)
    rows, source, past = 2, 5, 4
    hidden = rng.standard_normal((rows, source, config.d_model)).astype(graphs.float_type)
    encoder_mask = np.ones((rows, source), dtype=np.int64)
    encoder_mask[1, 3:] = 0
    enc = EncoderOutput(hidden, encoder_mask)
    ids = rng.integers(1, config.vocab_size - 1, (rows, past)).astype(np.int64)
    ids[:, 0] = config.decoder_start_token_id
    fed = np.ones((rows, past), dtype=np.int64)
    fed[1, past - 1] = 0  # the second row one token shorter: right-padded
    before, self_kv, cross_kv = masked.prefill(enc, ids, fed)
    slots = np.array([2, 0], dtype=np.int64)
    reads = np.array([1, past - 1, past + 1, 2 * past - 2], dtype=np.int64)  # (row, position)
    ban = np.zeros(len(reads), dtype=np.bool_)
    first = pool.prefill(enc, ids, fed, slots, np.arange(rows), reads, ban, logits=True)
    expected_first = before.dense(past).reshape(rows * past, -1)[reads]
    token = rng.integers(1, config.vocab_size - 1, (rows, 1)).astype(np.int64)
    at = np.array([[past], [past - 1]], dtype=np.int64)
    mask = np.ones((rows, past + 1), dtype=np.int64)
    mask[1, past - 1 :] = [1, 0]  # the second row's new token at its own position
    step_mask = np.ones((rows, past + 1), dtype=np.int64)
    step_mask[1, past - 1] = 0  # the masked decoder's cache keeps the padding slot
    expected, _ = masked.step(enc, token, at, step_mask, self_kv, cross_kv)
    wide = np.concatenate([mask, np.zeros((rows, 2), dtype=np.int64)], axis=1)
    out = pool.step(token, at, wide, encoder_mask, slots, logits=True)
    assert out.logits is not None and first.logits is not None
    worst = 0.0
    if pool.graphed is not None:
        # The step writes the same keys and values at the same positions again: the state
        # it reads is the same.
        unbanned = np.zeros(at.shape, dtype=np.bool_)
        for _ in range(3):
            replayed = pool.graphed.step(token, at, wide, encoder_mask, slots, unbanned)
            if not np.array_equal(replayed.ids, out.ids):
                return float("inf")
            worst = max(worst, float(np.abs(replayed.scores - out.scores).max()))
    for got, want, chosen in (
        (first.logits[0], expected_first, first.ids[0]),
        (out.logits[:, 0], expected, out.ids[:, 0]),
    ):
        allowed = np.ones(want.shape[-1], dtype=bool)
        allowed[list(config.bad_token_ids)] = False
        difference = np.abs(got.astype(np.float32) - want)[:, allowed]
        if not (chosen == np.where(allowed, want, -np.inf).argmax(axis=-1)).all():
            return float("inf")
        worst = max(worst, float(difference.max()))
    return worst


def open_slot_graphs(
    graphs: tuple[bytes, bytes, bytes | None],
    masked: MaskedDecoder,
    config: ModelConfig,
    options: RuntimeOptions,
    per_token: bool,
    where: str,
) -> SlotGraphs | None:
    """The batchable prefill and step rewritten over KV slots (`passes.slots`) and checked
    against `masked`, or None (logged why): the model then copies its state per step.

    `graphs`: the masked no-past, with-past and one-token graphs as the model runs them
    (int8 per token where it does, and the files' own quantization for one-token calls;
    None: no graph of its own for one token)."""
    prefill, step, one_token = graphs
    float16 = any(i.type == "tensor(float16)" for i in masked.prefills.session.get_inputs())
    float_type: type[np.floating[Any]] = np.float16 if float16 else np.float32
    positions = config.max_position_embeddings
    shape = SlotShape(
        config.decoder_layers, config.decoder_attention_heads, config.head_dim, positions, positions
    )
    facts = (config.vocab_size, config.bad_token_ids, config.eos_token_id)
    graph = rewrite_step(step, shape, *facts, f"{where} (step)")
    first = rewrite_prefill(prefill, shape, *facts, f"{where} (prefill)")
    if graph is None or first is None:
        return None
    one = None if one_token is None else rewrite_step(one_token, shape, *facts, where)
    element = TensorProto.FLOAT16 if float16 else TensorProto.FLOAT
    try:
        opened = SlotGraphs(
            shape,
            float_type,
            open_session(first, options, per_token=per_token),
            open_session(graph, options, per_token=per_token),
            open_session(copy_graph(shape, element), options),
            None if one is None else open_session(one, options),
            device_of(options),
        )
        worst = check_slots(masked, opened, config)
    except Exception as exc:  # a graph the rewrite did not foresee: copy the state instead
        log.warning("%s: KV slots not used (%s): the state is copied per step", where, exc)
        return None
    # fp16 rounds at about 1e-3 of a value, and attending over a slot's positions sums
    # them in another order than over a batch's cache: logits move in their third digit.
    tolerance = REWRITE_TOLERANCE if not float16 else FP16_TOLERANCE
    if not worst <= tolerance:
        log.warning(
            "%s: the step over KV slots differs by %.3g (tolerance %g): not used",
            where,
            worst,
            tolerance,
        )
        return None
    if not cuda_graphs(options):
        return opened
    return _with_graphed_step(opened, step, masked, config, options, per_token, where, tolerance)


def cuda_graphs(options: RuntimeOptions) -> bool:
    """Whether the model's greedy slot steps replay CUDA graphs (`RuntimeOptions
    .cuda_graphs`; by default on a CUDA device)."""
    if options.cuda_graphs is not None:
        return options.cuda_graphs
    return device_of(options)[0] == "cuda"


def _with_graphed_step(
    opened: SlotGraphs,
    step: bytes,
    masked: MaskedDecoder,
    config: ModelConfig,
    options: RuntimeOptions,
    per_token: bool,
    where: str,
    tolerance: float,
) -> SlotGraphs:
    """`opened` with the step for CUDA graphs, checked against its ordinary step (with a
    capture on a GPU), or as it is (logged why) when it cannot be had."""
    facts = (config.vocab_size, config.bad_token_ids, config.eos_token_id)
    graph = rewrite_step(step, opened.shape, *facts, f"{where} (graphed step)", graphed=True)
    if graph is None:
        return opened
    capture = opened.device[0] == "cuda"
    try:
        session = open_session(graph, options, per_token=per_token, graph_capture=capture)
        graphed = replace(opened, graphed=session, capture=capture)
        worst = check_slots(masked, graphed, config)
    except Exception as exc:  # e.g. a node ONNX Runtime cannot capture
        log.warning("%s: no CUDA graphs for the step (%s)", where, exc)
        return opened
    if not worst <= tolerance:
        log.warning("%s: the graphed step differs by %.3g: not used", where, worst)
        return opened
    log.info("%s: greedy steps replay CUDA graphs (capture %s)", where, capture)
    return graphed
