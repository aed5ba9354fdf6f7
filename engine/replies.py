"""What a reader of translations receives, apart from who made them: the engine's
subscriptions and the WebSocket client (`engine.remote`) both queue replies this way, so
this module needs nothing beyond the protocol (a client imports it without the model)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TypeAlias

import anyio

from protocol import ErrorMessage, TranslationUpdate

log = logging.getLogger(__name__)

Reply: TypeAlias = TranslationUpdate | ErrorMessage
"""What a subscription yields: updates, and an `error` (code `internal`) in place of the
final update of a final transcript whose translation failed."""

RECENT_FINALS = 8
"""Final updates of a stream kept per language for viewers who join late (the page shows
a few lines)."""


_asyncio_event: type[anyio.Event] | None = None


def new_event() -> anyio.Event:
    """`anyio.Event()` made cheaply on asyncio: anyio finds the running library at every
    event it makes (`current_async_library`), which was 7% of a loaded server's event loop
    for the events made per message (a queue's wait, a stream's wake); on asyncio this
    makes its event class directly, elsewhere it asks anyio."""
    global _asyncio_event
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # another library's loop (trio)
        return anyio.Event()
    if _asyncio_event is None:
        _asyncio_event = type(anyio.Event())
    return _asyncio_event()


class Wake:
    """A wake-up for one waiting task: set by whoever gives it work (a stream's runner
    its admitted events, a close, an abort; a queue's consumer its replies), awaited by
    that task alone, and cleared as it wakes, so one wake-up serves however many sets
    came before it. On asyncio the task parks on a bare future of the loop, made only
    when it parks, where an `anyio.Event` made for every wake-up waited inside asyncio's
    own event; on another loop, on an anyio event."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | anyio.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        waiter, self._waiter = self._waiter, None
        if waiter is None:
            return
        if isinstance(waiter, asyncio.Future):
            if not waiter.done():  # else its task was cancelled while parked
                waiter.set_result(None)
        else:
            waiter.set()

    async def wait(self) -> None:
        """Until set (at once if it is), then clear it."""
        if not self._set:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # another library's loop (trio)
                event = self._waiter = anyio.Event()
                await event.wait()
            else:
                waiter = self._waiter = loop.create_future()
                try:
                    await waiter
                finally:
                    if self._waiter is waiter:  # cancelled while parked
                        self._waiter = None
        self._set = False


class ReplyQueue(AsyncIterator[Reply]):
    """A bounded queue of replies for one consumer, iterated with `async for`.

    When it is full, the oldest non-final update is dropped (a newer one supersedes it);
    finals and errors (which answer finals) are never dropped, so a slow consumer cannot
    stall translation for others and every final transcript still gets its reply.

    A consumer that never waits (a server connection's outbox) may `attach` instead of
    iterating: each reply is then handed to it as it is put, sparing a task and its
    wake-up per reply.
    """

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self.dropped = 0
        self._items: deque[Reply] = deque()
        self._ready = Wake()
        self._ended = False
        self._deliver: Callable[[Reply], None] | None = None
        self._on_end: Callable[[], None] | None = None

    def attach(self, deliver: Callable[[Reply], None], on_end: Callable[[], None]) -> None:
        """Hand every reply to `deliver` from now on, those queued first, instead of
        queuing it; `on_end` is called once when the queue ends (at once if it has).
        `deliver` runs in the task that puts the reply, so it must not block; what it
        raises is logged and the reply lost to this consumer alone (the publisher and
        the other consumers carry on). An attached queue is not iterated."""
        self._deliver = deliver
        while self._items:
            self._hand(self._items.popleft())
        self._on_end = on_end
        if self._ended:
            self._call_on_end()

    def put(self, reply: Reply) -> None:
        """Queue `reply` (nothing once ended), or hand it to the attached consumer."""
        if self._ended:
            return
        if self._deliver is not None:
            self._hand(reply)
            return
        if len(self._items) >= self.max_items:
            for i, old in enumerate(self._items):
                if isinstance(old, TranslationUpdate) and not old.is_final:
                    del self._items[i]
                    self.dropped += 1
                    break
        self._items.append(reply)
        self._ready.set()

    def end(self) -> None:
        """Take nothing more: iteration yields what is queued, then stops."""
        self._ended = True
        self._ready.set()
        self._call_on_end()

    def _hand(self, reply: Reply) -> None:
        assert self._deliver is not None
        try:
            self._deliver(reply)
        except Exception:
            log.exception("a reply's consumer failed; the reply is lost to it")

    def _call_on_end(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()

    @property
    def ended(self) -> bool:
        return self._ended

    def __len__(self) -> int:
        return len(self._items)

    def __aiter__(self) -> ReplyQueue:
        return self

    async def __anext__(self) -> Reply:
        while not self._items:
            if self._ended:
                raise StopAsyncIteration
            await self._ready.wait()
        return self._items.popleft()
