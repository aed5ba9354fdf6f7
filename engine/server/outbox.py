"""One connection's bounded queue of outgoing messages, read by its single sender task.

Every subscription of a connection (its own streams, or the streams it views) is drained
at once into this outbox, so the engine never waits on a socket: only the sender awaits
`send`, and when a client reads too slowly the outbox sheds what matters least.
"""

from __future__ import annotations

from collections import deque
from typing import TypeAlias

from engine.replies import new_event
from protocol import ErrorMessage, TranslationUpdate

Outgoing: TypeAlias = TranslationUpdate | ErrorMessage


class Outbox:
    """Updates and error replies waiting to be sent, in arrival order.

    Bounds: at most `max_updates` updates, shedding first a non-final update that a newer
    queued update of the same segment and language supersedes, else the oldest non-final one; finals
    are never shed (the engine bounds how many can be pending). At most `max_errors`
    error replies: a client that floods without reading loses the surplus errors, except
    replies about finals (`keep`), which are never shed: up to `max_kept_errors` of them
    wait, and past that `put_error` says so and the connection is to be closed (a client
    that sends finals and reads nothing cannot be answered).
    """

    def __init__(
        self, max_updates: int = 256, max_errors: int = 32, max_kept_errors: int = 1024
    ) -> None:
        if max_updates < 1 or max_errors < 1 or max_kept_errors < 1:
            raise ValueError("max_updates, max_errors and max_kept_errors must be >= 1")
        self.max_updates = max_updates
        self.max_errors = max_errors
        self.max_kept_errors = max_kept_errors
        self._kept = 0
        self.dropped_updates = 0
        self.dropped_errors = 0
        self._items: deque[Outgoing] = deque()
        self._kept_flags: deque[bool] = deque()  # per item: a reply about a final
        self._updates = 0
        self._errors = 0
        self._ready = new_event()
        self._ended = False
        self._poked = False

    def __len__(self) -> int:
        return len(self._items)

    @property
    def ended(self) -> bool:
        return self._ended

    def put_update(self, update: TranslationUpdate) -> None:
        if self._ended:
            return
        if self._updates >= self.max_updates and self._shed_update():
            self.dropped_updates += 1
        self._items.append(update)
        self._kept_flags.append(False)
        self._updates += 1
        self._ready.set()

    def put_error(self, error: ErrorMessage, *, keep: bool = False) -> bool:
        """Queue an error reply; False when it was dropped (too many pending). `keep`: a
        reply about a final, dropped only past `max_kept_errors`."""
        if self._ended:
            return False
        if keep:
            if self._kept >= self.max_kept_errors:
                self.dropped_errors += 1
                return False
            self._kept += 1
        elif self._errors - self._kept >= self.max_errors:
            self.dropped_errors += 1
            return False
        self._items.append(error)
        self._kept_flags.append(keep)
        self._errors += 1
        self._ready.set()
        return True

    def end(self) -> None:
        """No more items: `get` returns what is queued, then None."""
        self._ended = True
        self._ready.set()

    async def get(self) -> Outgoing | None:
        """The next item to send, waiting for one; None once ended and empty."""
        while (item := self.take()) is None:
            if self._ended:
                return None
            await self.ready()
        return item

    def take(self) -> Outgoing | None:
        """The next item to send, or None when none is queued (no wait)."""
        if not self._items:
            return None
        item = self._items.popleft()
        if self._kept_flags.popleft():
            self._kept -= 1
        if isinstance(item, ErrorMessage):
            self._errors -= 1
        else:
            self._updates -= 1
        return item

    async def ready(self) -> None:
        """Wait until an item is queued, the outbox ends, or `poke` is called (the sender
        has something else to send first); returns at once if one of them happened since
        the last wait. Takes nothing, so a sender woken by `poke` loses nothing."""
        if not (self._items or self._ended or self._poked):
            self._ready = new_event()
            await self._ready.wait()
        self._poked = False

    def poke(self) -> None:
        """Wake the sender waiting in `ready` without an item: a message kept apart from
        the outbox (an echo) is to be sent first. Unlike cancelling its wait, this makes
        no cancel scope per message sent."""
        self._poked = True
        self._ready.set()

    def _shed_update(self) -> bool:
        oldest: int | None = None
        # A segment's update supersedes older ones of the same segment in its language
        # only: with fan-out, a newer zh update says nothing about the de line.
        newer: set[tuple[str, int, str | None]] = set()
        victim: int | None = None
        # Walk newest to oldest: the last hit is the oldest superseded non-final.
        for i in range(len(self._items) - 1, -1, -1):
            item = self._items[i]
            if not isinstance(item, TranslationUpdate):
                continue
            if not item.is_final:
                oldest = i
                if (item.stream_id, item.segment_id, item.lang) in newer:
                    victim = i
            newer.add((item.stream_id, item.segment_id, item.lang))
        index = victim if victim is not None else oldest
        if index is None:
            return False
        del self._items[index]
        del self._kept_flags[index]
        self._updates -= 1
        return True
