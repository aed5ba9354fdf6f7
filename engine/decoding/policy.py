"""Which requests run on which lane, and when: the decode scheduler's policy.

Pure and single-threaded, as vLLM's scheduler is beside its engine: no locks, threads,
model or clock. The engine (`engine.decoding.scheduler`) calls it under its own lock and
runs what it plans on the model:

- `add` queues requests (refused at once when their id was aborted already), `add_encode`
  encoder jobs;
- `hold(lane, now)` says how long an idle lane waits for more newcomers before its turn
  (the batch delay: 0 unless arrivals are dense enough to fill its calls);
- `schedule(lane)` plans a lane's turn (`Plan`): the encoder jobs to run, the running
  requests whose rows leave (aborted) and the waiting requests whose rows join;
- `joined(lane)` says the lane's prefill ran: its newcomers count as its rows from then on
  (the lane balance judges each lane by the batch it steps, as the batch counts it);
- `update(lane, ended, failed)` takes what the lane's calls did and returns the answers;
- `abort(ids)`: latest wins; the waiting requests dropped are answered at once.

A request is a row group named by the request itself: it enters a lane's running set when
a plan has it join and leaves it when it is answered, aborted or failed. That set is where
a per-row decoder state (a cache slot) is taken and given back.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeAlias, TypeVar, cast

from engine.decoding.search import DecodingCancelled
from engine.errors import EngineError
from engine.model.kv.slots.manager import KvSlotManager


class Priority(enum.IntEnum):
    """Admission order: waiting finals (and offline calls) join a batch before partials,
    so a flood of partials cannot starve them; partials are bounded by latest-wins."""

    FINAL = 0
    PARTIAL = 1


RequestId: TypeAlias = Hashable
"""Names the requests of one submission for `abort`; unique in the process
(`new_request_id`), as an aborted id is remembered for later submissions."""

_request_ids = itertools.count(1)


def new_request_id() -> int:
    """An id no other caller of this process gets (`next` on a count is atomic)."""
    return next(_request_ids)


ABORTS_REMEMBERED = 4096
"""Aborted ids kept, to refuse a submission that comes after its abort (the owner may
abort an event before its worker thread submits, or between two decodes of the event):
far more than the aborts of every stream in the time a worker takes to submit."""

PREFILL_POSITIONS = 96
"""Decoder positions one lane's prefill takes per turn, by default. A prefill verifies
whole drafts, so it is compute-bound and the lane's running rows wait for it: a budget
spreads a burst over the lanes and bounds that wait; a request longer than the budget
still joins an idle-enough lane on its own."""

PREFILL_PADDING = 16
"""Padding positions a newcomer may add to a prefill it joins (its rows padded to the
longest, or the others to it). Padding costs like real positions, while a call of its
own has a fixed cost of a dozen or so positions: a request much longer or shorter than
the turn's first one waits for another call, and one close in length joins although it
came later."""

HOLD_CHANCE = 0.5
"""How likely another newcomer must be, before the batch delay runs out, for an idle lane
to keep waiting for it (`SchedulingPolicy.hold`), arrivals taken as a Poisson stream at
the recent rate: less, and the wait would more often than not end with no one gained."""

GAP_SMOOTHING = 8
"""Submissions over which the recent gap between arrivals, and the share of them that
found others in flight, are averaged (exponential means): enough that one early or late
partial does not swing them, few enough that a burst is seen within a few arrivals."""

CONCURRENT_MIN = 0.1
"""The share of recent arrivals that must have found another request waiting or running
for an idle lane to hold (`SchedulingPolicy.hold`). Below it the arrivals look like one
caller that waits for each answer before it submits the next (a fast replay, a loop over
`answer`): dense, yet no one else would come during a wait, which would only slow it."""


class EncoderJob(Protocol):
    """An encoder call's sources, run once: `claimed` once a plan gave it to a lane."""

    claimed: bool


class Schedulable(Protocol):
    """What the policy reads of a request (the engine's holds a search and a future)."""

    @property
    def priority(self) -> Priority: ...

    @property
    def request_id(self) -> RequestId | None:
        """None: never aborted."""

    @property
    def width(self) -> int:
        """Rows it may hold (its beam)."""

    @property
    def rows(self) -> int:
        """Rows it holds now in its lane's batch."""

    @property
    def positions(self) -> int:
        """Decoder positions its prefill feeds, all rows together."""

    @property
    def nearly_done(self) -> bool:
        """Running, and a step or two from its answer (its prefill confirmed its draft)."""

    @property
    def encoding(self) -> EncoderJob | None:
        """The encoder job its source waits on; None when its source is encoded."""

    @property
    def submitted(self) -> float:
        """When it was submitted, on the engine's clock (seconds; what `hold`'s `now`
        reads): the batch delay counts from the oldest newcomer's arrival."""


R = TypeVar("R", bound=Schedulable)
J = TypeVar("J", bound=EncoderJob)


@dataclass
class Plan(Generic[R, J]):
    """One lane's turn: run `encodes` (one padded call), then the rows of `leaving` leave
    the batch and those of `joining` join it (one prefill call), then one step."""

    encodes: list[J] = field(default_factory=list)
    joining: list[R] = field(default_factory=list)
    leaving: list[R] = field(default_factory=list)


class NotEnoughSlots(EngineError, ValueError):
    """A request needs more KV slots than the whole pool has: it could never run (an
    `EngineError`: the CLI says so in one line, exit 2)."""


@dataclass(frozen=True)
class Answer(Generic[R]):
    """A request that left the running set: `error` None when it finished (its result is
    its search's), else what it is answered with."""

    request: R
    error: BaseException | None = None


class SchedulingPolicy(Generic[R, J]):
    """The waiting and running requests of one model's lanes, and who runs next.

    `max_rows`: decoder rows per step and lane. `prefill_positions`: positions one lane's
    prefill takes per turn (`PREFILL_POSITIONS`). `lockstep`: requests join only a lane
    with no rows (the stock decoder graphs keep one length for the whole batch).
    `kv`: the free list of the model's KV slots (None: its rows keep no slots), which
    the policy only asks whether a request's rows fit: a request takes one slot per row
    it may hold when it joins a lane and gives them back when it leaves; one that finds
    too few free waits, as it does for a lane's room. `batch_delay`: seconds an idle lane
    may wait, from its oldest newcomer's arrival, for more newcomers to share its encoder
    and prefill calls (`hold`; 0: none)."""

    def __init__(
        self,
        lanes: int,
        *,
        max_rows: int,
        prefill_positions: int = PREFILL_POSITIONS,
        lockstep: bool = False,
        kv: KvSlotManager[R] | None = None,
        batch_delay: float = 0.0,
    ) -> None:
        if batch_delay < 0:
            raise ValueError("batch_delay must be >= 0")
        self.max_rows = max_rows
        self.batch_delay = batch_delay
        self.kv = kv
        self.prefill_positions = prefill_positions
        self.lockstep = lockstep
        self.counts: Counter[str] = Counter()  # rows_cancelled, rows_finished_on_abort
        self._waiting: list[R] = []  # in arrival order
        self._encodes: list[J] = []
        self._running: list[dict[R, None]] = [{} for _ in range(lanes)]
        self._aborted_rows: set[R] = set()  # running, aborted: leave at the next turn
        self._joining: list[set[R]] = [set() for _ in range(lanes)]  # planned, not prefilled
        self._live: dict[RequestId, list[R]] = {}  # not answered yet, by id
        self._aborted: OrderedDict[RequestId, None] = OrderedDict()
        self._last_arrival: float | None = None  # the newest submission's `submitted`
        self._gap = math.inf  # the recent mean gap between submissions (seconds)
        self._concurrent = 0.0  # the recent share of submissions that found others in flight

    @property
    def lanes(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def rows(self, lane: int) -> int:
        """Rows the lane's batch holds: its running requests but those still joining (the
        lane's prefill has not run yet), as the batch counts them."""
        joining = self._joining[lane]
        return sum(request.rows for request in self._running[lane] if request not in joining)

    def joined(self, lane: int) -> None:
        """The lane's prefill ran: the requests its last plan had join are rows now."""
        self._joining[lane].clear()

    @property
    def free_slots(self) -> int | None:
        """KV slots no request holds (None: no pool)."""
        return None if self.kv is None else self.kv.free

    def slots_of(self, request: R) -> tuple[int, ...]:
        """The KV slots a running request holds (none without a pool)."""
        return () if self.kv is None else self.kv.slots_of(request)

    def running(self, lane: int) -> list[R]:
        return list(self._running[lane])

    def has_work(self, lane: int) -> bool:
        """Whether the lane has rows to step or anything to take."""
        return bool(self._running[lane] or self._waiting or self._encodes)

    # -- events ----------------------------------------------------------------------

    def add(self, requests: Sequence[R]) -> None:
        """Queue one submission's requests. Raises `DecodingCancelled` when their id was
        aborted before they came."""
        if self.kv is not None:
            widest = max((r.width for r in requests), default=0)
            if not self.kv.could_fit(widest):
                raise NotEnoughSlots(
                    f"a request of {widest} rows needs {widest} KV slots; the pool has "
                    f"{self.kv.total} (--kv-slots)"
                )
        ids = {r.request_id for r in requests if r.request_id is not None}
        if any(request_id in self._aborted for request_id in ids):
            self.counts["rows_cancelled"] += len(requests)
            raise DecodingCancelled
        if requests:
            in_flight = bool(self._waiting) or any(self._running)
            self._arrived(max(request.submitted for request in requests), in_flight)
        for request in requests:
            if request.request_id is not None:
                self._live.setdefault(request.request_id, []).append(request)
        self._waiting.extend(requests)

    def add_encode(self, job: J) -> None:
        self._encodes.append(job)

    def _arrived(self, at: float, in_flight: bool) -> None:
        """One submission's arrival (its requests came together): the recent gap, and
        the recent share of arrivals that found other requests in flight."""
        self._concurrent += (float(in_flight) - self._concurrent) / GAP_SMOOTHING
        last, self._last_arrival = self._last_arrival, at
        if last is None:
            return
        gap = max(0.0, at - last)
        self._gap = gap if math.isinf(self._gap) else self._gap + (gap - self._gap) / GAP_SMOOTHING

    def hold(self, lane: int, now: float) -> float:
        """Seconds the lane waits for more newcomers before its turn (0: it goes now).

        A lane's encoder and prefill calls cost about as much for a few rows as for one
        (their graphs' nodes, not their rows), while under load an idle lane seldom finds
        more than one newcomer: waiting a little fills them, as Triton's dynamic batcher's
        queue delay does. The lane waits only when it holds no rows (a running batch steps
        at once, and newcomers join it as they always do), only for partials (a final
        or an encoder call is what a stream or a caller waits on: it goes at once, with
        the partials waiting beside it), only while the waiting calls are not full (the
        lane's rows, the turn's prefill positions), never past `batch_delay` from the
        oldest newcomer's arrival, and only while the recent arrival rate makes another
        newcomer likely before then (`HOLD_CHANCE`): a lone stream, or a few, pay nothing.
        The time since the newest arrival counts as a gap, so a silence ends the wait; and
        arrivals that never overlap (`CONCURRENT_MIN`: one caller waiting on each answer)
        are never held."""
        if self.batch_delay <= 0 or self._running[lane] or self._encodes or not self._waiting:
            return 0.0
        if self._concurrent < CONCURRENT_MIN:
            return 0.0
        rows = positions = 0
        oldest = math.inf
        for request in self._waiting:
            if request.priority != Priority.PARTIAL:
                return 0.0
            rows += request.width
            positions += request.positions
            oldest = min(oldest, request.submitted)
        if rows >= self.max_rows or positions >= self.prefill_positions:
            return 0.0
        since = now - self._last_arrival if self._last_arrival is not None else math.inf
        gap = max(self._gap, since)
        # Another arrival within `left` seconds has a chance of 1 - exp(-left / gap).
        needed = gap * -math.log(1.0 - HOLD_CHANCE)
        left = oldest + self.batch_delay - now - needed
        return max(0.0, min(left, self.batch_delay))

    def abort(self, ids: Iterable[RequestId]) -> list[Answer[R]]:
        """Abort the requests submitted with these ids, and those submitted with them
        later: the waiting ones are answered now (returned), a running one leaves its
        batch at its lane's next turn. Ids of requests already answered change nothing.

        Except a running request `nearly_done`: what it has left is a step or two past
        its previous hypothesis while its prefill, most of its cost, is spent; under load
        aborting such rows threw that prefill away and the stream's next event waited
        those steps anyway."""
        dropped: list[R] = []
        for request_id in ids:
            self._aborted[request_id] = None
            self._aborted.move_to_end(request_id)
            for request in self._live.pop(request_id, ()):
                if not self._is_running(request):
                    dropped.append(request)
                elif request.nearly_done:
                    self.counts["rows_finished_on_abort"] += 1
                else:
                    self._aborted_rows.add(request)
        while len(self._aborted) > ABORTS_REMEMBERED:
            self._aborted.popitem(last=False)
        if dropped:
            gone = set(dropped)
            self._waiting = [r for r in self._waiting if r not in gone]
            self.counts["rows_cancelled"] += len(dropped)
        return [Answer(request, DecodingCancelled()) for request in dropped]

    def schedule(self, lane: int) -> Plan[R, J]:
        """The lane's next turn: every queued encoder job, the aborted rows leaving, and
        the waiting requests joining (`_admit`) with their sources' encoder jobs not
        claimed by another lane yet."""
        running = self._running[lane]
        plan: Plan[R, J] = Plan(encodes=self._encodes)
        self._encodes = []
        plan.leaving = [request for request in running if request in self._aborted_rows]
        for request in plan.leaving:
            del running[request]
            self._aborted_rows.discard(request)
            self._give_back(request)
        self.counts["rows_cancelled"] += len(plan.leaving)
        if not (self.lockstep and running):
            plan.joining = self._admit(lane)
        self._joining[lane] = set(plan.joining)
        for request in plan.joining:
            running[request] = None
            if self.kv is not None:
                self.kv.allocate(request, request.width)
            job = request.encoding
            if job is not None and not job.claimed:  # a submission may join two lanes
                job.claimed = True
                plan.encodes.append(cast(J, job))
        return plan

    def update(
        self, lane: int, ended: Iterable[R] = (), failed: Iterable[tuple[R, BaseException]] = ()
    ) -> list[Answer[R]]:
        """The lane's calls ended these requests (their searches have a result) or failed
        them: they leave the running set; returns their answers."""
        answers = [Answer(request) for request in ended]
        answers += [Answer(request, error) for request, error in failed]
        running = self._running[lane]
        kept = [answer for answer in answers if answer.request in running]
        for answer in kept:
            self._leave(lane, answer.request)
        return kept

    def fail_lane(self, lane: int, error: BaseException) -> list[Answer[R]]:
        """Every running request of the lane answered with `error` (its batch is lost)."""
        answers = [Answer(request, error) for request in self._running[lane]]
        for answer in answers:
            self._leave(lane, answer.request)
        return answers

    def drain(self, error: BaseException) -> tuple[list[Answer[R]], list[J]]:
        """Every waiting request answered with `error`, and the encoder jobs not taken."""
        waiting, self._waiting = self._waiting, []
        encodes, self._encodes = self._encodes, []
        for request in waiting:
            self._forget(request)
        return [Answer(request, error) for request in waiting], encodes

    # -- admission -------------------------------------------------------------------

    def _admit(self, lane: int) -> list[R]:
        """Waiting requests this lane starts now: finals and offline calls first, then by
        arrival, as many rows as there is room for (at least one request when the lane is
        empty) and as many prefill positions as one turn takes (at least one request).
        The first one taken sets the prefill's length; a later one joins only if it adds
        at most `PREFILL_PADDING` padding positions, else it waits for another call.
        A lane with more rows than another leaves the waiting requests to that one, so
        the lanes' batches stay even."""
        mine = self.rows(lane)
        if mine > min(self.rows(other) for other in range(self.lanes)) + 1:
            return []
        room = self.max_rows - mine
        self._waiting.sort(key=lambda r: r.priority)  # stable: by arrival within a priority
        chosen: list[R] = []
        left: list[R] = []
        rows = positions = longest = 0
        for index, request in enumerate(self._waiting):
            width = request.width
            if rows + width > room and (chosen or room < self.max_rows):
                left.extend(self._waiting[index:])
                break
            if self.kv is not None and not self.kv.fits(rows + width):
                left.extend(self._waiting[index:])
                break  # the pool is full: it waits for a slot, in its turn
            if chosen and positions + request.positions > self.prefill_positions:
                left.extend(self._waiting[index:])
                break  # the rest: the other lane, or this one's next turn
            length = request.positions // width  # its rows' own length
            padding = (length - longest) * rows if length > longest else (longest - length) * width
            if chosen and padding > PREFILL_PADDING:
                left.append(request)
                continue
            chosen.append(request)
            rows += width
            positions += request.positions
            longest = max(longest, length)
        self._waiting = left
        return chosen

    # -- bookkeeping -----------------------------------------------------------------

    def _is_running(self, request: R) -> bool:
        return any(request in running for running in self._running)

    def _give_back(self, request: R) -> None:
        if self.kv is not None:
            self.kv.release(request)

    def _leave(self, lane: int, request: R) -> None:
        self._give_back(request)
        del self._running[lane][request]
        self._joining[lane].discard(request)
        self._aborted_rows.discard(request)
        self._forget(request)

    def _forget(self, request: R) -> None:
        """Take an answered request out of `_live` (`abort` took it out already if its
        id was aborted)."""
        if request.request_id is None:
            return
        live = self._live.get(request.request_id)
        if live is not None and request in live:
            live.remove(request)
            if not live:
                del self._live[request.request_id]
