"""One decode scheduler per model: every encoder and decoder call of the model, batched.

Callers on any thread (the streaming controller's workers, offline `translate`) hand over
requests and block on them; the scheduler's lanes run every ONNX Runtime call of the
model, so the cores are never oversubscribed by decodes each on its own thread pool, and
requests share decoder steps: a single stream is memory-bound (each step reads the whole
decoder and the output projection), so a step over 16 rows costs little more than over
one (int8 OPUS-MT on 2 cores: 3.3 ms at 1 row, 10.7 ms at 16).

Lanes: one thread per core by default, each with its own batch and ONNX Runtime calls on
one intra-op thread. Measured on 2 cores: a second ORT thread on the same call speeds
these small calls up by 0-20% (a 1-row step is even slower), while two lanes run two
calls at once, so one lane left a core idle. Waiting requests go to whichever lane has
room first.

The loop, after Orca / vLLM's iteration-level scheduling, for an encoder-decoder:

1. take what arrived: encoder jobs (run at once, in one padded call) and decode requests;
2. drop requests whose caller no longer wants them (`should_stop`: a newer partial of the
   stream arrived), waiting or running, at the next step: latest wins per stream;
3. admit waiting requests into the batch, finals and offline calls before partials, up to
   `max_rows`: with the stock decoder graphs (no per-row positions) only when the batch
   is empty, i.e. requests that start together run together (lockstep);
4. one decoder call for every live row, then each request's search takes its rows' logits;
   finished requests are answered.

Finals are never dropped or cancelled, and are admitted first, so a flood of partials
cannot starve them; partials are bounded by latest-wins (one per stream).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from engine.decoding.search import (
    LOOKAHEAD_POSITIONS,
    Batch,
    ContinuousBatch,
    DecodeOptions,
    DecodingCancelled,
    Hypothesis,
    Search,
    StepHook,
    make_search,
)
from engine.model import EncoderOutput, IntArray, MarianOnnx

log = logging.getLogger(__name__)


class Threads(NamedTuple):
    """How a model's `cores` are used: `lanes` batches run at once, each call on
    `per_lane` ONNX Runtime threads, except a step's output projection on `head`."""

    lanes: int
    per_lane: int
    head: int


@dataclass(frozen=True)
class SchedulerOptions:
    """Batch limits and threads, in one place.

    `max_rows`: decoder rows per step and lane (a beam of 4 is 4 rows); waiting requests
    past it join later. `cores`: the cores the machine's models may use (default: all it
    has). `models`: how many models (each with its own scheduler) share those cores, as
    when one stream is translated into several languages at once: each scheduler counts
    only its share, so that all of them together run one call per core, never more (on 2
    cores and 2 models: one lane of one thread each). `lanes`: threads that each run a
    batch (default: 2 with 2 cores or more in the share, else 1). `threads_per_lane`: ONNX
    Runtime intra-op threads of the model's sessions (default: share / lanes, at least 1);
    an explicit `intra_op_threads` given when loading the model wins. `head_threads`:
    threads of a decoder step's output projection (default: the whole share): the one op
    of a step big enough to share out, so a lone stream gets both cores there while the
    step's small ops stay on its lane's thread. `lookahead_positions`: extra positions a
    cached step may compute to verify re-aligned draft tokens, over all its rows (see
    `engine.decoding.search.LOOKAHEAD_POSITIONS`; 0 turns lookahead off).
    """

    max_rows: int = 32
    lookahead_positions: int = LOOKAHEAD_POSITIONS
    lanes: int | None = None
    threads_per_lane: int | None = None
    cores: int | None = None
    head_threads: int | None = None
    models: int = 1

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        for name in ("lanes", "threads_per_lane", "cores", "head_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.models < 1:
            raise ValueError("models must be >= 1")
        if self.lookahead_positions < 0:
            raise ValueError("lookahead_positions must be >= 0")

    def resolved(self, cores: int | None = None) -> Threads:
        """Lanes and threads of one of `models` schedulers on `cores` cores (default:
        `self.cores`, else the machine's): the one place the core budget is split."""
        cores = max(1, (cores or self.cores or os.cpu_count() or 1) // self.models)
        lanes = self.lanes or (2 if cores >= 2 else 1)
        threads = self.threads_per_lane or max(1, cores // lanes)
        return Threads(lanes, threads, self.head_threads or max(cores, threads))


FINAL = 0
"""Priority of a request that must not be dropped (a final, an offline call)."""
PARTIAL = 1
"""Priority of a request that a newer one may supersede."""


@dataclass(eq=False)
class _Request:
    search: Search
    enc: EncoderOutput  # its one source
    priority: int
    should_stop: Callable[[], bool] | None
    future: Future[Hypothesis] = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)

    def stale(self) -> bool:
        return self.should_stop is not None and self.should_stop()


@dataclass(eq=False)
class _EncodeJob:
    input_ids: IntArray
    attention_mask: IntArray
    future: Future[EncoderOutput] = field(default_factory=Future)


class SchedulerClosed(RuntimeError):
    """A request to a scheduler that has been closed."""


class _Lane:
    """One thread's batch and the requests running in it."""

    def __init__(self, index: int, batch: Batch | ContinuousBatch) -> None:
        self.index = index
        self.batch = batch
        self.running: dict[Search, _Request] = {}
        self.stats: Counter[str] = Counter()
        self.batch_sizes: Counter[int] = Counter()


class DecodeScheduler:
    """Batches every encoder and decoder call of one `MarianOnnx` on its lanes.

    `encode` and `decode` block the calling thread until done; call them from worker
    threads (the streaming controller does), never from an event loop. The lanes start
    with the first request and stop at `close`.
    """

    def __init__(self, model: MarianOnnx, options: SchedulerOptions | None = None) -> None:
        self.model = model
        self.options = options or SchedulerOptions()
        self.lanes, self.threads_per_lane, _ = self.options.resolved()
        self._cond = threading.Condition()
        self._waiting: list[_Request] = []
        self._encodes: list[_EncodeJob] = []
        self._lanes = [_Lane(i, self._new_batch()) for i in range(self.lanes)]
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def batching(self) -> str:
        """`continuous` (requests join the running batch at any step) or `lockstep`."""
        return self.model.batching

    @property
    def stats(self) -> Counter[str]:
        """Counters summed over the lanes: decoder_steps, prefill_calls, prefill_rows,
        encoder_calls, rows_ended, rows_cancelled, queue_wait_ms, idle_ms (waiting for
        work), draft_offered and draft_accepted (draft tokens verified in prefills),
        lookahead_offered and lookahead_accepted (re-aligned draft tokens verified in
        steps)."""
        total: Counter[str] = Counter()
        for lane in self._lanes:
            total.update(lane.stats)
        return total

    @property
    def batch_sizes(self) -> Counter[int]:
        """How many decoder steps ran with each number of rows, over the lanes."""
        total: Counter[int] = Counter()
        for lane in self._lanes:
            total.update(lane.batch_sizes)
        return total

    def _new_batch(self) -> Batch | ContinuousBatch:
        masked = self.model.masked
        if masked is None:
            return Batch(self.model)
        return ContinuousBatch(self.model, masked, self.options.lookahead_positions)

    # -- API (any thread) ---------------------------------------------------------------

    def encode(self, input_ids: IntArray, attention_mask: IntArray) -> EncoderOutput:
        """The encoder over a padded batch, run by the next lane between two steps."""
        job = _EncodeJob(input_ids, attention_mask)
        self._submit(encodes=[job])
        return job.future.result()

    def decode(
        self,
        enc: EncoderOutput,
        options: DecodeOptions = DecodeOptions(),
        *,
        prefixes: Sequence[Sequence[int]] | None = None,
        hook: StepHook | None = None,
        should_stop: Callable[[], bool] | None = None,
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> list[Hypothesis]:
        """Decode each source of `enc` (after its forced prefix) as its own request.

        With `should_stop`, the requests are partials: dropped at the next step once it
        returns true (raising `DecodingCancelled` here) and admitted after finals.
        `drafts`: tokens each row is expected to continue with (greedy only), verified in
        the prefill call when the batching is continuous; the result is the same.
        """
        prefixes = prefixes if prefixes is not None else [[] for _ in range(enc.batch_size)]
        drafts = drafts if drafts is not None else [[] for _ in range(enc.batch_size)]
        if not len(prefixes) == len(drafts) == enc.batch_size:
            raise ValueError("one prefix (and draft) per source is needed")
        priority = FINAL if should_stop is None else PARTIAL
        requests = [
            _Request(
                make_search(self.model.config, prefix, options, hook, draft),
                enc.select(np.array([row], dtype=np.int64)),
                priority,
                should_stop,
            )
            for row, (prefix, draft) in enumerate(zip(prefixes, drafts, strict=True))
        ]
        self._submit(requests=requests)
        return [request.future.result() for request in requests]

    def close(self) -> None:
        """Answer what is queued with `SchedulerClosed` and stop the lanes."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    # -- the loop (lane threads) ---------------------------------------------------------

    def _submit(
        self, *, requests: Sequence[_Request] = (), encodes: Sequence[_EncodeJob] = ()
    ) -> None:
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the decode scheduler is closed")
            self._waiting.extend(requests)
            self._encodes.extend(encodes)
            if not self._threads:
                for lane in self._lanes:
                    thread = threading.Thread(
                        target=self._loop,
                        args=(lane,),
                        name=f"decode-lane-{lane.index}",
                        daemon=True,
                    )
                    thread.start()
                    self._threads.append(thread)
            self._cond.notify_all()

    def _loop(self, lane: _Lane) -> None:
        while True:
            with self._cond:
                idle = time.perf_counter()
                while not (self._waiting or self._encodes or lane.batch) and not self._closed:
                    self._cond.wait()
                lane.stats["idle_ms"] += int((time.perf_counter() - idle) * 1000)
                if self._closed:
                    self._fail_lane(lane, SchedulerClosed("the decode scheduler is closed"))
                    self._fail_waiting(SchedulerClosed("the decode scheduler is closed"))
                    return
                encodes, self._encodes = self._encodes, []
            try:
                self._run_encodes(lane, encodes)
                self._iterate(lane)
            except Exception as exc:  # a failing call must not kill the lane
                log.exception("decoder step failed; its requests get the error")
                self._fail_lane(lane, exc)

    def _run_encodes(self, lane: _Lane, jobs: list[_EncodeJob]) -> None:
        """Every encoder job that arrived, in one call over their rows padded to the
        longest; each job gets its rows back at its own width (padding is masked, so its
        states are those of running it alone)."""
        if not jobs:
            return
        pad = self.model.config.pad_token_id
        width = max(int(job.input_ids.shape[1]) for job in jobs)
        ids = np.concatenate(
            [
                np.pad(
                    j.input_ids, ((0, 0), (0, width - j.input_ids.shape[1])), constant_values=pad
                )
                for j in jobs
            ]
        )
        mask = np.concatenate(
            [
                np.pad(j.attention_mask, ((0, 0), (0, width - j.attention_mask.shape[1])))
                for j in jobs
            ]
        )
        try:
            out = self.model.encode(ids, mask)
        except Exception as exc:
            for job in jobs:
                job.future.set_exception(exc)
            return
        lane.stats["encoder_calls"] += 1
        row = 0
        for job in jobs:
            n, w = job.input_ids.shape
            job.future.set_result(
                EncoderOutput(out.hidden_states[row : row + n, :w], job.attention_mask)
            )
            row += n

    def _iterate(self, lane: _Lane) -> None:
        batch = lane.batch
        if batch.has_logits:
            for search in batch.advance():
                self._finish(lane, search)
        self._drop_stale_waiting(lane)
        if batch.can_join:
            chosen = self._admit(lane, self.options.max_rows - batch.rows)
            if chosen:
                for request in chosen:  # on an error, _fail_lane answers them
                    lane.running[request.search] = request
                ended = batch.join([(r.search, r.enc) for r in chosen])
                for search in ended:
                    self._finish(lane, search)
                lane.stats["prefill_calls"] += 1
                lane.stats["prefill_rows"] += len(chosen)
        stale = [s for s in batch.searches if lane.running[s].stale()]
        if stale:
            batch.remove(stale)
            for search in stale:
                self._cancel(lane, lane.running.pop(search))
        rows = batch.rows
        if rows:
            lane.batch_sizes[rows] += 1
            lane.stats["decoder_steps"] += 1
            batch.forward()
        if isinstance(batch, ContinuousBatch):  # draft and lookahead tokens verified
            lane.stats.update(batch.stats)
            batch.stats.clear()

    def _drop_stale_waiting(self, lane: _Lane) -> None:
        with self._cond:
            stale = [r for r in self._waiting if r.stale()]
            if stale:
                self._waiting = [r for r in self._waiting if r not in stale]
        for request in stale:
            self._cancel(lane, request)

    def _admit(self, lane: _Lane, room: int) -> list[_Request]:
        """Waiting requests this lane starts now: finals and offline calls first, then by
        arrival, as many rows as there is room for (at least one when the lane is idle).
        A lane with more rows than another leaves the waiting requests to that one (which
        was woken too), so the lanes' batches stay even."""
        fewest = min(other.batch.rows for other in self._lanes)
        if lane.batch.rows > fewest + 1:
            return []
        with self._cond:
            self._waiting.sort(key=lambda r: (r.priority, r.submitted))
            chosen: list[_Request] = []
            rows = 0
            for request in self._waiting:
                width = request.search.options.beam_size
                if rows + width > room and (chosen or room < self.options.max_rows):
                    break
                chosen.append(request)
                rows += width
            self._waiting = self._waiting[len(chosen) :]
        now = time.perf_counter()
        for request in chosen:
            lane.stats["queue_wait_ms"] += int((now - request.submitted) * 1000)
        return chosen

    def _finish(self, lane: _Lane, search: Search) -> None:
        """Answer an ended search's request. The request has already left `running`, so
        `_fail_lane` would not see it: a result that cannot be built is that request's
        error, never a future left waiting (the caller would hang, and a final would go
        unanswered)."""
        request = lane.running.pop(search)
        lane.stats["rows_ended"] += 1
        try:
            result = search.result()
        except Exception as exc:
            log.exception("a decode's result could not be built; its request gets the error")
            request.future.set_exception(exc)
            return
        request.future.set_result(result)

    def _cancel(self, lane: _Lane, request: _Request) -> None:
        request.future.set_exception(DecodingCancelled())
        lane.stats["rows_cancelled"] += 1

    def _fail_lane(self, lane: _Lane, exc: Exception) -> None:
        for request in lane.running.values():
            if not request.future.done():
                request.future.set_exception(exc)
        lane.running.clear()
        lane.batch = self._new_batch()

    def _fail_waiting(self, exc: Exception) -> None:
        with self._cond:
            waiting, self._waiting = self._waiting, []
            encodes, self._encodes = self._encodes, []
        for request in waiting:
            if not request.future.done():
                request.future.set_exception(exc)
        for job in encodes:
            if not job.future.done():
                job.future.set_exception(exc)
