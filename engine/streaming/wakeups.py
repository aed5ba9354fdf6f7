"""An event loop that, under load, wakes at most every few milliseconds.

A busy server's loop wakes for nearly every message and every decode answer, one at a
time: each wake-up pays the selector call, and on a machine whose cores also run the
decode lanes (and, in a VM, other tenants) each runs with cold caches, so a message costs
several times its work done back to back (docs/performance.md, "The loop's wake-ups
coalesced"). A network card's interrupt moderation and Linux's timer slack trade the same
way: what arrives within the interval is handled together, in one poll, and the decode
lanes receive the messages of that poll together, so their model calls fill too.

The decision is `WakeCoalescing`'s alone (pure, given the time), like the batch delay's
in `engine.decoding.policy`: the loop waits before polling only while it is busy, i.e.
while its recent blocking waits were shorter than the interval on average (an exponential
mean over eight), so a lone stream, or a silence, is served at once. A wait never
exceeds the interval from the previous wake-up, so the latency it adds to a message, or
to a timer, is at most the interval.

Use it by giving the loop factory to the runner: `anyio.run(main, backend_options=
{"loop_factory": coalescing_loop(0.005)})` or `asyncio.Runner(loop_factory=...)`.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable

#: Weight of the newest blocking wait in the busy estimate (an exponential mean over eight).
WEIGHT = 1 / 8


class WakeCoalescing:
    """When the loop may poll next: a pure decision over the times it is told."""

    def __init__(self, interval: float) -> None:
        if interval < 0:
            raise ValueError("the coalescing interval cannot be negative")
        self.interval = interval
        self.woke_at = float("-inf")
        # The mean blocking wait; it starts "quiet", so the first events go through at once.
        self.mean_wait = float("inf")

    def delay(self, now: float) -> float:
        """How long to sleep before polling: the rest of the interval since the last
        wake-up while the loop is busy, else none."""
        if self.mean_wait >= self.interval:
            return 0.0
        return max(0.0, self.woke_at + self.interval - now)

    def woke(self, now: float, waited: float) -> None:
        """The loop woke at `now` after blocking `waited` seconds in the poll itself (not
        counting the coalescing sleep: events found waiting after it mean a busy loop)."""
        self.woke_at = now
        if self.mean_wait == float("inf"):
            self.mean_wait = waited
        else:
            self.mean_wait += WEIGHT * (waited - self.mean_wait)


class CoalescingSelector(selectors.DefaultSelector):
    """The platform's default selector, polled through `WakeCoalescing`: while the loop
    is busy, a poll that would block first sleeps out the rest of the interval, then
    takes whatever is ready in one go. A poll that must not block (the loop has work
    ready) never waits."""

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
            return super().select(timeout)
        policy = self.coalescing
        now = self._clock()
        pause = policy.delay(now)
        if pause > 0:
            # A timer due sooner waits too, by less than the interval (timer slack).
            self._sleep(pause)
            ready = super().select(0)
            now = self._clock()
            if ready or (timeout is not None and timeout <= pause):
                # Events found waiting: the loop is busy. A timer's turn: it would have
                # blocked until then.
                policy.woke(now, 0.0 if ready else timeout or 0.0)
                return ready
            if timeout is not None:
                timeout -= pause
        ready = super().select(timeout)
        after = self._clock()
        policy.woke(after, after - now)
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
