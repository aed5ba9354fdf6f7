"""One decode scheduler per model: every encoder and decoder call of the model, batched.

Callers on any thread (the streaming controller's workers, offline `translate`) hand over
requests and wait on them; the scheduler's lanes run every ONNX Runtime call of the model,
so the cores are never oversubscribed by decodes each on its own thread pool, and requests
share decoder steps: one stream's step is memory-bound (it reads the whole decoder and the
output projection), so a step over many rows costs little more than over one.

What runs when is the policy's (`engine.decoding.policy`: finals first, latest wins,
prefill budgets, lane balance); this module is its engine, as in vLLM: lane threads, the
condition variable, futures, and the model calls of each plan. A lane's turn, after Orca /
vLLM's iteration-level scheduling:

1. the batch's searches take the last step's logits (`DecodeBatch.update`); the policy
   answers those that ended and plans the turn (`SchedulingPolicy.schedule`);
2. the plan's encoder jobs run in one padded call: `encode` calls, and the sources of
   newcomers that came as ids (`Encoding`), so a request makes one trip through a lane;
3. aborted rows leave and newcomers join in one prefill call (`DecodeBatch.schedule`;
   with the stock decoder graphs only into an empty batch: lockstep);
4. one decoder call for every live row (`DecodeBatch.execute`).

A lane with nothing to run waits for work, but no longer than its batch's `quiet_in`:
then it gives back what a burst left (`DecodeBatch.settle`) and waits again. An idle lane
that finds only a partial or two may wait a little longer for more, as the policy says
(`SchedulingPolicy.hold`, the batch delay), on the same condition: a submission wakes it
when it ends the hold sooner than the wait would.

Lanes: one thread per core by default, each with its own batch and ONNX Runtime calls on
one intra-op thread: a second ORT thread on these small calls gains little, while two
lanes run two calls at once.

Cancellation is pushed in: the owner of a request calls `abort(ids)` (a newer partial of
the stream arrived); no lane calls back into its callers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager

import numpy as np

from engine.decoding.backends import (
    log_state,
    new_batch,
    open_pool,
    replays_cuda_graphs,
    runs_lockstep,
)
from engine.decoding.batch import DecodeBatch, Member
from engine.decoding.constraints import Constraints, new_search
from engine.decoding.options import DEVICE_PREFILL_POSITIONS, SchedulerOptions, Threads
from engine.decoding.policy import (
    PREFILL_POSITIONS,
    Answer,
    Plan,
    Priority,
    RequestId,
    SchedulingPolicy,
)
from engine.decoding.requests import Encoding, Request
from engine.decoding.search import (
    DecodeOptions,
    DecodingCancelled,
    Hypothesis,
    Search,
    StepHook,
)
from engine.decoding.timeline import Answered, Step, Timeline
from engine.model.kv.base import StateBytes
from engine.model.kv.slots.manager import KvSlotManager
from engine.model.layouts import EncoderOutput, IntArray
from engine.model.marian import MarianOnnx

# The policy's names that `submit` and `abort` take are importable from here too.
__all__ = [
    "DecodeScheduler",
    "Encoding",
    "SchedulerClosed",
    "SchedulerOptions",
    "Threads",
]

log = logging.getLogger(__name__)

STATE_EVERY = 0.05
"""Seconds between two readings of a busy lane's decoder state (`_Lane.state`, a gauge):
walking the arrays at every turn was a measurable share of a small model's turn
(docs/performance.md)."""


class SchedulerClosed(RuntimeError):
    """A request to a scheduler that has been closed."""


class _Lane:
    """One lane's batch, the requests whose rows it holds, and its counters."""

    def __init__(self, index: int, batch: DecodeBatch) -> None:
        self.index = index
        self.batch = batch
        self.requests: dict[Search, Request] = {}  # the batch's searches' requests
        self.stats: Counter[str] = Counter()
        self.batch_sizes: Counter[int] = Counter()
        # The batch's decoder state after the lane's last turn that left no rows, or its
        # last turn at least `STATE_EVERY` seconds after the one before, whichever came
        # last (set by the lane's thread: read from others, it is one consistent pair).
        self.state: StateBytes | None = batch.state_bytes()
        self.state_at = 0.0
        # While the batch delay holds the lane (under the scheduler's lock): when its
        # wait ends by itself.
        self.held_until: float | None = None


class DecodeScheduler:
    """Runs a `SchedulingPolicy`'s plans for every encoder and decoder call of one
    `MarianOnnx`, on its lanes.

    `encode` blocks the calling thread until done, as does waiting on what `submit`
    returns: call them from worker threads (the streaming controller does), never from an
    event loop; `abort` never blocks for long. The lanes start with the first request and
    stop at `close`.
    """

    def __init__(
        self,
        model: MarianOnnx,
        options: SchedulerOptions | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        self.model = model
        self.options = options or SchedulerOptions()
        # Set to record every lane turn and answered request (`engine.decoding.timeline`);
        # None: nothing kept.
        self.timeline = timeline
        # The policy's clock (seconds): what a request's `submitted` and the batch delay's
        # `hold` read; a test's own where it sets one, so that whether a lane holds is
        # decided by the times the test gives, not by how the OS schedules its threads.
        # The lanes' waits and turns stay on the real clock (under a test's clock, the
        # queue waits counted from `submitted` are that clock's).
        self.clock: Callable[[], float] = time.perf_counter
        self.lanes, self.threads_per_lane, *_ = self.options.resolved()
        if self.options.lanes is None and replays_cuda_graphs(model):
            # A model whose steps replay CUDA graphs (a GPU's default) runs one lane: a
            # capture forbids other threads' device work, and one lane's graphs step a
            # thousand rows in a few milliseconds (docs/gpu.md).
            self.lanes = 1
        self._cond = threading.Condition()
        self.kv = open_pool(self.model, self.options, self.lanes)
        self._policy: SchedulingPolicy[Request, Encoding] = SchedulingPolicy(
            self.lanes,
            max_rows=self.options.max_rows,
            prefill_positions=self.options.prefill_positions or self._prefill_budget(),
            lockstep=runs_lockstep(model),
            kv=None if self.kv is None else KvSlotManager(self.kv.slots),
            batch_delay=self.options.batch_delay_ms / 1000.0,
        )
        self._lanes = [_Lane(i, self._new_batch()) for i in range(self.lanes)]
        log_state(self._lanes[0].batch, self.options.max_rows)
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._running = 0  # lanes in a turn (under `_cond`)

    @property
    def batching(self) -> str:
        """`continuous` (requests join the running batch at any step) or `lockstep`."""
        return self.model.batching

    @property
    def waiting(self) -> int:
        """Requests no lane has taken yet."""
        with self._cond:
            return self._policy.waiting

    @property
    def stats(self) -> Counter[str]:
        """Counters summed over the lanes: decoder_steps, decoder_step_rows (the steps'
        rows, summed), prefill_calls, prefill_rows,
        encoder_calls, encoder_rows, rows_ended, rows_cancelled, rows_finished_on_abort,
        queue_wait_ms, idle_ms (waiting for work, or held by the batch delay), held_turns and
        held_us (turns the batch delay held back, and for how long), draft_offered and
        draft_accepted (draft tokens verified in prefills), lookahead_offered and
        lookahead_accepted (re-aligned draft tokens verified in steps)."""
        with self._cond:
            total = Counter(self._policy.counts)
        for lane in self._lanes:
            total.update(lane.stats)
        return total

    @property
    def kv_slots(self) -> dict[str, int] | None:
        """The KV slot pool: its slots (`total`), those no request holds (`free`) and its
        `bytes`; None without one."""
        if self.kv is None:
            return None
        with self._cond:
            free = self._policy.free_slots or 0
        return {"total": self.kv.slots, "free": free, "bytes": self.kv.bytes}

    @property
    def state_bytes(self) -> StateBytes | None:
        """The lanes' decoder state after their last turns, summed (`StateBytes`: what the
        rows occupy, what the arrays holding them span); None where the lanes' batches do
        not keep it themselves (lockstep; a KV slot pool is `kv_slots`)."""
        states = [lane.state for lane in self._lanes]
        if any(state is None for state in states):
            return None
        return StateBytes(
            sum(state.live for state in states if state is not None),
            sum(state.reserved for state in states if state is not None),
        )

    @property
    def batch_sizes(self) -> Counter[int]:
        """How many decoder steps ran with each number of rows, over the lanes."""
        total: Counter[int] = Counter()
        for lane in self._lanes:
            total.update(lane.batch_sizes)
        return total

    def _prefill_budget(self) -> int:
        """Positions a turn's prefill takes by default: on the CPU a prefill is compute the
        running rows wait for (`PREFILL_POSITIONS`); on a GPU a call of thousands of
        positions costs about what a call of a hundred does, and a small budget would
        admit newcomers slower than streams send them."""
        on_device = self.kv is not None and self.kv.device[0] != "cpu"
        return DEVICE_PREFILL_POSITIONS if on_device else PREFILL_POSITIONS

    def _new_batch(self) -> DecodeBatch:
        return new_batch(self.model, self.options, self.kv)

    # -- API (any thread) ---------------------------------------------------------------

    def encode(self, input_ids: IntArray, attention_mask: IntArray) -> EncoderOutput:
        """The encoder over a padded batch, run by the next lane between two steps."""
        job = Encoding(input_ids, attention_mask)
        with self._submitting():
            self._policy.add_encode(job)
        return job.future.result()

    def submit(
        self,
        enc: EncoderOutput | Encoding,
        options: DecodeOptions,
        *,
        priority: Priority,
        request_id: RequestId | None = None,
        prefixes: Sequence[Sequence[int]] | None = None,
        hook: StepHook | None = None,
        drafts: Sequence[Sequence[int]] | None = None,
        constraints: Sequence[Constraints] | None = None,
    ) -> list[Future[Hypothesis]]:
        """Queue each source of `enc` (after its forced prefix) as a request of its own;
        each future gets its answer. `enc`: the sources' states, or an `Encoding` whose
        sources the admitting lane encodes first (once: a done one is reused).

        `priority`: finals before partials at admission. `request_id`: given when the
        requests may be aborted (`abort`); raises `DecodingCancelled` at once when it was
        aborted already. `drafts`: tokens each row is expected to continue with (greedy
        only), verified in the prefill call when the batching is continuous; the result
        is the same. `constraints`: token sequences each row's output must hold (a
        glossary's matched targets, `engine.decoding.constraints`); none: the plain search.
        """
        prefixes = prefixes if prefixes is not None else [[] for _ in range(enc.batch_size)]
        drafts = drafts if drafts is not None else [[] for _ in range(enc.batch_size)]
        constraints = constraints if constraints is not None else [()] * enc.batch_size
        if not len(prefixes) == len(drafts) == len(constraints) == enc.batch_size:
            raise ValueError("one prefix (and draft and constraints) per source is needed")
        if isinstance(enc, Encoding) and enc.encoded is not None:
            enc = enc.encoded
        requests = [
            Request(
                new_search(
                    self.model.config,
                    prefix,
                    options,
                    hook,
                    draft,
                    terms,
                    source_tokens=int(np.count_nonzero(enc.attention_mask[row])),
                ),
                enc,
                row,
                Priority(priority),
                request_id,
                submitted=self.clock(),
            )
            for row, (prefix, draft, terms) in enumerate(
                zip(prefixes, drafts, constraints, strict=True)
            )
        ]
        with self._submitting():
            self._policy.add(requests)
        return [request.future for request in requests]

    def abort(self, ids: Iterable[RequestId]) -> None:
        """Abort the requests submitted with these ids, and those submitted with them
        later (`SchedulingPolicy.abort`): a waiting one is answered with
        `DecodingCancelled` now, a running one leaves its batch at the next step (then
        answered so). Any thread; never waits for a step."""
        with self._cond:
            dropped = self._policy.abort(ids)
        for answer in dropped:
            answer.request.future.set_exception(answer.error or RuntimeError())

    def close(self) -> None:
        """Answer what is queued with `SchedulerClosed` and stop the lanes."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    # -- the lanes (their threads) -------------------------------------------------------

    @contextmanager
    def _submitting(self) -> Iterator[None]:
        """The policy under the lock, refused once closed; then the lanes started (at the
        first request) and woken."""
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the decode scheduler is closed")
            yield
            self._start_lanes()
            # One lane: an idle lane takes every waiting request (its rows are the
            # fewest), and a busy one looks at the queue at its next turn anyway; waking
            # every lane per submission woke all but one for nothing, each a thread
            # switch and a turn of the lock.
            if not self._holds_on():
                self._cond.notify()

    def _holds_on(self) -> bool:
        """Whether the batch delay still holds the waiting lanes after this submission:
        then none needs waking. A held lane is woken only when a submission ends the hold
        (a final, an encoder call, full calls, arrivals too sparse to wait for); one that
        only moves the hold's end waits on to its own, which is never past the delay from
        the oldest newcomer's arrival. Every waiting lane holds no rows, so each would hold
        alike. Woken for every partial, a held lane only waited again: under load, a
        wake-up per partial, two thread switches and the policy's look each."""
        held = next((lane for lane in self._lanes if lane.held_until is not None), None)
        return held is not None and self._policy.hold(held.index, self.clock()) > 0

    def _start_lanes(self) -> None:
        if self._threads:
            return
        for lane in self._lanes:
            thread = threading.Thread(
                target=self._loop, args=(lane,), name=f"decode-lane-{lane.index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _loop(self, lane: _Lane) -> None:
        """A lane's thread: wait for work, run a turn, record it."""
        while True:
            with self._cond:
                idle = time.perf_counter()
                settle = False
                held: float | None = None  # when the batch delay began to hold the lane
                while not self._closed:
                    if self._policy.has_work(lane.index):
                        now = self.clock()
                        hold = self._policy.hold(lane.index, now)
                        if hold <= 0:
                            break
                        held = held if held is not None else time.perf_counter()
                        lane.held_until = now + hold
                        # A submission that ends the hold sooner wakes it (`_holds_on`).
                        self._cond.wait(hold)
                        lane.held_until = None
                        continue
                    quiet = lane.batch.quiet_in()  # idle: memory to give back, and when
                    if quiet is not None and quiet <= 0:
                        settle = True
                        break
                    self._cond.wait(quiet)
                began = time.perf_counter()
                lane.stats["idle_ms"] += int((began - idle) * 1000)
                if held is not None:
                    lane.stats["held_turns"] += 1
                    lane.stats["held_us"] += int((began - held) * 1e6)
                closed = self._closed
                if not (closed or settle):
                    self._running += 1
                    # Alone, the lane's output projection may take every core; a lane
                    # that wakes meanwhile shares them for the rest of this turn only.
                    lane.batch.alone = self._running == 1
            if settle:  # outside the lock: giving pages back takes system calls
                try:
                    lane.batch.settle()
                except Exception:  # memory kept is no reason for a lane to stop serving
                    log.exception("an idle lane could not give its memory back")
                continue
            if closed:
                self._shut(lane)
                return
            step: Step | None = None
            try:
                step = self._turn(lane, began, began - idle)
            except Exception as exc:  # a failing call must not kill the lane
                log.exception("decoder step failed; its requests get the error")
                with self._cond:
                    answers = self._policy.fail_lane(lane.index, exc)
                self._answer(lane, answers)
                lane.requests.clear()
                lane.batch = self._new_batch()
                lane.state = lane.batch.state_bytes()
            finally:
                with self._cond:
                    self._running -= 1
            if step is not None and self.timeline is not None:
                self.timeline.add(step)

    def _shut(self, lane: _Lane) -> None:
        """Answer the lane's rows, and what waits, with `SchedulerClosed`."""
        closed = SchedulerClosed("the decode scheduler is closed")
        with self._cond:
            answers = self._policy.fail_lane(lane.index, closed)
            waiting, encodes = self._policy.drain(closed)
        self._answer(lane, [*answers, *waiting])
        for job in encodes:
            if not job.future.done():
                job.future.set_exception(closed)

    def _turn(self, lane: _Lane, began: float, waited: float) -> Step | None:
        """One turn of the lane: update, plan, encode, schedule, execute (module
        docstring); returns its times where a timeline keeps them (else None)."""
        batch = lane.batch
        had_rows = batch.rows
        t0 = time.perf_counter()
        ended = [lane.requests[search] for search in batch.update()]
        t1 = time.perf_counter()
        with self._cond:
            answers = self._policy.update(lane.index, ended)
        # Answered before planning: a caller waiting on one of them may submit its next
        # request in time to join this turn rather than the next.
        self._answer(lane, answers)
        with self._cond:
            plan = self._policy.schedule(lane.index)
            waiting = self._policy.waiting
            slots = {request: self._policy.slots_of(request) for request in plan.joining}
        self._answer(lane, [Answer(r, DecodingCancelled()) for r in plan.leaving])
        e0 = time.perf_counter()
        self._run_encodes(lane, plan.encodes)
        e1 = time.perf_counter()
        joining, failed = self._joining(lane, plan, e0)
        ended = [
            lane.requests[search]
            for search in batch.schedule(
                [Member(r.search, r.enc(), slots[r]) for r in joining],
                [r.search for r in plan.leaving],
            )
        ]
        with self._cond:  # the prefill ran; what ended there is answered before the step
            self._policy.joined(lane.index)
            answers = self._policy.update(lane.index, ended, failed)
        self._answer(lane, answers)
        if joining:
            lane.stats["prefill_calls"] += 1
            lane.stats["prefill_rows"] += len(joining)
        rows = batch.rows
        t2 = time.perf_counter()
        if rows:
            lane.batch_sizes[rows] += 1
            lane.stats["decoder_steps"] += 1
            lane.stats["decoder_step_rows"] += rows
            batch.execute()
        t3 = time.perf_counter()
        if batch.stats:  # draft and lookahead tokens verified
            stats = lane.stats
            for key, count in batch.stats.items():  # `Counter.update`, less its type checks
                stats[key] += count
            batch.stats.clear()
        # A turn whose newcomers all ended in their prefill, in a lane that held no rows,
        # changed no state (the common turn of a lightly loaded lane).
        if (had_rows or rows) and (not rows or t3 - lane.state_at >= STATE_EVERY):
            lane.state = batch.state_bytes()
            lane.state_at = t3
        if self.timeline is None:
            return None
        encode_rows = sum(job.batch_size for job in plan.encodes)
        return Step(
            lane.index,
            began,
            waited,
            e1 - e0,
            encode_rows,
            t1 - t0,
            e0 - t1 + t2 - e1,
            t3 - t2,
            rows,
            len(joining),
            len(plan.leaving),
            waiting,
        )

    def _joining(
        self, lane: _Lane, plan: Plan[Request, Encoding], now: float
    ) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """The plan's newcomers whose sources are encoded, now rows of the lane; and
        those whose encoder call failed, with its error."""
        joining: list[Request] = []
        failed: list[tuple[Request, BaseException]] = []
        for request in plan.joining:
            request.started = now
            lane.stats["queue_wait_ms"] += int((now - request.submitted) * 1000)
            error = request.encoder_error
            if error is not None:
                failed.append((request, error))
                continue
            joining.append(request)
            lane.requests[request.search] = request
        return joining, failed

    def _run_encodes(self, lane: _Lane, jobs: Sequence[Encoding]) -> None:
        """Every encoder job of the plan, in one call over their rows padded to the
        longest; each job gets its rows back at its own width (padding is masked, so its
        states are those of running it alone)."""
        if not jobs:
            return
        ids, mask = self._stacked(jobs)
        try:
            out = self.model.encode(ids, mask)
        except Exception as exc:
            for job in jobs:
                job.future.set_exception(exc)
            return
        lane.stats["encoder_calls"] += 1
        lane.stats["encoder_rows"] += len(ids)
        row = 0
        for job in jobs:
            n, w = job.input_ids.shape
            job.future.set_result(
                EncoderOutput(out.hidden_states[row : row + n, :w], job.attention_mask)
            )
            row += n

    def _stacked(self, jobs: Sequence[Encoding]) -> tuple[IntArray, IntArray]:
        """The jobs' sources in one right-padded batch (a lone job's own arrays): filled
        in place rather than padded job by job, which cost more than a small encoder
        call's own Python."""
        if len(jobs) == 1:
            return jobs[0].input_ids, jobs[0].attention_mask
        rows = sum(job.batch_size for job in jobs)
        width = max(int(job.input_ids.shape[1]) for job in jobs)
        ids = np.full((rows, width), self.model.config.pad_token_id, dtype=np.int64)
        mask = np.zeros((rows, width), dtype=np.int64)
        row = 0
        for job in jobs:
            n, w = job.input_ids.shape
            ids[row : row + n, :w] = job.input_ids
            mask[row : row + n, :w] = job.attention_mask
            row += n
        return ids, mask

    def _answer(self, lane: _Lane, answers: Iterable[Answer[Request]]) -> None:
        """Set each answered request's future: its error, or its search's result. A
        result that cannot be built is that request's error, never a future left
        waiting (the caller would hang, and a final would go unanswered)."""
        for answer in answers:
            request = answer.request
            lane.requests.pop(request.search, None)
            if answer.error is not None:
                if not request.future.done():
                    request.future.set_exception(answer.error)
                continue
            lane.stats["rows_ended"] += 1
            search = request.search
            try:
                result = search.result()
            except Exception as exc:
                log.exception("a decode's result could not be built; its request gets the error")
                request.future.set_exception(exc)
                continue
            request.future.set_result(result)
            if self.timeline is not None:
                past = len(result.token_ids) - len(search.prefix) - search.accepted
                self.timeline.answer(
                    Answered(
                        lane.index,
                        request.priority == Priority.PARTIAL,
                        request.started - request.submitted,
                        time.perf_counter() - request.started,
                        max(0, past),
                    )
                )
