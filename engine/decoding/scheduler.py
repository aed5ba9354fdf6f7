"""One decode scheduler per model: every encoder and decoder call of the model, batched.

Callers on any thread (the streaming controller's workers, offline `translate`) hand over
requests and wait on them; the scheduler's lanes run every ONNX Runtime call of the model,
so the cores are never oversubscribed by decodes each on its own thread pool, and requests
share decoder steps: one stream's step is memory-bound (it reads the whole decoder and the
output projection), so a step over many rows costs little more than over one.

Lanes: one thread per core by default, each with its own batch and ONNX Runtime calls on
one intra-op thread: a second ORT thread on these small calls gains little, while two
lanes run two calls at once. Waiting requests go to whichever lane has room first.

The loop, after Orca / vLLM's iteration-level scheduling, for an encoder-decoder:

1. take what arrived: encoder jobs (run at once, in one padded call) and decode requests;
2. the batch's searches take the last step's logits (`DecodeBatch.update`); finished
   requests are answered;
3. aborted requests' rows leave, and waiting requests join, finals and offline calls
   before partials, up to `max_rows` rows and `prefill_positions` prefill positions
   (`DecodeBatch.schedule`): with the stock decoder graphs only when the batch is empty
   (lockstep). Newcomers whose sources came as ids (`Encoding`) are encoded first, in one
   call, so a request makes one trip through a lane, not an encoder trip and a decoder
   trip;
4. one decoder call for every live row (`DecodeBatch.execute`).

With `prefill_apart`, a lane has a second thread that runs step 3's encoder and prefill
calls while the first goes on stepping, and hands the prefilled rows over between two
steps (`Prefilled`), as disaggregated prefill does in LLM serving; it is off by default
(measured no better on 2 cores: examples/benchmarks/README.md, issue 25).

Cancellation is pushed in: the owner of a request calls `abort(ids)` (a newer partial of
the stream arrived: latest wins); no lane calls back into its callers. A waiting request
is dropped at once, a running one leaves at the next step; an id aborted before its
request arrives is remembered, so that request is refused at once. Finals are submitted
without an id, so never aborted, and admitted first: a flood of partials cannot starve
them, and partials are bounded by latest-wins.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

import numpy as np

from engine.decoding.batch import (
    LOOKAHEAD_POSITIONS,
    ContinuousBatch,
    DecodeBatch,
    LockstepBatch,
    Prefilled,
)
from engine.decoding.search import (
    DecodeOptions,
    DecodingCancelled,
    Hypothesis,
    Search,
    StepHook,
    make_search,
)
from engine.decoding.timeline import Answered, Step, Timeline
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
    threads of a decoder step's output projection (default: the lane's own with several
    lanes, else the whole share): the one op of a step big enough to share out, so a
    lane alone on the cores gets all of them there while the step's small ops stay on its
    thread. Two lanes that each spread it over both cores ran four threads on two cores
    under load, and 32 real-time streams then missed the p95 that one thread each holds
    (examples/benchmarks/README.md, issue 25); a lone stream is as fast either way.
    `lookahead_positions`: extra positions a
    cached step may compute to verify re-aligned draft tokens, over all its rows (see
    `engine.decoding.batch.LOOKAHEAD_POSITIONS`; 0 turns lookahead off).
    `prefill_positions`: decoder positions (start token, forced prefix and draft of each
    row) one lane's prefill may take per turn; the waiting requests past it go to the
    other lane or the next turn (`PREFILL_POSITIONS`). `prefill_apart`: each lane runs
    its prefills on a thread of their own, next to the thread that steps its batch
    (continuous batching only; `_prefill_loop`): off by default, as on 2 cores one lane
    so split measured no better than two lanes (examples/benchmarks/README.md, issue
    25). `recognizers`:
    cores of the budget given to speech recognition's worker processes (`serve --asr`):
    taken off `cores` before the models' share, so recognition and translation together
    never run more calls than the machine has cores (at least one core stays for the
    models).
    """

    max_rows: int = 32
    lookahead_positions: int = LOOKAHEAD_POSITIONS
    prefill_positions: int = 0  # 0: PREFILL_POSITIONS
    lanes: int | None = None
    threads_per_lane: int | None = None
    cores: int | None = None
    head_threads: int | None = None
    models: int = 1
    recognizers: int = 0
    prefill_apart: bool = False

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        for name in ("lanes", "threads_per_lane", "cores", "head_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.models < 1:
            raise ValueError("models must be >= 1")
        if self.recognizers < 0:
            raise ValueError("recognizers must be >= 0")
        if self.lookahead_positions < 0:
            raise ValueError("lookahead_positions must be >= 0")
        if self.prefill_positions < 0:
            raise ValueError("prefill_positions must be >= 0")

    def resolved(self, cores: int | None = None, *, apart: bool | None = None) -> Threads:
        """Lanes and threads of one of `models` schedulers on `cores` cores (default:
        `self.cores`, else the machine's): the one place the core budget is split. A lane
        that prefills apart (`apart`, default `prefill_apart`) runs two calls at once."""
        total = cores or self.cores or os.cpu_count() or 1
        cores = max(1, max(1, total - self.recognizers) // self.models)
        calls = 2 if (self.prefill_apart if apart is None else apart) else 1
        lanes = self.lanes or (2 if cores >= 2 * calls else 1)
        threads = self.threads_per_lane or max(1, cores // (lanes * calls))
        head = self.head_threads or (threads if lanes > 1 else max(cores, threads))
        return Threads(lanes, threads, head)


PREFILL_POSITIONS = 96
"""Decoder positions one lane's prefill takes per turn, by default. A prefill verifies
whole drafts, so it is compute-bound (every draft position goes through the output
projection: ~15 ms a row here) and the lane's running rows wait for it: a lane that took
every waiting request at once ran prefills of up to 7 rows, 150-600 ms, while the other
lane sat idle with nothing left to take. A budget spreads a burst over both lanes and
bounds how long running rows wait; a request longer than the budget still joins an
idle-enough lane on its own (figures: examples/benchmarks/README.md, issue 25)."""


PREFILL_PADDING = 16
"""Padding positions a newcomer may add to a prefill it joins (its rows padded to the
longest, or the others to it). Padding is computed like real positions (~0.37 ms per row
and position, OPUS-MT int8 on one core), while a call of its own costs ~6.5 ms besides
its positions (~1,500 ONNX nodes, most of them the per-token quantization's small ops),
about 17 positions' worth: a request much longer or shorter than the turn's first one
waits for another call, the other lane's or the next turn's, and one close in length
joins although it came later. 16 measured a little better than 8 under load (figures:
examples/benchmarks/README.md, issue 25)."""


class Priority(enum.IntEnum):
    """Admission order: waiting finals (and offline calls) join a batch before partials."""

    FINAL = 0
    PARTIAL = 1


RequestId: TypeAlias = Hashable
"""Names the requests of one submission for `DecodeScheduler.abort`; unique in the
process (`new_request_id`), as an aborted id is remembered for later submissions."""

_request_ids = itertools.count(1)


def new_request_id() -> int:
    """An id no other caller of this process gets (`next` on a count is atomic)."""
    return next(_request_ids)


ABORTS_REMEMBERED = 4096
"""Aborted ids kept, to refuse a submission that comes after its abort (the owner may
abort an event before its worker thread submits, or between two decodes of the event):
far more than the aborts of every stream in the time a worker takes to submit."""


@dataclass(eq=False)
class Encoding:
    """Right-padded source ids and, once a lane ran the encoder on them, their states
    (`future`).

    Given to `DecodeScheduler.submit` in place of an `EncoderOutput`, the sources are
    encoded by the lane that admits their requests, in one call with the other
    newcomers' sources, just before their prefill: a request then makes one trip through
    a lane, not two (an encoder trip waited ~26 ms at the median for the lane's turn to
    end, for an encoder call of ~3 ms). Keep it to reuse the states: once `encoded`, a
    later submission skips the encoder.
    """

    input_ids: IntArray
    attention_mask: IntArray
    future: Future[EncoderOutput] = field(default_factory=Future)
    claimed: bool = False  # a lane runs the encoder on it (under the scheduler's lock)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def encoded(self) -> EncoderOutput | None:
        """The states when the encoder ran on these sources and succeeded, else None."""
        if not self.future.done() or self.future.exception() is not None:
            return None
        return self.future.result()


@dataclass(eq=False)
class _Request:
    search: Search
    source: EncoderOutput | Encoding  # its sources, of which it decodes `row`
    row: int
    priority: Priority
    request_id: RequestId | None  # None: never aborted
    future: Future[Hypothesis] = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # when a lane took it from the waiting list (under the lock)
    aborted: bool = False  # its row leaves the batch at the lane's next step

    @property
    def admitted(self) -> bool:
        """Taken from the waiting list by a lane."""
        return self.started > 0.0

    @property
    def positions(self) -> int:
        """Decoder positions its prefill feeds: start token, forced prefix and draft."""
        search = self.search
        return search.options.beam_size * (1 + len(search.prefix) + len(search.draft))

    def enc(self) -> EncoderOutput:
        """Its one source's states (the source has been encoded)."""
        source = self.source
        if isinstance(source, Encoding):
            source = source.future.result()
        return source.select(np.array([self.row], dtype=np.int64))


class _Turn(NamedTuple):
    """Seconds the parts of a lane turn took, and the rows (for the timeline)."""

    encode: float
    encode_rows: int
    update: float
    schedule: float
    execute: float
    rows: int
    joined: int
    left: int


class SchedulerClosed(RuntimeError):
    """A request to a scheduler that has been closed."""


class _Lane:
    """One batch, the requests running in it, and what its prefill thread handed over."""

    def __init__(self, index: int, batch: DecodeBatch) -> None:
        self.index = index
        self.batch = batch
        self.running: dict[Search, _Request] = {}
        self.stats: Counter[str] = Counter()
        self.prefill_stats: Counter[str] = Counter()  # the prefill thread's own
        self.batch_sizes: Counter[int] = Counter()
        # Under the scheduler's lock: newcomers in the prefill thread's call, and prefilled
        # groups the stepping thread has not adopted yet.
        self.prefilling: list[_Request] = []
        self.prefilled: list[tuple[Prefilled, list[_Request]]] = []

    @property
    def rows(self) -> int:
        """Rows it holds or will hold once what is being prefilled joins (under the lock)."""
        pending = sum(r.search.width for r in self.prefilling)
        pending += sum(len(done.kept) for done, _ in self.prefilled)
        return self.batch.rows + pending


class DecodeScheduler:
    """Batches every encoder and decoder call of one `MarianOnnx` on its lanes.

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
        # Prefills apart need a batch that rows join at any step (the rewritten decoder).
        self.apart = self.options.prefill_apart and model.masked is not None
        self.lanes, self.threads_per_lane, _ = self.options.resolved(apart=self.apart)
        self._cond = threading.Condition()
        self._waiting: list[_Request] = []
        self._encodes: list[Encoding] = []
        self._lanes = [_Lane(i, self._new_batch()) for i in range(self.lanes)]
        self._threads: list[threading.Thread] = []
        self._closed = False
        # Under `_cond`: requests not answered yet by id, ids aborted (oldest first), and
        # counts of what `abort` and `submit` decided on the caller's thread.
        self._live: dict[RequestId, list[_Request]] = {}
        self._aborted: OrderedDict[RequestId, None] = OrderedDict()
        self._counts: Counter[str] = Counter()

    @property
    def batching(self) -> str:
        """`continuous` (requests join the running batch at any step) or `lockstep`."""
        return self.model.batching

    @property
    def stats(self) -> Counter[str]:
        """Counters summed over the lanes: decoder_steps, prefill_calls, prefill_rows,
        encoder_calls, rows_ended, rows_cancelled, rows_finished_on_abort, queue_wait_ms,
        idle_ms (waiting for work), draft_offered and draft_accepted (draft tokens verified
        in prefills), lookahead_offered and lookahead_accepted (re-aligned draft tokens
        verified in steps)."""
        with self._cond:
            total = Counter(self._counts)
        for lane in self._lanes:
            total.update(lane.stats)
            total.update(lane.prefill_stats)
        return total

    @property
    def batch_sizes(self) -> Counter[int]:
        """How many decoder steps ran with each number of rows, over the lanes."""
        total: Counter[int] = Counter()
        for lane in self._lanes:
            total.update(lane.batch_sizes)
        return total

    def _new_batch(self) -> DecodeBatch:
        masked = self.model.masked
        if masked is None:
            return LockstepBatch(self.model)
        return ContinuousBatch(self.model, masked, self.options.lookahead_positions)

    # -- API (any thread) ---------------------------------------------------------------

    def encode(self, input_ids: IntArray, attention_mask: IntArray) -> EncoderOutput:
        """The encoder over a padded batch, run by the next lane between two steps."""
        job = Encoding(input_ids, attention_mask)
        self._submit(encodes=[job])
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
    ) -> list[Future[Hypothesis]]:
        """Queue each source of `enc` (after its forced prefix) as a request of its own;
        each future gets its answer. `enc`: the sources' states, or an `Encoding` whose
        sources the admitting lane encodes first (once: a done one is reused).

        `priority`: finals before partials at admission. `request_id`: given when the
        requests may be aborted (`abort`); raises `DecodingCancelled` at once when it was
        aborted already. `drafts`: tokens each row is expected to continue with (greedy
        only), verified in the prefill call when the batching is continuous; the result
        is the same.
        """
        prefixes = prefixes if prefixes is not None else [[] for _ in range(enc.batch_size)]
        drafts = drafts if drafts is not None else [[] for _ in range(enc.batch_size)]
        if not len(prefixes) == len(drafts) == enc.batch_size:
            raise ValueError("one prefix (and draft) per source is needed")
        if isinstance(enc, Encoding) and enc.encoded is not None:
            enc = enc.encoded
        requests = [
            _Request(
                make_search(self.model.config, prefix, options, hook, draft),
                enc,
                row,
                Priority(priority),
                request_id,
            )
            for row, (prefix, draft) in enumerate(zip(prefixes, drafts, strict=True))
        ]
        self._submit(requests=requests)
        return [request.future for request in requests]

    def abort(self, ids: Iterable[RequestId]) -> None:
        """Abort the requests submitted with these ids, and those submitted with them
        later: a waiting one is answered with `DecodingCancelled` now, a running one
        leaves its batch at the next step (then answered so). Ids of requests already
        answered change nothing. Any thread; never waits for a step.

        Except a running row whose prefill confirmed its whole draft (`Search.
        draft_confirmed`): what it has left is the tokens past its previous hypothesis, a
        step or two, while its prefill (most of its cost) is spent. Under load a stream's
        partials come about as fast as a lane answers them, and aborting such rows threw
        that prefill away for nothing: the stream's next event waits those steps and the
        stale update is still sent first, so the newest one still wins on screen
        (examples/benchmarks/README.md, issue 25)."""
        dropped: list[_Request] = []
        with self._cond:
            for request_id in ids:
                self._aborted[request_id] = None
                self._aborted.move_to_end(request_id)
                for request in self._live.pop(request_id, ()):
                    if request.admitted and request.search.draft_confirmed:
                        self._counts["rows_finished_on_abort"] += 1
                        continue  # a step or two from its answer: see `abort`
                    request.aborted = True
                    if not request.admitted:
                        dropped.append(request)
            while len(self._aborted) > ABORTS_REMEMBERED:
                self._aborted.popitem(last=False)
            if dropped:
                self._waiting = [r for r in self._waiting if not r.aborted]
                self._counts["rows_cancelled"] += len(dropped)
        for request in dropped:
            request.future.set_exception(DecodingCancelled())

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
        self, *, requests: Sequence[_Request] = (), encodes: Sequence[Encoding] = ()
    ) -> None:
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the decode scheduler is closed")
            if requests and requests[0].request_id is not None:
                request_id = requests[0].request_id
                if request_id in self._aborted:
                    self._counts["rows_cancelled"] += len(requests)
                    raise DecodingCancelled
                self._live.setdefault(request_id, []).extend(requests)
            self._waiting.extend(requests)
            self._encodes.extend(encodes)
            if not self._threads:
                for lane in self._lanes:
                    loops = [(self._loop, "decode-lane")]
                    if self.apart:
                        loops.append((self._prefill_loop, "prefill-lane"))
                    for target, name in loops:
                        thread = threading.Thread(
                            target=target,
                            args=(lane,),
                            name=f"{name}-{lane.index}",
                            daemon=True,
                        )
                        thread.start()
                        self._threads.append(thread)
            self._cond.notify_all()

    def _takes_prefills(self, lane: _Lane) -> bool:
        """Whether the stepping thread admits newcomers itself (under the lock): always
        without a prefill thread; with one, only while it has no rows to step and nothing
        prefilled to adopt, so that a burst's prefills use both threads but running rows
        never wait for a prefill."""
        return not self.apart or not (lane.batch or lane.prefilled)

    def _loop(self, lane: _Lane) -> None:
        """The stepping thread of a lane: update, adopt what was prefilled, admit (see
        `_takes_prefills`), execute."""
        while True:
            with self._cond:
                idle = time.perf_counter()
                while not (
                    lane.batch
                    or lane.prefilled
                    or (self._takes_prefills(lane) and (self._waiting or self._encodes))
                    or self._closed
                ):
                    self._cond.wait()
                began = time.perf_counter()
                lane.stats["idle_ms"] += int((began - idle) * 1000)
                if self._closed:
                    self._fail_lane(lane, SchedulerClosed("the decode scheduler is closed"))
                    self._fail_waiting(SchedulerClosed("the decode scheduler is closed"))
                    return
                adopted, lane.prefilled = lane.prefilled, []
                encodes: list[Encoding] = []
                if self._takes_prefills(lane):
                    encodes, self._encodes = self._encodes, []
            try:
                self._run_encodes(lane, encodes)
                encoded = time.perf_counter()
                turn = self._iterate(lane, adopted)
            except Exception as exc:  # a failing call must not kill the lane
                log.exception("decoder step failed; its requests get the error")
                self._fail_lane(lane, exc)
                continue
            if self.timeline is not None:
                self.timeline.add(
                    Step(
                        lane.index,
                        began,
                        began - idle,
                        encoded - began + turn.encode,
                        sum(job.batch_size for job in encodes) + turn.encode_rows,
                        turn.update,
                        turn.schedule,
                        turn.execute,
                        turn.rows,
                        turn.joined,
                        turn.left,
                        len(self._waiting),
                    )
                )

    def _prefill_loop(self, lane: _Lane) -> None:
        """The prefill thread of a lane: takes encoder jobs and waiting requests (finals
        first, up to the position budget), encodes and prefills them in one call each,
        and hands the rows to the stepping thread, which adopts them at its next step.
        Meanwhile that thread goes on stepping the running rows: a prefill verifies whole
        drafts (tens of milliseconds), and rows waiting behind it were most of a request's
        latency under load."""
        while True:
            with self._cond:
                idle = time.perf_counter()
                while not (self._waiting or self._encodes or self._closed):
                    self._cond.wait()
                began = time.perf_counter()
                lane.prefill_stats["prefill_idle_ms"] += int((began - idle) * 1000)
                if self._closed:
                    return
                encodes, self._encodes = self._encodes, []
            self._run_encodes(lane, encodes, lane.prefill_stats)
            e0 = time.perf_counter()
            joining = self._admit(lane, self.options.max_rows - lane.rows, prefilling=True)
            ready = self._encode_joining(lane, joining, lane.prefill_stats)
            e1 = time.perf_counter()
            done: Prefilled | None = None
            if ready:
                try:
                    batch = lane.batch  # pure: whichever batch adopts it
                    assert isinstance(batch, ContinuousBatch)
                    done = batch.prefill([(r.search, r.enc()) for r in ready])
                except Exception as exc:
                    log.exception("prefill failed; its requests get the error")
                    for request in ready:
                        self._forget(request)
                        request.future.set_exception(exc)
                    ready = []
            p1 = time.perf_counter()
            with self._cond:
                lane.prefilling = []
                closed = self._closed
                if done is not None and not closed:
                    lane.prefilled.append((done, ready))
                    lane.prefill_stats["prefill_calls"] += 1
                    lane.prefill_stats["prefill_rows"] += len(ready)
                self._cond.notify_all()
            if closed:
                for request in ready:
                    self._forget(request)
                    request.future.set_exception(SchedulerClosed("the decode scheduler is closed"))
            if self.timeline is not None and (encodes or joining):
                self.timeline.add(
                    Step(
                        lane.index,
                        began,
                        began - idle,
                        e0 - began + e1 - e0,
                        sum(job.batch_size for job in encodes) + len(joining),
                        0.0,
                        p1 - e1,
                        0.0,
                        0,
                        len(ready),
                        0,
                        len(self._waiting),
                        "prefill",
                    )
                )

    def _run_encodes(
        self, lane: _Lane, jobs: Sequence[Encoding], stats: Counter[str] | None = None
    ) -> None:
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
        (lane.stats if stats is None else stats)["encoder_calls"] += 1
        row = 0
        for job in jobs:
            n, w = job.input_ids.shape
            job.future.set_result(
                EncoderOutput(out.hidden_states[row : row + n, :w], job.attention_mask)
            )
            row += n

    def _encode_joining(
        self, lane: _Lane, joining: list[_Request], stats: Counter[str] | None = None
    ) -> list[_Request]:
        """Encode the sources of newcomers that came with ids (`Encoding`), in one call
        with any the turn took; returns the newcomers whose sources are encoded (those
        whose encoder call failed are answered with its error)."""
        jobs = {id(r.source): r.source for r in joining if isinstance(r.source, Encoding)}
        with self._cond:  # a submission's rows may join two lanes: one encodes them
            pending = [job for job in jobs.values() if not job.claimed]
            for job in pending:
                job.claimed = True
        self._run_encodes(lane, pending, stats)
        ready: list[_Request] = []
        for request in joining:
            source = request.source
            if isinstance(source, Encoding) and source.future.exception() is not None:
                self._forget(request)
                request.future.set_exception(source.future.exception() or RuntimeError())
                continue
            ready.append(request)
        return ready

    def _iterate(
        self, lane: _Lane, adopted: Sequence[tuple[Prefilled, list[_Request]]] = ()
    ) -> _Turn:
        """One step of the lane's batch: update, adopt the rows the prefill thread
        prefilled, schedule (newcomers' sources encoded first when they came as ids),
        execute (`DecodeBatch`)."""
        batch = lane.batch
        t0 = time.perf_counter()
        for search in batch.update():
            self._finish(lane, search)
        for done, requests in adopted:
            assert isinstance(batch, ContinuousBatch)
            for request in requests:
                lane.running[request.search] = request
            batch.adopt(done)
            for search in done.ended:
                self._finish(lane, search)
        t1 = time.perf_counter()
        with self._cond:
            leaving = [search for search, r in lane.running.items() if r.aborted]
            takes = self._takes_prefills(lane)
        joining: list[_Request] = []
        if takes and batch.joinable:
            joining = self._admit(lane, self.options.max_rows - batch.rows)
        encoding = sum(
            r.source.batch_size
            for r in {id(r.source): r for r in joining}.values()
            if isinstance(r.source, Encoding) and not r.source.future.done()
        )
        for request in joining:  # on an error, _fail_lane answers them
            lane.running[request.search] = request
        e0 = time.perf_counter()
        ready = self._encode_joining(lane, joining) if encoding else joining
        for request in joining:
            if request not in ready:
                del lane.running[request.search]
        joining = ready
        e1 = time.perf_counter()
        ended = batch.schedule([(r.search, r.enc()) for r in joining], leaving)
        for search in leaving:
            self._cancel(lane, lane.running.pop(search))
        for search in ended:
            self._finish(lane, search)
        if joining:
            lane.stats["prefill_calls"] += 1
            lane.stats["prefill_rows"] += len(joining)
        rows = batch.rows
        t2 = time.perf_counter()
        if rows:
            lane.batch_sizes[rows] += 1
            lane.stats["decoder_steps"] += 1
            batch.execute()
        t3 = time.perf_counter()
        if batch.stats:  # draft and lookahead tokens verified
            lane.stats.update(batch.stats)
            batch.stats.clear()
        encode = e1 - e0
        schedule = t2 - t1 - encode
        return _Turn(encode, encoding, t1 - t0, schedule, t3 - t2, rows, len(joining), len(leaving))

    def _admit(self, lane: _Lane, room: int, *, prefilling: bool = False) -> list[_Request]:
        """Waiting requests this lane starts now: finals and offline calls first, then by
        arrival, as many rows as there is room for (at least one when the lane is idle)
        and as many prefill positions as one turn takes (at least one request). The
        first one taken sets the prefill's length; a later one joins only if it adds at
        most `PREFILL_PADDING` padding positions, else it waits for another call.
        A lane with more rows than another leaves the waiting requests to that one (which
        was woken too), so the lanes' batches stay even."""
        budget = self.options.prefill_positions or PREFILL_POSITIONS
        with self._cond:
            fewest = min(other.rows for other in self._lanes)
            if lane.rows > fewest + 1:
                return []
            self._waiting.sort(key=lambda r: (r.priority, r.submitted))
            now = time.perf_counter()
            chosen: list[_Request] = []
            left: list[_Request] = []
            rows = positions = longest = 0
            for index, request in enumerate(self._waiting):
                width = request.search.options.beam_size
                if rows + width > room and (chosen or room < self.options.max_rows):
                    left.extend(self._waiting[index:])
                    break
                if chosen and positions + request.positions > budget:
                    left.extend(self._waiting[index:])
                    break  # the rest: the other lane, or this one's next turn
                length = request.positions // width  # its rows' own length
                padding = (
                    (length - longest) * rows if length > longest else (longest - length) * width
                )
                if chosen and padding > PREFILL_PADDING:
                    left.append(request)
                    continue
                chosen.append(request)
                request.started = now
                rows += width
                positions += request.positions
                longest = max(longest, length)
            self._waiting = left
            if prefilling:
                lane.prefilling = chosen
        stats = lane.prefill_stats if prefilling else lane.stats
        for request in chosen:
            stats["queue_wait_ms"] += int((now - request.submitted) * 1000)
        return chosen

    def _finish(self, lane: _Lane, search: Search) -> None:
        """Answer an ended search's request. The request has already left `running`, so
        `_fail_lane` would not see it: a result that cannot be built is that request's
        error, never a future left waiting (the caller would hang, and a final would go
        unanswered)."""
        request = lane.running.pop(search)
        self._forget(request)
        lane.stats["rows_ended"] += 1
        try:
            result = search.result()
        except Exception as exc:
            log.exception("a decode's result could not be built; its request gets the error")
            request.future.set_exception(exc)
            return
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

    def _cancel(self, lane: _Lane, request: _Request) -> None:
        request.future.set_exception(DecodingCancelled())
        lane.stats["rows_cancelled"] += 1

    def _forget(self, request: _Request) -> None:
        """Take an answered request out of `_live` (`abort` took it out already if its id
        was aborted)."""
        if request.request_id is None:
            return
        with self._cond:
            live = self._live.get(request.request_id)
            if live is not None and request in live:
                live.remove(request)
                if not live:
                    del self._live[request.request_id]

    def _fail_lane(self, lane: _Lane, exc: Exception) -> None:
        with self._cond:
            adopted, lane.prefilled = lane.prefilled, []
        for _, requests in adopted:
            for request in requests:
                lane.running[request.search] = request
        for request in lane.running.values():
            self._forget(request)
            if not request.future.done():
                request.future.set_exception(exc)
        lane.running.clear()
        lane.batch = self._new_batch()

    def _fail_waiting(self, exc: Exception) -> None:
        with self._cond:
            waiting, self._waiting = self._waiting, []
            encodes, self._encodes = self._encodes, []
        for request in waiting:
            self._forget(request)
            if not request.future.done():
                request.future.set_exception(exc)
        for job in encodes:
            if not job.future.done():
                job.future.set_exception(exc)
