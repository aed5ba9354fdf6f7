"""The reading side of the Redis bus: a node's local viewers, fed from the histories they
watch.

Two tasks, so that a crowd joining never holds up the viewers already watching:

- **The read loop** reads, with one blocking `XREAD` on a connection of its own, every
  key this node's viewers watch, each once whatever the number of viewers, and hands
  what it reads to the hub. It does nothing else.
- **The join loop** starts new viewers: it reads each one's history (once per key for
  every viewer that joins in the same turn), catches up with what the read loop has read
  of that key meanwhile, and only then, with no wait in between, hands the viewer to the
  hub, which replays it its history and from then on delivers it what the read loop
  reads: nothing is missed or doubled between the two (a subscription skips by cursor
  what it had). It yields between viewers, so live entries are delivered in between.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from engine.streaming.fanout import Hub
from engine.streaming.history import Entry, position
from engine.streaming.redis_health import BACKOFF, Health
from engine.streaming.redis_store import Keys, Watch, entry_of, redis_errors
from engine.streaming.subscriptions import Subscription

BLOCK_MS = 5000
"""How long one blocking read waits before it looks again (a new key wakes it at once)."""

JOINS_PER_TURN = 64
"""Viewers the join loop starts per turn (it yields between viewers, and between turns)."""

PAGE = 64
"""History entries read and parsed at a time: redis-py parses a reply in Python and each
entry's update is JSON, so a whole history (512 entries) held the event loop for tens of
milliseconds; read a page at a time, a history read yields between pages, and a live
update waits behind one page at most, not behind a joiner's whole history."""

READ_ENTRIES = 16384
"""History entries (32 full histories) a burst of joins keeps to share among its viewers:
one read per key, however many viewers join it. Dropped when the burst ends or holds
more, so a burst over many streams does not keep a heap of parsed entries that the
garbage collector then walks (its pauses, too, hold live updates)."""


class RedisViewers:
    """The viewers of one node: `watch` queues a viewer the hub made; `run` is the two
    loops. `read_seconds`: how long entries were in Redis before this node read them."""

    def __init__(
        self,
        hub: Hub,
        keys: Keys,
        history_size: int,
        health: Health,
        read_seconds: deque[float],
    ) -> None:
        self.hub = hub
        self.keys = keys
        self.history_size = history_size
        self.health = health
        self.read_seconds = read_seconds
        self.languages: list[str] = []
        self._redis: Any = None  # commands (history reads, unblocking the reader)
        self._reader: Any = None  # the one connection that blocks in XREAD
        self._reader_id: int | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._watches: dict[str, Watch] = {}  # history key -> watch
        self._joining: deque[tuple[Subscription, str | None]] = deque()
        self._has_join = anyio.Event()
        self._has_watch = anyio.Event()
        self._reading = False

    async def run(self, redis: Any, reader: Any, group: anyio.abc.TaskGroup) -> None:
        """Run the read and join loops in `group` (`reader`: a single-connection client)."""
        self._redis, self._reader, self._group = redis, reader, group
        group.start_soon(self._read_loop)
        group.start_soon(self._join_loop)

    def watch(self, sub: Subscription, after: str | None = None) -> None:
        """Start a viewer of one stream: its history (or what came after `after`), then
        what is read live."""
        self._joining.append((sub, after))
        self._has_join.set()

    async def entries(self, stream_id: str, lang: str, after: str | None = None) -> list[Entry]:
        """A history from Redis, oldest first (all that is kept, or what follows `after`),
        read in pages of `PAGE` entries, each parsed before the next is asked for: other
        tasks (the live reads) run between pages. What is appended meanwhile is newer
        than the first page read, so the result is the history as of that read (a
        caller catches up from its last cursor)."""
        key = self.keys.history(stream_id, lang)
        entries: list[Entry] = []
        start, end = (f"({after}", "+") if after is not None else ("-", "+")
        while len(entries) < self.history_size:
            count = min(PAGE, self.history_size - len(entries))
            if after is None:  # newest first, back to the oldest kept
                raw = await self._redis.xrevrange(key, end, start, count=count)
            else:
                raw = await self._redis.xrange(key, start, end, count=count)
            entries.extend(entry_of(entry_id, fields) for entry_id, fields in raw)
            if len(raw) < count:
                break
            if after is None:
                end = f"({raw[-1][0]}"
            else:
                start = f"({raw[-1][0]}"
            await anyio.lowlevel.checkpoint()
        if after is None:
            entries.reverse()
        return entries

    # -- joining --------------------------------------------------------------------------

    async def _join_loop(self) -> None:
        delay = BACKOFF[0]
        read: dict[str, list[Entry]] = {}  # this burst's history reads, by key
        while True:
            if not self._joining or sum(map(len, read.values())) > READ_ENTRIES:
                read = {}
            if not self._joining:
                self._has_join = anyio.Event()
                await self._has_join.wait()
            try:
                for _ in range(min(len(self._joining), JOINS_PER_TURN)):
                    sub, after = self._joining[0]
                    if not sub.ended:
                        await self._join(sub, after, read)
                    self._joining.popleft()
                    await anyio.lowlevel.checkpoint()  # the read loop's deliveries first
            except redis_errors() as exc:
                delay = await self.health.back_off("reading a history", exc, delay)
                continue
            delay = BACKOFF[0]

    async def _join(
        self, sub: Subscription, after: str | None, read: dict[str, list[Entry]]
    ) -> None:
        assert sub.stream_id is not None
        sid = sub.stream_id
        langs = [sub.lang] if sub.lang is not None else list(self.languages)
        keys = {lang: self.keys.history(sid, lang) for lang in langs}
        for lang, key in keys.items():
            if key not in read:
                read[key] = await self.entries(sid, lang)
        # The read loop may have read further since (a history read for an earlier viewer
        # too): what it handed out before this viewer is the hub's comes from Redis here
        # (no wait after the last check). A key nobody reads yet is read from the end
        # of what was read here, so nothing appended since is missed either.
        while behind := [lang for lang, key in keys.items() if self._behind(key, read[key])]:
            for lang in behind:
                have = read[keys[lang]]
                read[keys[lang]] = have + await self.entries(sid, lang, have[-1].cursor)
        new_key = False
        for lang, key in keys.items():
            if key not in self._watches:
                entries = read[key]
                self._watches[key] = Watch(sid, lang, entries[-1].cursor if entries else "0-0")
                new_key = True
        histories: list[tuple[str, Sequence[Entry]]] = [(lang, read[keys[lang]]) for lang in langs]
        if self.hub.join(sub, histories, after):
            self.health.stats["resume_gaps"] += 1
        if new_key:
            self._wake_reader()

    def _behind(self, key: str, entries: list[Entry]) -> bool:
        """Whether the read loop has read `key` past the end of `entries`."""
        watch = self._watches.get(key)
        if watch is None:
            return False
        head = entries[-1].cursor if entries else "0-0"
        return position(watch.last) > position(head)

    # -- reading --------------------------------------------------------------------------

    def _wake_reader(self) -> None:
        self._has_watch.set()
        if self._reading and self._reader_id is not None and self._group is not None:
            self._group.start_soon(self._unblock)

    async def _unblock(self) -> None:
        try:
            await self._redis.client_unblock(self._reader_id)
        except redis_errors():
            pass  # the read ends by itself within BLOCK_MS

    def _reads(self) -> dict[str, str]:
        """The keys this node's viewers watch, each with the id read up to; keys no
        viewer watches any more are forgotten."""
        keys = {
            self.keys.history(sid, lang)
            for sid, langs in self.hub.watched().items()
            for lang in (self.languages if None in langs else langs)
            if lang is not None
        }
        self._watches = {key: w for key, w in self._watches.items() if key in keys}
        return {key: watch.last for key, watch in self._watches.items()}

    async def _read_loop(self) -> None:
        delay = BACKOFF[0]
        while True:
            try:
                if self._reader_id is None:
                    self._reader_id = int(await self._reader.client_id())
                streams = self._reads()
                if not streams:
                    self._has_watch = anyio.Event()
                    await self._has_watch.wait()
                    continue
                self._reading = True
                try:
                    got = await self._reader.xread(streams, count=512, block=BLOCK_MS)
                finally:
                    self._reading = False
            except redis_errors() as exc:
                self._reader_id = None
                delay = await self.health.back_off("reading histories", exc, delay)
                continue
            delay = BACKOFF[0]
            self.health.succeeded()
            self._deliver(got)

    def _deliver(self, got: Any) -> None:
        items = got.items() if isinstance(got, dict) else (got or [])
        now_ms = time.time() * 1000
        for key, raw in items:
            watch = self._watches.get(key)
            if watch is None:
                continue
            for entry_id, fields in raw:
                watch.last = entry_id
                entry = entry_of(entry_id, fields)
                self.health.stats["entries_read"] += 1
                self.read_seconds.append(max(0.0, now_ms - entry.at[0]) / 1000)
                self.hub.deliver(watch.stream_id, watch.lang, entry)
