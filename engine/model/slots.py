"""The KV slot pool: preallocated buffers of every layer's keys and values, the sessions
that read and write them in place, and their ONNX Runtime I/O bindings.

Sized once, at load (`SlotShape` x `slots`), on the device the model runs on: a running
row owns a slot (the scheduling policy hands them out) and its state never moves. A step
(`step`) passes token ids, positions, masks and slot ids in and gets the argmax and its
log-probability back (the whole logits only when a search needs them); the prefill's
keys and values are written once (`write`); a beam's reordered rows copy their parents'
state between slots (`copy`). The same code serves the CPU and CUDA providers: on the
CPU the buffers are numpy arrays the bindings share, on a GPU device memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from onnx import TensorProto

from engine.model.checks import REWRITE_TOLERANCE
from engine.model.config import ModelConfig
from engine.model.layouts import EncoderOutput, FloatArray, IntArray, MaskedDecoder
from engine.model.names import (
    BAN_EOS,
    COPY_POSITIONS,
    COPY_TARGETS,
    ENCODER_ATTENTION_MASK,
    INPUT_IDS,
    LOGITS,
    MASK_INPUT,
    NEXT_IDS,
    NEXT_SCORES,
    POSITIONS_INPUT,
    SLOT_ROWS,
    kv_names,
    slot_names,
)
from engine.model.passes.slots import SlotShape, copy_graph, rewrite_step, writer_graph
from engine.model.sessions import RuntimeOptions, open_session

log = logging.getLogger(__name__)


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

    `step`: the slot-rewritten with-past graph (`passes.slots.rewrite_step`); `one_token`:
    the same for one-token calls where the model has a faster graph for them (int8 per
    token); `writer` and `copier`: `passes.slots.writer_graph` and `copy_graph`.
    `device`: ("cpu", 0) or ("cuda", N)."""

    def __init__(
        self,
        shape: SlotShape,
        slots: int,
        float_type: type[np.floating[Any]],
        step: ort.InferenceSession,
        writer: ort.InferenceSession,
        copier: ort.InferenceSession,
        one_token: ort.InferenceSession | None = None,
        device: tuple[str, int] = ("cpu", 0),
    ) -> None:
        if slots < 1:
            raise ValueError("the KV slot pool needs at least one slot")
        self.shape = shape
        self.slots = slots
        self.float_type = float_type
        self.device = device
        self.sessions = {"step": step, "writer": writer, "copier": copier}
        if one_token is not None:
            self.sessions["one_token"] = one_token
        self.bytes = slots * slot_bytes(shape, np.dtype(float_type).itemsize)
        self._arrays: list[npt.NDArray[Any]] = []  # the CPU buffers the values share
        self.buffers: dict[str, ort.OrtValue] = {}
        for side, capacity in (("decoder", shape.capacity), ("encoder", shape.source_capacity)):
            rows = slots * shape.heads * capacity
            for name in slot_names(shape.layers, side):
                self.buffers[name] = self._allocate((rows, shape.head_dim))
        self._local = threading.local()  # per lane thread: its bindings

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
            declared = {i.name for i in session.get_inputs()}
            outputs = {o.name for o in session.get_outputs()}
            layers = self.shape.layers
            for side in ("decoder", "encoder"):
                names = zip(
                    slot_names(layers, side), slot_names(layers, side, out=True), strict=True
                )
                for name, updated in names:
                    if name in declared:
                        binding.bind_ortvalue_input(name, self.buffers[name])
                    if updated in outputs:
                        binding.bind_ortvalue_output(updated, self.buffers[name])
        return binding

    def _run(
        self, role: str, inputs: dict[str, npt.NDArray[Any]], wanted: tuple[str, ...] = ()
    ) -> list[Any]:
        """Run one session with `inputs` from host memory; returns `wanted` on the host."""
        binding = self._binding(role, wanted)
        for name, value in inputs.items():
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
        inputs = {
            BAN_EOS: ban_eos,
            INPUT_IDS: input_ids,
            POSITIONS_INPUT: positions,
            MASK_INPUT: mask,
            ENCODER_ATTENTION_MASK: encoder_mask,
            SLOT_ROWS: rows,
        }
        role = "one_token" if "one_token" in self.sessions and input_ids.size == 1 else "step"
        wanted = (NEXT_IDS, NEXT_SCORES, *((LOGITS,) if logits else ()))
        out = self._run(role, inputs, wanted)
        return StepOutput(out[0], out[1], out[2] if logits else None)

    def write(
        self,
        rows: IntArray,
        self_kv: Sequence[FloatArray],
        cross_kv: Sequence[FloatArray],
    ) -> None:
        """A prefill's keys and values [B, H, T, Dh] and [B, H, S, Dh] into slots `rows`."""
        layers = self.shape.layers
        inputs: dict[str, npt.NDArray[Any]] = {SLOT_ROWS: rows}
        inputs.update(zip(kv_names(layers, "decoder"), self_kv, strict=True))
        inputs.update(zip(kv_names(layers, "encoder"), cross_kv, strict=True))
        self._run("writer", inputs)

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
    step: ort.InferenceSession
    writer: ort.InferenceSession
    copier: ort.InferenceSession
    one_token: ort.InferenceSession | None = None
    device: tuple[str, int] = ("cpu", 0)

    def slot_bytes(self) -> int:
        return slot_bytes(self.shape, np.dtype(self.float_type).itemsize)

    def pool(self, slots: int) -> KvSlots:
        """`slots` slots of this model's shape, allocated now."""
        return KvSlots(
            self.shape,
            slots,
            self.float_type,
            self.step,
            self.writer,
            self.copier,
            self.one_token,
            self.device,
        )


def check_slots(masked: MaskedDecoder, graphs: SlotGraphs, config: ModelConfig) -> float:
    """The largest logit difference between a cached step over slots and the same step
    of the masked decoder, for two rows of different source lengths in swapped slots, the
    slot step seeing a wider mask than its rows need (padding)."""
    pool = graphs.pool(3)
    rng = np.random.default_rng(0)
    rows, source, past = 2, 5, 4
    hidden = rng.standard_normal((rows, source, config.d_model)).astype(graphs.float_type)
    encoder_mask = np.ones((rows, source), dtype=np.int64)
    encoder_mask[1, 3:] = 0
    enc = EncoderOutput(hidden, encoder_mask)
    ids = rng.integers(1, config.vocab_size - 1, (rows, past)).astype(np.int64)
    ids[:, 0] = config.decoder_start_token_id
    _, self_kv, cross_kv = masked.prefill(enc, ids, np.ones((rows, past), dtype=np.int64))
    slots = np.array([2, 0], dtype=np.int64)
    pool.write(slots, self_kv, cross_kv)
    token = rng.integers(1, config.vocab_size - 1, (rows, 1)).astype(np.int64)
    at = np.full((rows, 1), past, dtype=np.int64)
    mask = np.ones((rows, past + 1), dtype=np.int64)
    expected, _ = masked.step(enc, token, at, mask, self_kv, cross_kv)
    wide = np.concatenate([mask, np.zeros((rows, 2), dtype=np.int64)], axis=1)
    out = pool.step(token, at, wide, encoder_mask, slots, logits=True)
    assert out.logits is not None
    same_choice = bool((out.ids[:, 0] == expected.argmax(axis=-1)).all())
    difference = float(np.abs(out.logits[:, 0].astype(np.float32) - expected).max())
    return difference if same_choice else float("inf")


def open_slot_graphs(
    step: bytes,
    one_token: bytes | None,
    masked: MaskedDecoder,
    config: ModelConfig,
    options: RuntimeOptions,
    *,
    per_token: bool,
    where: str,
) -> SlotGraphs | None:
    """The batchable step rewritten over KV slots (`passes.slots`) and checked against
    `masked`, or None (logged why): the model then copies its state per step.

    `step` and `one_token`: the masked with-past graphs as the model runs them (int8 per
    token where it does, and the files' own quantization for one-token calls)."""
    float16 = any(i.type == "tensor(float16)" for i in masked.prefills.session.get_inputs())
    float_type: type[np.floating[Any]] = np.float16 if float16 else np.float32
    positions = config.max_position_embeddings
    shape = SlotShape(
        config.decoder_layers, config.decoder_attention_heads, config.head_dim, positions, positions
    )
    facts = (config.vocab_size, config.bad_token_ids, config.eos_token_id)
    graph = rewrite_step(step, shape, *facts, f"{where} (step)")
    if graph is None:
        return None
    one = None if one_token is None else rewrite_step(one_token, shape, *facts, where)
    element = TensorProto.FLOAT16 if float16 else TensorProto.FLOAT
    try:
        graphs = SlotGraphs(
            shape,
            float_type,
            open_session(graph, options, per_token=per_token),
            open_session(writer_graph(shape, element), options),
            open_session(copy_graph(shape, element), options),
            None if one is None else open_session(one, options),
            device_of(options),
        )
        worst = check_slots(masked, graphs, config)
    except Exception as exc:  # a graph the rewrite did not foresee: copy the state instead
        log.warning("%s: KV slots not used (%s): the state is copied per step", where, exc)
        return None
    if not worst <= REWRITE_TOLERANCE:
        log.warning(
            "%s: the step over KV slots differs by %.3g (tolerance %g): not used",
            where,
            worst,
            REWRITE_TOLERANCE,
        )
        return None
    return graphs


def device_of(options: RuntimeOptions) -> tuple[str, int]:
    """Where the model's buffers live: ("cuda", N) with the CUDA provider first, else the
    host."""
    if options.providers and options.providers[0] == "CUDAExecutionProvider":
        return ("cuda", options.device_id)
    return ("cpu", 0)
