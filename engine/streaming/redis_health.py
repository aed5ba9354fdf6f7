"""Whether a node's Redis works, as the bus's loops find it, and what it says when it does
not. Two faults, told apart because an operator fixes them differently: Redis cannot be
reached (the network, a restart), or it answers but refuses writes (out of memory under
`maxmemory` with `noeviction`, or another error). Either makes the node not ready
(`/readyz` 503) until a write goes through again; each refused write and each reply lost
with it is counted, and logged in one summary per interval rather than once per reply,
so a failing Redis cannot flood the log and nothing is lost without a line."""

from __future__ import annotations

import logging
import time
from collections import Counter

import anyio

log = logging.getLogger("engine.streaming.redis_bus")

LOG_EVERY = 10.0
"""Seconds between two summaries of refused writes and lost replies."""

BACKOFF = (0.1, 2.0)
"""Seconds between a loop's tries while Redis fails: first, and at most (doubling)."""

UNREACHABLE = "the update bus (Redis) is unreachable"
OUT_OF_MEMORY = "the update bus (Redis) is out of memory"


def out_of_memory(exc: BaseException) -> bool:
    from redis.exceptions import OutOfMemoryError

    return isinstance(exc, OutOfMemoryError) or str(exc).startswith("OOM ")


def refusal(exc: BaseException) -> bool:
    """Whether Redis answered with an error (it is reachable, it refused), not a
    connection that failed."""
    from redis.exceptions import ResponseError

    return isinstance(exc, ResponseError)


def describe(exc: BaseException) -> str:
    """What a writer and the log are told about a failed Redis call."""
    if out_of_memory(exc):
        return OUT_OF_MEMORY
    if refusal(exc):
        return f"the update bus (Redis) refused the write ({str(exc).splitlines()[0][:120]})"
    return UNREACHABLE


class Health:
    """The bus's view of its Redis: `reachable` (its loops' calls go through) and
    `refusing` (why writes are refused, until one is taken again). `stats`: the bus's
    counters, which this adds to (`redis_errors`, `redis_reconnects`, `redis_oom`,
    `redis_refused`)."""

    def __init__(self, stats: Counter[str], log_every: float = LOG_EVERY) -> None:
        self.stats = stats
        self.log_every = log_every
        self.reachable = False
        self.refusing: str | None = None
        self.closing = False  # the bus is closing: its failures are its own doing
        self._lost: Counter[tuple[str, str]] = Counter()  # (why, kind): since the summary
        self._logged = 0.0

    @property
    def ok(self) -> bool:
        return self.reachable and self.refusing is None and not self.closing

    def failed(self, what: str, exc: BaseException) -> str:
        """A call failed: a refusal (`write_refused`) or a lost connection. Returns what
        to tell a writer."""
        if refusal(exc):
            self.write_refused(what, exc)
            return describe(exc)
        if self.reachable:
            log.warning("Redis bus: %s failed (%s); retrying", what, exc)
            self.stats["redis_errors"] += 1
        self.reachable = False
        return UNREACHABLE

    async def back_off(self, what: str, exc: BaseException, delay: float) -> float:
        """A loop's call failed: say so (`failed`), wait `delay` seconds, and return how
        long to wait after the next failure."""
        self.failed(what, exc)
        await anyio.sleep(delay)
        return min(delay * 2, BACKOFF[1])

    def succeeded(self) -> None:
        """A call went through: Redis is reachable (again)."""
        if not self.reachable and not self.closing:
            log.info("Redis bus: reachable again")
            self.stats["redis_reconnects"] += 1
        self.reachable = True

    def write_refused(self, what: str, exc: BaseException) -> None:
        """Redis answered a write with an error: counted, and the node is not ready until
        a write is taken again."""
        self.reachable = True
        kind = "redis_oom" if out_of_memory(exc) else "redis_refused"
        self.stats[kind] += 1
        why = describe(exc)
        if self.refusing is None:
            self.refusing = why
            log.error("Redis bus: %s refused: %s (%s)", what, why, exc)
        self.refusing = why

    def wrote(self) -> None:
        """A write was taken: Redis takes writes again."""
        if self.refusing is not None:
            self.flush(force=True)
            log.info("Redis bus: writes are taken again")
        self.refusing = None

    def lost(self, kind: str, why: str) -> None:
        """A reply lost with a failed write (`kind`: `finals_refused`, `updates_dropped`,
        `close_marks_lost`; `why`: what failed): counted at once, logged in the next
        summary."""
        self.stats[kind] += 1
        self._lost[why, kind] += 1
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Log what was lost since the last summary, at most once per `log_every`
        seconds (`force`: now)."""
        if not self._lost:
            return
        now = time.monotonic()
        if not force and now - self._logged < self.log_every:
            return
        counts = "; ".join(f"{why}: {kind} {n}" for (why, kind), n in sorted(self._lost.items()))
        log.warning("Redis bus: replies not published: %s", counts)
        self._lost.clear()
        self._logged = now
