"""An event loop that, under load, wakes at most every few milliseconds.

A busy server's loop wakes for nearly every message and every decode answer, one at a
time: each wake-up pays the selector call, and on a machine whose cores also run the
decode lanes (and, in a VM, other tenants) each runs with cold caches, so a message costs
several times its work done back to back (docs/performance.md, "The loop's wake-ups
coalesced"). A network card's interrupt moderation and Linux's timer slack trade the same
way: what arrives within the interval is handled together, in one poll, and the decode
lanes receive the messages of that poll together, so their model calls fill too.

The decision is `WakeCoalescing`'s alone (pure, given the polls it is told of), like the
batch delay's in `engine.decoding.policy`: the loop waits before polling only while the
recent rate of events (ready descriptors over the last eight wake-ups' time) says that an
interval brings two or more, so that a pause gathers something, and while the loop works
less than half its time; a lone stream, a few streams whose messages come further apart,
a silence, or a loop near its limit, are served at once. A wake-up is a poll that may
block; the loop's polls between callbacks (it has work ready) are never held. A wait
never exceeds the interval from the previous wake-up, so the latency it adds to a message,
or to a timer, is at most the interval, and a loop whose work after a wake-up outlasts
the interval never waits.

Use it by giving the loop factory to the runner: `anyio.run(main, backend_options=
{"loop_factory": coalescing_loop(0.005)})` or `asyncio.Runner(loop_factory=...)`.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable

#: Weight of the newest wake-up in the estimates (exponential means over eight).
WEIGHT = 1 / 8
#: Events an interval must be expected to bring for a pause to pay: the one that would
#: wake the loop anyway and at least one more to share its wake-up.
GATHER = 2.0
#: The share of its time the loop may spend working (not waiting) and still pause: past
#: it the loop is near its limit, and a pause would waste its capacity while events wait.
SPARE = 0.5
#: The longest time between two wake-ups the estimates take, in intervals.
SILENCE = 10.0


class WakeCoalescing:
    """When the loop may wake next: a pure decision over the wake-ups it is told of."""

    def __init__(self, interval: float) -> None:
        if interval < 0:
            raise ValueError("the coalescing interval cannot be negative")
        self.interval = interval
        self.woke_at: float | None = None
        self.work = 0.0  # since the last wake-up, until the loop came to wait again
        # The recent wake-ups' mean events, time apart and work between them: events
        # over time is the rate of events (the same whether the loop paused before
        # polling or not), work over time the loop's load. No two wake-ups yet: the
        # first events go through at once.
        self.mean_events = 0.0
        self.mean_work = 0.0
        self.mean_span: float | None = None

    def gathering(self) -> bool:
        """Whether a pause pays: an interval is expected to bring `GATHER` events or
        more, and the loop has spare time (`SPARE`) to wait in."""
        span = self.mean_span
        if span is None or self.interval <= 0:
            return False
        return self.mean_events * self.interval >= GATHER * span and self.mean_work < SPARE * span

    def polling(self, now: float) -> float:
        """The loop comes to wait for events at `now` (its work since the last wake-up
        ends): how long to sleep before polling, the rest of the interval since that
        wake-up while gathering pays, else none."""
        if self.woke_at is None:
            return 0.0
        self.work = now - self.woke_at
        if not self.gathering():
            return 0.0
        return max(0.0, self.woke_at + self.interval - now)

    def woke(self, now: float, events: int) -> None:
        """The loop woke at `now` with `events` ready descriptors (none: a timer's turn)."""
        if self.woke_at is not None:
            # A silence counts as ten intervals: enough to end the coalescing at once,
            # not so much that the next burst takes long to start it again.
            span = min(now - self.woke_at, SILENCE * self.interval)
            work = min(self.work, span)
            if self.mean_span is None:
                self.mean_events, self.mean_work, self.mean_span = float(events), work, span
            else:
                self.mean_events += WEIGHT * (events - self.mean_events)
                self.mean_work += WEIGHT * (work - self.mean_work)
                self.mean_span += WEIGHT * (span - self.mean_span)
        self.woke_at = now
        self.work = 0.0


class CoalescingSelector(selectors.DefaultSelector):
    """The platform's default selector, polled through `WakeCoalescing`: while the loop
    is busy, a poll that would block first sleeps out the rest of the interval, then
    takes whatever is ready in one go. A poll that must not block (the loop has callbacks
    ready) is part of the loop's work: never held, not counted."""

    def __init__(
        self,
        interval: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__()
        self.coalescing = WakeCoalescing(interval)
        self._clock = clock
        self._sleep = sleep

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            # The loop has callbacks ready: a poll within its work, not a wake-up.
            return super().select(timeout)
        policy = self.coalescing
        pause = policy.polling(self._clock())
        if pause > 0:
            # A timer due sooner waits too, by less than the interval (timer slack).
            self._sleep(pause)
            if timeout is not None:
                timeout = max(0.0, timeout - pause)
            ready = super().select(0)
            if ready or timeout == 0:
                policy.woke(self._clock(), len(ready))
                return ready
        ready = super().select(timeout)
        policy.woke(self._clock(), len(ready))
        return ready


def coalescing_loop(interval: float) -> Callable[[], asyncio.AbstractEventLoop]:
    """A loop factory for `asyncio.Runner` or anyio's `loop_factory`: a selector event
    loop whose wake-ups are coalesced over `interval` seconds under load (0: the plain
    selector loop, every event at once)."""

    def new_loop() -> asyncio.AbstractEventLoop:
        if interval <= 0:
            return asyncio.SelectorEventLoop()
        return asyncio.SelectorEventLoop(CoalescingSelector(interval))

    return new_loop
