"""A session's decodes awaited on the event loop, and the slots that bound them.

The decode scheduler's lanes resolve `concurrent.futures.Future`s on their own threads.
Waiting for them from a worker thread per update (as `StreamSession.answer` does) costs two
thread hops per update: the loop wakes a worker, the worker wakes the loop. Here the
session's generator (`StreamSession.steps`) runs on the event loop, its decodes are
submitted from there, and a lane resolving them wakes the loop directly, once for all the
futures it resolves meanwhile (`_Inbox`, through an eventfd of its own where it can): no
thread waits, and no anyio task, cancel scope or limiter is made per update.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import weakref
from collections import deque
from concurrent.futures import Future
from types import TracebackType

import anyio

from engine.decoding.policy import Priority, RequestId
from engine.decoding.search import Hypothesis
from engine.streaming.session import StreamSession
from protocol import PartialTranscript, TranslationUpdate


class Slots:
    """A counter of slots taken in turn (first come, first served), for `async with`: it
    waits only when none is free, so taking a free one costs no checkpoint (anyio's
    `CapacityLimiter` yields to the loop and looks up the current task on every
    acquire)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("at least one slot is needed")
        self.total = total
        self.free = total
        self._waiting: deque[anyio.Event] = deque()

    async def __aenter__(self) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        turn = anyio.Event()
        self._waiting.append(turn)
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():  # handed a slot meanwhile: pass it on
                self._release()
            else:
                self._waiting.remove(turn)
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release()

    def _release(self) -> None:
        if self._waiting:
            self._waiting.popleft().set()  # the slot goes to the first waiting
        else:
            self.free += 1


async def hypotheses(futures: list[Future[Hypothesis]]) -> list[Hypothesis]:
    """The futures' results (or the first one's error, e.g. `DecodingCancelled`),
    awaited on the running loop: one wake-up of the awaiting task once all are done,
    not one per future. A caller cancelled meanwhile leaves them to the scheduler, which
    answers them to no one."""
    pending = [future for future in futures if not future.done()]
    if pending:
        await _resolved(pending)
    return [future.result() for future in futures]


async def _resolved(futures: list[Future[Hypothesis]]) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # another event loop than asyncio's: a worker thread waits
        await anyio.to_thread.run_sync(concurrent.futures.wait, futures)
        return
    inbox = _inboxes.get(loop)
    if inbox is None:
        inbox = _inboxes[loop] = _Inbox(loop)
    waiter: asyncio.Future[None] = loop.create_future()
    put = inbox.put
    if len(futures) == 1:
        futures[0].add_done_callback(lambda _: put(waiter))
    else:  # the last one done wakes it (two lanes may both see all done: put twice)

        def done(_: object) -> None:
            if all(future.done() for future in futures):
                put(waiter)

        for future in futures:
            future.add_done_callback(done)
    await waiter


class _Inbox:
    """Waiters to wake on one loop, put from the lanes' threads.

    The loop is woken once per batch of them rather than once per future, as a lane
    answers its turn's rows one after the other (hundreds per step on a GPU): only the
    put that finds the inbox empty wakes it. Where the loop can watch a file descriptor
    (asyncio's selector loops, uvloop) and the OS has an `eventfd`, the wake-up is a write
    to an eventfd of the inbox's own, which the loop watches with a reader that drains
    the inbox: one read on the loop per wake-up, where `call_soon_threadsafe` costs a
    handle, the self-pipe's reads until it is empty (two system calls and an exception)
    and then the drain's own turn. Elsewhere it calls `call_soon_threadsafe`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._lock = threading.Lock()
        self._waiters: list[asyncio.Future[None]] = []
        self._fd = -1  # the eventfd the loop watches; -1: none, `call_soon_threadsafe`
        # Weak: the inbox is the value of a dictionary weakly keyed by the loop.
        self._loop = weakref.ref(loop)
        eventfd = getattr(os, "eventfd", None)
        if eventfd is not None:
            fd = eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            try:
                loop.add_reader(fd, self._read)
            except (NotImplementedError, RuntimeError):  # a loop that watches no fds
                os.close(fd)
            else:
                self._fd = fd
                weakref.finalize(loop, self._close)

    def put(self, waiter: asyncio.Future[None]) -> None:  # any thread
        with self._lock:
            self._waiters.append(waiter)
            if len(self._waiters) > 1:  # the loop is to drain them already
                return
            if self._fd >= 0:  # under the lock: never a write to a number closed meanwhile
                os.eventfd_write(self._fd, 1)
                return
        self._wake_by_callback()

    def _close(self) -> None:  # the loop is gone
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _wake_by_callback(self) -> None:
        loop = self._loop()
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: no one waits any more
                loop.call_soon_threadsafe(self._drain)

    def _read(self) -> None:  # on the loop: the eventfd is readable
        # Read before draining: a put after the drain's swap finds the inbox empty and
        # writes again; one before it is in the swap.
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._fd)
        self._drain()

    def _drain(self) -> None:  # on the loop
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():  # not cancelled meanwhile
                waiter.set_result(None)


_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox] = weakref.WeakKeyDictionary()


async def answer(
    session: StreamSession,
    event: PartialTranscript,
    *,
    request_id: RequestId | None,
    priority: Priority,
    received: float,
    source: str,
    source_ids: list[int] | None,
) -> TranslationUpdate | None:
    """`StreamSession.answer` on the event loop: its decodes submitted to the
    scheduler and awaited; an error of one (`DecodingCancelled`, a failing model) is
    raised inside the session where it asked for it, as a blocking decode would."""
    steps = session.steps(
        event,
        request_id=request_id,
        priority=priority,
        received=received,
        source=source,
        source_ids=source_ids,
    )
    try:
        call = next(steps)
        while True:
            try:
                found = await hypotheses(call.submit(session.translator))
            except Exception as exc:
                call = steps.throw(exc)
            else:
                call = steps.send(found)
    except StopIteration as done:
        update: TranslationUpdate | None = done.value
        return update
