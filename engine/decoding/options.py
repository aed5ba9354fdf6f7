"""A scheduler's options (`SchedulerOptions`) and how they split its cores (`Threads`):
the one place a model's share of the machine becomes lanes and threads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from engine.decoding.batch import LOOKAHEAD_POSITIONS


class Threads(NamedTuple):
    """How a scheduler's `cores` are used: `lanes` batches run at once, each call on
    `per_lane` ONNX Runtime threads, except a step's output projection on `head`, and on
    `alone` (all the cores) while the other lanes are idle."""

    lanes: int
    per_lane: int
    head: int
    alone: int


DEVICE_PREFILL_POSITIONS = 4096
"""`PREFILL_POSITIONS` for a model on a GPU (`DecodeScheduler._prefill_budget`)."""


@dataclass(frozen=True)
class SchedulerOptions:
    """Batch limits and threads of one model's scheduler. Whoever builds the process
    gives it its share of the machine (`cores`); everything else derives from it here
    (`resolved`), so lanes and threads together run one call per core."""

    # Decoder rows per step and lane (a beam of 4 is 4 rows); the rest wait their turn.
    max_rows: int = 32
    # Extra positions a cached step may compute to verify re-aligned draft tokens, over
    # all its rows (`engine.decoding.batch.LOOKAHEAD_POSITIONS`; 0 turns lookahead off).
    lookahead_positions: int = LOOKAHEAD_POSITIONS
    # Decoder positions one lane's prefill takes per turn (0: `PREFILL_POSITIONS` on the
    # CPU, `DEVICE_PREFILL_POSITIONS` on a GPU).
    prefill_positions: int = 0
    # Threads that each run a batch (default: 2 with 2 cores or more, else 1).
    lanes: int | None = None
    # ONNX Runtime intra-op threads per lane (default: cores / lanes); an explicit
    # `intra_op_threads` given when loading the model wins.
    threads_per_lane: int | None = None
    # The cores this scheduler may use (default: all the machine has).
    cores: int | None = None
    # Threads of a step's output projection, the one op big enough to share out
    # (default: the lane's own with several lanes, else all the cores): two lanes that
    # each spread it over every core oversubscribe them under load.
    head_threads: int | None = None
    # KV slots: rows whose decoder state the model keeps in place, allocated at start;
    # requests beyond them wait, a request wider than all of them is refused. 0: none (the
    # lanes keep their rows' state: `inplace_attention`). None: one per row the lanes may
    # hold (lanes x max_rows) where the model has graphs over slots, built by default on a GPU
    # only (`RuntimeOptions.kv_slots`): on the CPU ONNX Runtime copies the rows' keys and
    # values out of the slots at every step (Gather), which costs more than it saves (see
    # docs/performance.md#kv-slots).
    kv_slots: int | None = None
    # Continuous batches on the CPU keep each row's self-attention keys and values in
    # buffers that steps extend in place (`engine.model.kv.inplace.rows`) rather than
    # copying them at every step. None: where the model built that step (on the CPU, by
    # default); False: the state copied at every step, with lookahead for up to 4 rows
    # (docs/performance.md#self-attention-in-place).
    inplace_attention: bool | None = None
    # Milliseconds an idle lane may wait, from its oldest newcomer's arrival, for more
    # partials to share its encoder and prefill calls, while the recent arrival rate makes
    # one likely (`SchedulingPolicy.hold`); running rows never wait, finals never do.
    # 0: none. The default is measured (docs/performance.md#the-batch-delay-issue-54).
    batch_delay_ms: float = 3.0

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        if self.kv_slots is not None and self.kv_slots < 0:
            raise ValueError("kv_slots must be >= 0")
        for name in ("lanes", "threads_per_lane", "cores", "head_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.lookahead_positions < 0:
            raise ValueError("lookahead_positions must be >= 0")
        if self.prefill_positions < 0:
            raise ValueError("prefill_positions must be >= 0")
        if not self.batch_delay_ms >= 0:  # NaN too
            raise ValueError("batch_delay_ms must be >= 0")

    def resolved(self, cores: int | None = None) -> Threads:
        """Lanes and threads on `cores` cores (default: `self.cores`, else the
        machine's): the one place a scheduler's cores are split."""
        cores = cores or self.cores or os.cpu_count() or 1
        lanes = self.lanes or (2 if cores >= 2 else 1)
        threads = self.threads_per_lane or max(1, cores // lanes)
        head = self.head_threads or (threads if lanes > 1 else max(cores, threads))
        return Threads(lanes, threads, head, max(cores, head))
