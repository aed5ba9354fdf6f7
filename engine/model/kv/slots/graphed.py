"""The KV-slot step replayed as CUDA graphs: one captured graph per shape bucket, so that
a step costs one graph launch rather than the hundreds of kernel launches ONNX Runtime
makes one by one (on a GPU they, not the arithmetic, bound a step of up to a thousand
rows: docs/gpu.md).

A CUDA graph replays the kernels it captured on the same memory with the same shapes, so:

- the step's graph has no control flow and returns only the greedy choice
  (`passes.slots.rewrite_step(..., graphed=True)`); a search that needs the logits takes the
  ordinary step;
- shapes come in buckets: rows to the next power of two, the self-attention width and the
  source width to the next power of two from `MIN_WIDTH` (at most the slots' capacity),
  the new positions per row as they are. A bucket's inputs and outputs are device buffers
  allocated when it is first used and bound once; a call copies its inputs into them and
  its choices out of them;
- rows that only fill a bucket write into a scratch slot of their own, which no request
  owns, and see one position: they cost their share of the step and change nothing;
- the first call of a bucket runs uncaptured (ONNX Runtime allocates what the shapes need
  there, which a capture may not), later ones capture once and then replay.

With the CPU provider the same buckets run without capture (`capture` False): the tests'
check of padding and buckets, which a GPU then only replays.

A capture records one thread's kernels on the session's stream, and CUDA forbids other
threads' allocations meanwhile: the scheduler uses graphs with one lane only
(`engine.decoding.backends.open_pool`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from engine.model.kv.slots.rewrite import SlotShape
from engine.model.layouts import FloatArray, IntArray
from engine.model.names import (
    BAN_EOS,
    ENCODER_ATTENTION_MASK,
    INPUT_IDS,
    MASK_INPUT,
    NEXT_IDS,
    NEXT_SCORES,
    POSITIONS_INPUT,
    SLOT_ROWS,
    slot_names,
)

log = logging.getLogger(__name__)

MIN_WIDTH = 32
"""The narrowest self-attention and source width bucket: a first bucket that holds most
sentences, so that short ones do not each capture graphs of their own."""

GRAPH_ID = "gpu_graph_id"
"""ONNX Runtime's run option naming the CUDA graph a run captures or replays (-1: none;
0 is reserved)."""

_graph_ids = itertools.count(1)
"""Graph ids, never given twice in a process: a session keeps a captured graph for as long
as it lives, with the memory it captured, and the load's check (`check_slots`) captures
over a pool of its own before the scheduler's pool uses the same session; an id used again
would replay the check's graph over the check's freed buffers."""


def bind_slot_buffers(
    binding: ort.IOBinding,
    buffers: dict[str, ort.OrtValue],
    layers: int,
    declared: set[str],
    outputs: set[str],
) -> None:
    """Bind the KV slot `buffers` a session reads (`declared` inputs) and, to the same
    memory, those it updates (`outputs`): ONNX Runtime then writes them in place."""
    for side in ("decoder", "encoder"):
        pairs = zip(slot_names(layers, side), slot_names(layers, side, out=True), strict=True)
        for name, updated in pairs:
            if name in declared:
                binding.bind_ortvalue_input(name, buffers[name])
            if updated in outputs:
                binding.bind_ortvalue_output(updated, buffers[name])


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def row_bucket(rows: int) -> int:
    """The rows a step of `rows` rows runs with: the next power of two."""
    return _power_of_two(rows)


def width_bucket(width: int, capacity: int) -> int:
    """The width a mask of `width` columns is padded to: the next power of two from
    `MIN_WIDTH`, at most `capacity` (the slots' positions: no row reads past them)."""
    if width > capacity:
        raise ValueError(f"a mask of {width} columns is wider than the slots' {capacity}")
    return min(max(_power_of_two(width), MIN_WIDTH), capacity)


@dataclass(frozen=True)
class StepChoices:
    """The greedy choice [B, T] of a graphed step and its log-probability [B, T]."""

    ids: IntArray
    scores: FloatArray


@dataclass
class _Bucket:
    """One shape's bound buffers, its binding, the id of its graph and its runs so far."""

    graph: int
    binding: ort.IOBinding
    inputs: dict[str, ort.OrtValue]
    ids: ort.OrtValue
    scores: ort.OrtValue
    runs: int = 0


class GraphedSteps:
    """`session` (the graphed step over `buffers`, the pool's KV slots) run in shape
    buckets, captured as CUDA graphs where `capture`. `scratch`: the slot that bucket
    padding rows write into. `device`: ("cpu", 0) or ("cuda", N)."""

    def __init__(
        self,
        session: ort.InferenceSession,
        shape: SlotShape,
        buffers: dict[str, ort.OrtValue],
        scratch: int,
        device: tuple[str, int],
        capture: bool,
    ) -> None:
        self.session = session
        self.shape = shape
        self.buffers = buffers
        self.scratch = scratch
        self.device = device
        self.capture = capture
        self.declared = {i.name for i in session.get_inputs()}
        self.outputs = {o.name for o in session.get_outputs()}
        self._buckets: dict[tuple[int, int, int, int], _Bucket] = {}
        self._lock = threading.Lock()

    @property
    def graphs(self) -> int:
        """Buckets used so far (each a captured graph once it has run twice on a GPU)."""
        return len(self._buckets)

    def _value(self, shape: tuple[int, ...], dtype: type[np.generic]) -> ort.OrtValue:
        kind, index = self.device
        return ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, kind, index)

    def _bucket(self, key: tuple[int, int, int, int]) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is not None:
            return bucket
        rows, new, width, source = key
        shapes: dict[str, tuple[tuple[int, ...], type[np.generic]]] = {
            INPUT_IDS: ((rows, new), np.int64),
            POSITIONS_INPUT: ((rows, new), np.int64),
            MASK_INPUT: ((rows, width), np.int64),
            ENCODER_ATTENTION_MASK: ((rows, source), np.int64),
            SLOT_ROWS: ((rows,), np.int64),
            BAN_EOS: ((rows, new), np.bool_),
        }
        binding = self.session.io_binding()
        inputs = {}
        for name, (dims, dtype) in shapes.items():
            if name in self.declared:
                inputs[name] = self._value(dims, dtype)
                binding.bind_ortvalue_input(name, inputs[name])
        bind_slot_buffers(binding, self.buffers, self.shape.layers, self.declared, self.outputs)
        ids, scores = self._value((rows, new), np.int64), self._value((rows, new), np.float32)
        binding.bind_ortvalue_output(NEXT_IDS, ids)
        binding.bind_ortvalue_output(NEXT_SCORES, scores)
        bucket = self._buckets[key] = _Bucket(next(_graph_ids), binding, inputs, ids, scores)
        log.debug("graphed step: bucket %s is graph %d", key, bucket.graph)
        return bucket

    def step(
        self,
        input_ids: IntArray,
        positions: IntArray,
        mask: IntArray,
        encoder_mask: IntArray,
        rows: IntArray,
        ban_eos: npt.NDArray[np.bool_],
    ) -> StepChoices:
        """`KvSlots.step`'s greedy choice, from the bucket of these shapes."""
        batch, new = input_ids.shape
        key = (
            row_bucket(batch),
            new,
            width_bucket(mask.shape[1], self.shape.capacity),
            width_bucket(encoder_mask.shape[1], self.shape.source_capacity),
        )
        size, _, width, source = key
        padded: dict[str, npt.NDArray[Any]] = {
            INPUT_IDS: _pad(input_ids, (size, new), 0),
            POSITIONS_INPUT: _pad(positions, (size, new), 0),
            MASK_INPUT: _pad(mask, (size, width), 0),
            ENCODER_ATTENTION_MASK: _pad(encoder_mask, (size, source), 0),
            SLOT_ROWS: _pad(rows, (size,), self.scratch),
            BAN_EOS: _pad(ban_eos, (size, new), False, np.bool_),
        }
        # A padding row sees its one position (0) and one source position, in its scratch slot.
        padded[MASK_INPUT][batch:, 0] = 1
        padded[ENCODER_ATTENTION_MASK][batch:, 0] = 1
        with self._lock:
            bucket = self._bucket(key)
            for name, value in bucket.inputs.items():
                value.update_inplace(np.ascontiguousarray(padded[name]))
            options = None
            if self.capture:
                options = ort.RunOptions()
                # The first run of a bucket allocates what its shapes need; a capture may not.
                graph = bucket.graph if bucket.runs else -1
                options.add_run_config_entry(GRAPH_ID, str(graph))
            self.session.run_with_iobinding(bucket.binding, options)
            bucket.runs += 1
            ids = bucket.ids.numpy()[:batch].copy()
            scores = bucket.scores.numpy()[:batch].copy()
        return StepChoices(ids, scores)


def _pad(
    array: npt.NDArray[Any],
    shape: tuple[int, ...],
    fill: Any,
    dtype: type[np.generic] = np.int64,
) -> npt.NDArray[Any]:
    """`array` in the top-left corner of a new array of `shape` and `dtype` (that of the
    bucket's buffer, which takes the bytes as they are), the rest `fill`."""
    out = np.full(shape, fill, dtype=dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out
