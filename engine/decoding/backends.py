"""The batch a lane runs over its model's KV backend, and the KV slot pool where that
backend is slots. The backend itself was chosen once, at load
(`engine.model.backend.select_backend`, carried as `MarianOnnx.backend`): this module
only builds what that choice names, and refuses scheduler options that contradict it.
"""

from __future__ import annotations

import logging

from engine.decoding.batch import DecodeBatch
from engine.decoding.continuous import ContinuousBatch
from engine.decoding.options import SchedulerOptions
from engine.model.backend import Backend
from engine.model.kv.base import KvBackend
from engine.model.kv.copied import CopiedKv
from engine.model.kv.inplace.rows import INITIAL_ROWS, InPlaceKv
from engine.model.kv.inplace.steps import InPlaceSteps
from engine.model.kv.lockstep import LockstepKv
from engine.model.kv.slots.pool import KvSlots, SlotGraphs
from engine.model.kv.slots.rows import SlotKv
from engine.model.marian import MarianOnnx

log = logging.getLogger(__name__)


def replays_cuda_graphs(model: MarianOnnx) -> bool:
    """Whether the model's greedy steps over KV slots replay CUDA graphs (its scheduler
    then runs one lane: a capture forbids other threads' device work)."""
    return isinstance(model.kv, SlotGraphs) and model.kv.graphed is not None


def open_pool(model: MarianOnnx, options: SchedulerOptions, lanes: int) -> KvSlots | None:
    """The model's KV slot pool, allocated now, so that its memory is known at start:
    `options.kv_slots` slots, by default one per row the lanes may hold; None where the
    model's backend is not slots. Raises `ValueError` for `kv_slots=0` over a model
    loaded with slots (load it with `RuntimeOptions(kv_slots=False)`: the choice is the
    load's)."""
    graphs = model.kv
    if model.backend.backend is not Backend.SLOTS or not isinstance(graphs, SlotGraphs):
        return None
    wanted = options.kv_slots
    if wanted == 0:
        raise ValueError(
            "kv_slots=0, but the model was loaded with KV slots: load it with "
            "RuntimeOptions(kv_slots=False)"
        )
    count = wanted if wanted is not None else lanes * options.max_rows
    # A CUDA graph's capture forbids other threads' device allocations meanwhile: the
    # steps replay graphs where one lane runs the model.
    pool = graphs.pool(count, graphs=lanes == 1)
    log.info(
        "KV slots: %d x %.1f MiB = %.1f MiB (%d positions, %d source positions each)%s",
        count,
        graphs.slot_bytes() / 2**20,
        pool.bytes / 2**20,
        pool.shape.capacity,
        pool.shape.source_capacity,
        "; greedy steps replay CUDA graphs" if pool.graphed is not None else "",
    )
    return pool


def runs_lockstep(model: MarianOnnx) -> bool:
    """Whether the model's rows advance together (the lockstep backend, or no batchable
    decoder): the one answer that both the scheduling policy (which plans joins) and
    `new_batch` (which builds the batch that refuses a join while rows run) read."""
    return model.backend.backend is Backend.LOCKSTEP or model.masked is None


def new_batch(model: MarianOnnx, options: SchedulerOptions, pool: KvSlots | None) -> DecodeBatch:
    """An empty batch over the model's KV backend (`pool`: its slots, from `open_pool`):
    the one batch over the backend's rows' state (the stock graphs' too: lockstep is a
    backend whose rows advance together, `KvBackend.ragged`).
    Raises `ValueError` for `inplace_attention=False` over a model loaded with the state
    in place (the choice is the load's: `RuntimeOptions(inplace_attention=False)`)."""
    backend, masked = model.backend.backend, model.masked
    kv: KvBackend
    if runs_lockstep(model) or masked is None:
        kv = LockstepKv(model)
    elif backend is Backend.SLOTS:
        assert pool is not None, "a slots backend runs over its pool (open_pool)"
        kv = SlotKv(model, pool)
    elif backend is Backend.INPLACE:
        if options.inplace_attention is False:
            raise ValueError(
                "inplace_attention=False, but the model was loaded with its state in place: "
                "load it with RuntimeOptions(inplace_attention=False)"
            )
        assert isinstance(model.kv, InPlaceSteps)
        kv = InPlaceKv(model, masked, model.kv)
    else:
        kv = CopiedKv(model, masked)
    return ContinuousBatch(model, kv, options.lookahead_positions)


def log_state(batch: DecodeBatch, max_rows: int) -> None:
    """Say at start what an in-place batch's buffers may hold (the state's memory is
    not allocated per step: /metrics has it as it goes)."""
    kv = batch.kv if isinstance(batch, ContinuousBatch) else None
    if not isinstance(kv, InPlaceKv):
        return
    config = kv.model.config
    position = 2 * config.decoder_layers * config.d_model * kv.itemsize
    most = INITIAL_ROWS  # the buffers' rows at most: doubled past `max_rows`
    while most < max_rows:
        most *= 2
    log.info(
        "decoder state in place: %.0f KiB a row and position (self-attention), as much a "
        "row and source position (cross-attention); a lane's buffers hold %d positions a "
        "row and double their rows as it needs, up to %d rows (%.0f MiB), mapped as "
        "written (/metrics: nmt_decoder_state_bytes)",
        position / 2**10,
        kv.positions,
        most,
        position * kv.positions * most / 2**20,
    )
