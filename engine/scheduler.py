"""One decode scheduler per model: every encoder and decoder call of the model, batched.

Callers on any thread (the streaming controller's workers, offline `translate`) hand over
requests and block on them; one scheduler thread runs every ONNX Runtime call of the
model, so the cores are never oversubscribed by several decodes each on its own thread
pool, and requests share decoder steps: a single stream is memory-bound (each step reads
the whole decoder and the output projection), so a step over 16 rows costs little more
than over one.

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
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from engine.decoding import (
    Batch,
    ContinuousBatch,
    DecodeOptions,
    DecodingCancelled,
    Hypothesis,
    Search,
    StepHook,
    make_search,
)
from engine.runtime import EncoderOutput, IntArray, MarianOnnx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerOptions:
    """Batch limits. `max_rows`: decoder rows per step (a beam of 4 is 4 rows); waiting
    requests past it join later."""

    max_rows: int = 32

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError("max_rows must be >= 1")


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


class DecodeScheduler:
    """Batches every encoder and decoder call of one `MarianOnnx` on one thread.

    `encode` and `decode` block the calling thread until done; call them from worker
    threads (the streaming controller does), never from an event loop. The thread starts
    with the first request and stops at `close`.
    """

    def __init__(self, model: MarianOnnx, options: SchedulerOptions | None = None) -> None:
        self.model = model
        self.options = options or SchedulerOptions()
        self.stats: Counter[str] = Counter()
        self.batch_sizes: Counter[int] = Counter()  # rows per decoder step
        self._cond = threading.Condition()
        self._waiting: list[_Request] = []
        self._encodes: list[_EncodeJob] = []
        self._batch = self._new_batch()
        self._running: dict[Search, _Request] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def batching(self) -> str:
        """`continuous` (requests join the running batch at any step) or `lockstep`."""
        return self.model.batching

    def _new_batch(self) -> Batch | ContinuousBatch:
        masked = self.model.masked
        return Batch(self.model) if masked is None else ContinuousBatch(self.model, masked)

    # -- API (any thread) ---------------------------------------------------------------

    def encode(self, input_ids: IntArray, attention_mask: IntArray) -> EncoderOutput:
        """The encoder over a padded batch, run between two decoder steps."""
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
    ) -> list[Hypothesis]:
        """Decode each source of `enc` (after its forced prefix) as its own request.

        With `should_stop`, the requests are partials: dropped at the next step once it
        returns true (raising `DecodingCancelled` here) and admitted after finals.
        """
        prefixes = prefixes if prefixes is not None else [[] for _ in range(enc.batch_size)]
        if len(prefixes) != enc.batch_size:
            raise ValueError("one prefix per source is needed")
        priority = FINAL if should_stop is None else PARTIAL
        requests = [
            _Request(
                make_search(self.model.config, prefix, options, hook),
                enc.select(np.array([row], dtype=np.int64)),
                priority,
                should_stop,
            )
            for row, prefix in enumerate(prefixes)
        ]
        self._submit(requests=requests)
        return [request.future.result() for request in requests]

    def close(self) -> None:
        """Answer what is queued with `SchedulerClosed` and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- the loop (scheduler thread) -----------------------------------------------------

    def _submit(
        self, *, requests: Sequence[_Request] = (), encodes: Sequence[_EncodeJob] = ()
    ) -> None:
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the decode scheduler is closed")
            self._waiting.extend(requests)
            self._encodes.extend(encodes)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="decode-scheduler", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._encodes or self._batch) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._fail_all(SchedulerClosed("the decode scheduler is closed"))
                    return
                encodes, self._encodes = self._encodes, []
            try:
                self._run_encodes(encodes)
                self._iterate()
            except Exception as exc:  # a failing call must not kill the thread
                log.exception("decoder step failed; its requests get the error")
                self._fail_running(exc)

    def _run_encodes(self, jobs: list[_EncodeJob]) -> None:
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
        self.stats["encoder_calls"] += 1
        row = 0
        for job in jobs:
            n, w = job.input_ids.shape
            job.future.set_result(
                EncoderOutput(out.hidden_states[row : row + n, :w], job.attention_mask)
            )
            row += n

    def _iterate(self) -> None:
        batch = self._batch
        if batch.has_logits:
            for search in batch.advance():
                self._finish(search)
        self._drop_stale_waiting()
        if batch.can_join:
            chosen = self._admit(self.options.max_rows - batch.rows)
            if chosen:
                try:
                    ended = batch.join([(r.search, r.enc) for r in chosen])
                except Exception:
                    for request in chosen:  # answered with the error by _fail_running
                        self._running[request.search] = request
                    raise
                for request in chosen:
                    self._running[request.search] = request
                for search in ended:
                    self._finish(search)
                self.stats["prefill_calls"] += 1
                self.stats["prefill_rows"] += len(chosen)
        stale = [s for s in batch.searches if self._running[s].stale()]
        if stale:
            batch.remove(stale)
            for search in stale:
                self._cancel(self._running.pop(search))
        rows = batch.rows
        if rows:
            self.batch_sizes[rows] += 1
            self.stats["decoder_steps"] += 1
            batch.forward()

    def _drop_stale_waiting(self) -> None:
        with self._cond:
            stale = [r for r in self._waiting if r.stale()]
            if stale:
                self._waiting = [r for r in self._waiting if r not in stale]
        for request in stale:
            self._cancel(request)

    def _admit(self, room: int) -> list[_Request]:
        """Waiting requests to start now: finals and offline calls first, then by arrival,
        as many rows as there is room for (at least one request when the batch is empty)."""
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
            self.stats["queue_wait_ms"] += int((now - request.submitted) * 1000)
        return chosen

    def _finish(self, search: Search) -> None:
        request = self._running.pop(search)
        request.future.set_result(search.result())
        self.stats["rows_ended"] += 1

    def _cancel(self, request: _Request) -> None:
        request.future.set_exception(DecodingCancelled())
        self.stats["rows_cancelled"] += 1

    def _fail_running(self, exc: Exception) -> None:
        for request in self._running.values():
            if not request.future.done():
                request.future.set_exception(exc)
        self._running.clear()
        self._batch = self._new_batch()

    def _fail_all(self, exc: Exception) -> None:
        self._fail_running(exc)
        for request in self._waiting:
            request.future.set_exception(exc)
        for job in self._encodes:
            job.future.set_exception(exc)
        self._waiting.clear()
        self._encodes.clear()
