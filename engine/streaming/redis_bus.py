"""The update bus over one Redis shared by identical server nodes (`serve --bus redis://`).

How the nodes share streams, after Centrifugo's and the Socket.IO Redis Streams adapter's
designs (history in Redis Streams, read once per node, fanned out locally) with a lease
and a fencing token for ownership:

- **Ownership.** The node that holds a stream's writer holds its lease
  (`SET lease NX PX`), renewed every third of its term, and a fencing epoch (`INCR`) that
  numbers the stream's life and stamps each of its updates. Every append checks, inside
  Redis and in the same step (a script), that its epoch is still the stream's current
  one: a node that was paused past its lease (GC, SIGSTOP, a partition) and wakes up
  has its late replies refused by Redis itself, so no viewer ever sees them.
- **History.** Each (stream, language) is a Redis Stream (`XADD ... MAXLEN ~`): an entry
  per reply, and a close mark when the writer closes the stream. An entry's id is the
  update's `cursor`. The owner appends; a writer's own replies go back to it only once
  Redis has them, so a reply the writer saw is one every viewer will see.
- **Viewers.** Each node reads, with one blocking `XREAD` on one connection, the keys its
  local viewers watch, each once whatever the number of viewers, and fans out locally.
  A new viewer starts from the history (its backlog, or what came after its `after`
  cursor), in the same task that reads, so nothing is missed or doubled in between.
- **Faults.** Redis unreachable at start: `BusUnavailable` (the server exits 2). Lost
  later: `ready` is False (`/readyz` says so), replies that cannot be appended are not
  dropped silently (a final's becomes an `unavailable` error to its writer, which sends
  it again), and every loop reconnects with backoff and resumes from the ids it had:
  redis-py reconnects a connection, not a blocking read or a lease.

Nothing here knows about sockets or HTTP: the server reads `ready` and `stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
import anyio.abc

import protocol
from engine.streaming.lifecycle import Owner
from engine.streaming.subscriptions import (
    HISTORY,
    BusUnavailable,
    Claim,
    Entry,
    Reply,
    Subscription,
    answered_through,
    backlog_lines,
    by_cursor,
    find_final,
    remove_subscription,
    resume_from,
)
from protocol import ErrorCode, ErrorMessage, InvalidEvent, TranslationUpdate

log = logging.getLogger(__name__)

LEASE_MS = 3000
"""How long a stream stays its node's without a renewal. A node that dies holds its
streams this long at most: the writer, reconnecting elsewhere, waits for it."""

HISTORY_TTL_MS = 6 * 3600 * 1000
"""A (stream, language) history that nobody appends to expires after this."""

BLOCK_MS = 5000
"""How long one blocking read waits before it looks again (a new viewer wakes it at once)."""

BACKOFF = (0.1, 2.0)
"""Seconds between tries while Redis cannot be reached: first, and at most (doubling)."""

SAMPLES = 2048
"""Latency samples kept for the metrics' quantiles."""

_CLAIM = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return {0, redis.call('PTTL', KEYS[1])} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('SET', KEYS[2], ARGV[3]) end
return {1, redis.call('INCR', KEYS[2])}
"""
# The epoch counter starts from the clock (ms) when missing, so that a Redis restarted
# without its data never hands out an epoch that an older life already had.

_APPEND = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
local ids = {}
for i = 2, #KEYS do
  ids[#ids + 1] = redis.call('XADD', KEYS[i], 'MAXLEN', '~', ARGV[2], '*',
                             'k', ARGV[4], 'e', ARGV[1], 'm', ARGV[5])
  redis.call('PEXPIRE', KEYS[i], ARGV[3])
end
return ids
"""
# KEYS[1]: the stream's epoch; the rest: its history keys. An append of an older life
# (a node that lost the stream without knowing it yet) is refused here.

_RENEW = """
local holder = redis.call('GET', KEYS[1])
local current = redis.call('GET', KEYS[2])
if current and current ~= ARGV[3] then return 0 end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
  return 0
end
if not current then redis.call('SET', KEYS[2], ARGV[3]) end
return 1
"""
# A lease that expired while nobody took the stream over (or a Redis restarted without
# its data) is taken back with the same epoch; one that another life holds is lost.

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_KIND_REPLY = "r"
_KIND_CLOSED = "c"


@dataclass
class _Append:
    """One reply (or close mark) waiting to be appended, with whom to tell once it is."""

    stream_id: str
    langs: list[str]
    epoch: int
    kind: str
    payload: str
    reply: Reply | None
    owner: Owner | None
    queued: float


@dataclass
class _Watch:
    """A history key this node reads for its local viewers."""

    stream_id: str
    lang: str
    last: str  # the id read up to
    subs: list[Subscription]


def _redis_errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import RedisError

    return (RedisError, OSError)


class RedisBus:
    """`UpdateBus` shared by the server nodes through one Redis (>= 7).

    `url`: `redis://HOST:PORT/DB`. `lease_ms`: a stream's lease term (renewed every
    third). `prefix`: the keys' namespace, so several services may share one Redis.
    """

    def __init__(
        self,
        url: str,
        *,
        queue_size: int = 256,
        lease_ms: int = LEASE_MS,
        history: int = HISTORY,
        prefix: str = "nmt",
        node: str | None = None,
    ) -> None:
        if lease_ms < 100:
            raise ValueError("lease_ms must be at least 100")
        self.url = url
        self.queue_size = queue_size
        self.lease_ms = lease_ms
        self.history = history
        self.prefix = prefix
        self.node = node or uuid.uuid4().hex[:12]
        self.languages: list[str] = []
        self._stats: Counter[str] = Counter()
        self.publish_seconds: deque[float] = deque(maxlen=SAMPLES)
        self.read_seconds: deque[float] = deque(maxlen=SAMPLES)
        self._healthy = False
        self._redis: Any = None
        self._reader: Any = None
        self._reader_id: int | None = None
        self._scripts: dict[str, Any] = {}
        self._group: anyio.abc.TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._closing = False
        self._outgoing: deque[_Append] = deque()
        self._in_flight: list[_Append] = []  # the batch being appended
        self._has_outgoing = anyio.Event()
        self._held: dict[str, int] = {}  # stream -> epoch of the life this node holds
        self._lost: set[str] = set()  # held streams whose lease went to another life
        self._writers: dict[Owner, list[Subscription]] = {}
        self._everything: list[Subscription] = []  # every stream written on this node
        self._watches: dict[str, _Watch] = {}  # history key -> watch
        self._joining: deque[tuple[Subscription, str | None]] = deque()
        self._has_watch = anyio.Event()
        self._reading = False

    # -- keys ---------------------------------------------------------------------------

    def _lease_key(self, stream_id: str) -> str:
        return f"{self.prefix}:lease:{stream_id}"

    def _epoch_key(self, stream_id: str) -> str:
        return f"{self.prefix}:epoch:{stream_id}"

    def _history_key(self, stream_id: str, lang: str) -> str:
        # The language is last and never holds a colon: any stream id maps to one key.
        return f"{self.prefix}:h:{stream_id}:{lang}"

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._healthy and not self._closing

    @property
    def shared(self) -> bool:
        return True

    @property
    def stats(self) -> Counter[str]:
        return self._stats

    async def start(self, languages: Sequence[str] = ()) -> None:
        """Connect and check Redis (`BusUnavailable` when it does not answer), then run
        the append, read and renewal loops. `languages`: what this node translates into
        (every node the same), the keys an error about every language is appended to."""
        if languages:
            self.languages = list(languages)
        if self._runner is not None:
            return
        try:
            import redis.asyncio as aioredis
        except ImportError as exc:  # pragma: no cover - the extra is not installed
            raise BusUnavailable(
                "the Redis bus needs the redis package: pip install -e '.[cluster]'"
            ) from exc
        self._redis = aioredis.Redis.from_url(
            self.url, decode_responses=True, socket_timeout=5, socket_connect_timeout=3
        )
        self._reader = aioredis.Redis.from_url(
            self.url,
            decode_responses=True,
            single_connection_client=True,
            socket_timeout=BLOCK_MS / 1000 + 5,
            socket_connect_timeout=3,
        )
        failures: tuple[type[BaseException], ...] = (*_redis_errors(), TimeoutError)
        try:
            with anyio.fail_after(5):
                info = await self._redis.info("server")
        except failures as exc:
            await self._disconnect()
            raise BusUnavailable(f"cannot reach Redis at {self.url}: {exc}") from None
        version = str(info.get("redis_version", "0"))
        if int(version.split(".")[0]) < 7:
            await self._disconnect()
            raise BusUnavailable(f"Redis at {self.url} is {version}; the bus needs 7 or later")
        self._scripts = {
            name: self._redis.register_script(source)
            for name, source in (
                ("claim", _CLAIM),
                ("append", _APPEND),
                ("renew", _RENEW),
                ("release", _RELEASE),
            )
        }
        self._healthy = True
        # The loops live in a task of their own (redis-py's client is asyncio's), so the
        # bus may be started before the engine that uses it and closed by that engine
        # without crossing the engine's task group.
        started = anyio.Event()
        self._runner = asyncio.get_running_loop().create_task(self._run(started))
        await started.wait()

    async def _run(self, started: anyio.Event) -> None:
        async with anyio.create_task_group() as group:
            self._group = group
            group.start_soon(self._append_loop)
            group.start_soon(self._read_loop)
            group.start_soon(self._renew_loop)
            started.set()

    async def aclose(self) -> None:
        """Append what is queued (within a second), let go of every lease, stop."""
        if self._runner is None or self._closing:
            return
        with anyio.move_on_after(1.0):
            while self._outgoing or self._in_flight:
                await anyio.sleep(0.005)
        self._closing = True
        with anyio.move_on_after(1.0):
            for stream_id in list(self._held):
                await self._release_now(stream_id)
        runner, self._group = self._runner, None
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        await self._disconnect()

    async def _disconnect(self) -> None:
        for client in (self._reader, self._redis):
            if client is not None:
                with anyio.move_on_after(1.0):
                    await client.aclose()

    def _failed(self, what: str, exc: BaseException) -> None:
        if self._healthy:
            log.warning("Redis bus: %s failed (%s); retrying", what, exc)
            self._stats["redis_errors"] += 1
        self._healthy = False

    def _succeeded(self) -> None:
        if not self._healthy and not self._closing:
            log.info("Redis bus: reachable again")
            self._stats["redis_reconnects"] += 1
        self._healthy = True

    def _unavailable(self, stream_id: str, message: str) -> InvalidEvent:
        return InvalidEvent(ErrorMessage(ErrorCode.UNAVAILABLE, message, None, stream_id))

    # -- ownership ------------------------------------------------------------------------

    async def claim(self, stream_id: str) -> Claim:
        deadline = anyio.current_time() + 2 * self.lease_ms / 1000
        waited = False
        while True:
            try:
                granted, value = await self._scripts["claim"](
                    keys=[self._lease_key(stream_id), self._epoch_key(stream_id)],
                    args=[self.node, self.lease_ms, int(time.time() * 1000)],
                )
                through = await self._answered_through(stream_id) if granted else None
            except _redis_errors() as exc:
                self._failed("claiming a stream", exc)
                raise self._unavailable(
                    stream_id, "the update bus (Redis) is unreachable: try again shortly"
                ) from None
            self._succeeded()
            if granted:
                epoch = int(value)
                self._held[stream_id] = epoch
                self._lost.discard(stream_id)
                if waited or through is not None:
                    self._stats["takeovers"] += 1
                return Claim(epoch, through)
            # Another node's writer holds it: wait for its lease, which a dead node
            # stops renewing; a live one keeps it and the writer here is refused.
            pause = max(int(value), 10) / 1000 + 0.01
            if anyio.current_time() + pause > deadline:
                raise InvalidEvent(
                    ErrorMessage(
                        ErrorCode.FORBIDDEN,
                        f"stream {stream_id!r} belongs to a writer on another server node",
                        "stream_id",
                        stream_id,
                    )
                )
            waited = True
            await anyio.sleep(pause)

    async def _answered_through(self, stream_id: str) -> int | None:
        """The highest seq the stream's current life (its histories since the last close
        mark) has a reply for; None when that life is over (closed) or empty."""
        highest: int | None = None
        for lang in self.languages:
            raw = await self._redis.xrevrange(
                self._history_key(stream_id, lang), "+", "-", count=16
            )
            entries = [_entry(entry_id, fields) for entry_id, fields in reversed(raw)]
            seq = answered_through(entries)
            if seq is not None and (highest is None or seq > highest):
                highest = seq
        return highest

    def release(self, stream_id: str) -> None:
        if stream_id in self._held and self._group is not None:
            self._group.start_soon(self._release_now, stream_id)

    async def _release_now(self, stream_id: str) -> None:
        self._held.pop(stream_id, None)
        self._lost.discard(stream_id)
        try:
            await self._scripts["release"](keys=[self._lease_key(stream_id)], args=[self.node])
        except _redis_errors() as exc:  # it expires by itself
            self._failed("releasing a lease", exc)

    async def _renew_loop(self) -> None:
        delay = BACKOFF[0]
        while True:
            await anyio.sleep(self.lease_ms / 3000)
            held = dict(self._held)
            try:
                if held:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for stream_id, epoch in held.items():
                            await self._scripts["renew"](
                                keys=[self._lease_key(stream_id), self._epoch_key(stream_id)],
                                args=[self.node, self.lease_ms, epoch],
                                client=pipe,
                            )
                        results = await pipe.execute()
                else:
                    await self._redis.ping()
                    results = []
            except _redis_errors() as exc:
                self._failed("renewing leases", exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, BACKOFF[1])
                continue
            delay = BACKOFF[0]
            self._succeeded()
            for (stream_id, epoch), ok in zip(held.items(), results, strict=True):
                if self._held.get(stream_id) != epoch:
                    continue  # released or claimed anew meanwhile
                if ok:
                    self._stats["lease_renewals"] += 1
                elif stream_id not in self._lost:
                    self._lost.add(stream_id)
                    self._stats["lease_losses"] += 1
                    log.warning("Redis bus: stream %r was taken over elsewhere", stream_id)

    # -- appending ------------------------------------------------------------------------

    async def answered(
        self, stream_id: str, segment_id: int, seq: int, source: str, languages: Sequence[str]
    ) -> dict[str, TranslationUpdate]:
        found: dict[str, TranslationUpdate] = {}
        try:
            for lang in languages:
                entries = await self._entries(stream_id, lang)
                update = find_final(entries, segment_id, seq, source)
                if update is not None:
                    found[lang] = update
        except _redis_errors() as exc:
            self._failed("reading a history", exc)
            raise self._unavailable(stream_id, "the update bus (Redis) is unreachable") from None
        return found

    def publish(self, reply: Reply, owner: Owner | None, epoch: int | None = None) -> None:
        stream_id = reply.stream_id or ""
        if epoch is None:
            epoch = self._held.get(stream_id, 0)
        langs = [reply.lang] if reply.lang is not None else list(self.languages)
        self._queue(
            _Append(
                stream_id,
                langs,
                epoch,
                _KIND_REPLY,
                protocol.serialize(reply),
                reply,
                owner,
                time.perf_counter(),
            )
        )

    def _queue(self, item: _Append) -> None:
        self._outgoing.append(item)
        self._has_outgoing.set()

    async def _append_loop(self) -> None:
        """Append queued replies in order, many per round trip; tell each writer once
        Redis has its reply."""
        while True:
            if not self._outgoing:
                self._has_outgoing = anyio.Event()
                await self._has_outgoing.wait()
            batch = [self._outgoing.popleft() for _ in range(min(len(self._outgoing), 256))]
            self._in_flight = batch
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for item in batch:
                        await self._scripts["append"](
                            keys=[
                                self._epoch_key(item.stream_id),
                                *(self._history_key(item.stream_id, lang) for lang in item.langs),
                            ],
                            args=[
                                item.epoch,
                                self.history,
                                HISTORY_TTL_MS,
                                item.kind,
                                item.payload,
                            ],
                            client=pipe,
                        )
                    results = await pipe.execute(raise_on_error=False)
            except _redis_errors() as exc:
                self._failed("appending replies", exc)
                results = [exc] * len(batch)
            else:
                self._succeeded()
            now = time.perf_counter()
            for item, result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    self._not_appended(item, "the update bus (Redis) is unreachable")
                elif not result:
                    self._stats["stale_refused"] += 1
                    self._not_appended(item, "this stream was taken over by another server node")
                else:
                    self._stats["appended"] += 1
                    self.publish_seconds.append(now - item.queued)
                    self._appended(item, list(result))
            self._in_flight = []

    def _appended(self, item: _Append, ids: list[str]) -> None:
        reply = item.reply
        if reply is None:
            return
        cursor = ids[0] if ids else None
        if isinstance(reply, TranslationUpdate) and cursor is not None and len(ids) == 1:
            reply = _with_cursor(reply, cursor)
        subs = list(self._writers.get(item.owner, ())) if item.owner is not None else []
        subs.extend(self._everything)
        for sub in subs:
            if sub.wants(reply):
                sub.put(reply)

    def _not_appended(self, item: _Append, why: str) -> None:
        """A reply Redis did not take: a final's becomes an `unavailable` error to its
        writer (which sends the final again), a partial's is dropped (counted)."""
        reply = item.reply
        if reply is None:
            self._stats["close_marks_lost"] += 1
            return
        final = reply.seq if isinstance(reply, ErrorMessage) else None
        if isinstance(reply, TranslationUpdate):
            final = reply.seq if reply.is_final else None
        if final is None:
            self._stats["updates_dropped"] += 1
            return
        self._stats["finals_refused"] += 1
        error = ErrorMessage(
            ErrorCode.UNAVAILABLE,
            f"{why}: send this final transcript again (reconnect first)",
            None,
            reply.stream_id,
            final,
            reply.lang,
        )
        for sub in list(self._writers.get(item.owner, ())) if item.owner is not None else []:
            sub.put(error)

    def to_owner(self, reply: Reply, owner: Owner | None) -> None:
        for sub in list(self._writers.get(owner, ())) if owner is not None else []:
            sub.put(reply)

    def end_stream(self, stream_id: str, closed: bool = True) -> None:
        epoch = self._held.get(stream_id)
        if closed and epoch is not None and self.languages:
            self._queue(
                _Append(
                    stream_id,
                    list(self.languages),
                    epoch,
                    _KIND_CLOSED,
                    "",
                    None,
                    None,
                    time.perf_counter(),
                )
            )
        if epoch is not None and self._group is not None:
            self._group.start_soon(self._release_after_appends, stream_id, epoch)

    async def _release_after_appends(self, stream_id: str, epoch: int) -> None:
        """Let the lease go once this life's queued replies are appended (a new life on
        another node must come after them)."""
        while any(item.stream_id == stream_id for item in [*self._outgoing, *self._in_flight]):
            await anyio.sleep(0.005)
        if self._held.get(stream_id) == epoch:
            await self._release_now(stream_id)

    # -- reading --------------------------------------------------------------------------

    def subscribe(
        self,
        stream_id: str | None = None,
        *,
        owner: Owner | None = None,
        lang: str | None = None,
        after: str | None = None,
    ) -> Subscription:
        sub = Subscription(stream_id, self.queue_size, owner, lang)
        if owner is not None:
            self._writers.setdefault(owner, []).append(sub)
        elif stream_id is None:
            # Every stream: those written on this node (the nodes keep no list of all).
            self._everything.append(sub)
        else:
            self._joining.append((sub, after))
            self._wake_reader()
        return sub

    def backlog(self, stream_id: str | None, lang: str | None) -> list[TranslationUpdate]:
        return []  # read from Redis by each new subscription (`_join`), not here

    def unsubscribe(self, sub: Subscription) -> None:
        if sub.owner is not None:
            remove_subscription(self._writers, sub.owner, sub)
        elif sub in self._everything:
            self._everything.remove(sub)
        else:
            for key, watch in list(self._watches.items()):
                if sub in watch.subs:
                    watch.subs.remove(sub)
                if not watch.subs:
                    del self._watches[key]
        sub.end()

    def end_all(self) -> None:
        for sub in [
            *self._everything,
            *(s for subs in self._writers.values() for s in subs),
            *(s for w in self._watches.values() for s in w.subs),
            *(s for s, _ in self._joining),
        ]:
            sub.end()
        self._writers.clear()
        self._everything.clear()
        self._watches.clear()
        self._joining.clear()

    def viewers(self) -> dict[str, int]:
        """Local viewer subscriptions per stream (for the metrics)."""
        counts: Counter[str] = Counter()
        for watch in self._watches.values():
            counts[watch.stream_id] += len(watch.subs)
        return dict(counts)

    def _wake_reader(self) -> None:
        self._has_watch.set()
        if self._reading and self._reader_id is not None and self._group is not None:
            self._group.start_soon(self._unblock)

    async def _unblock(self) -> None:
        try:
            await self._redis.client_unblock(self._reader_id)
        except _redis_errors():
            pass  # the read ends by itself within BLOCK_MS

    async def _entries(self, stream_id: str, lang: str, after: str | None = None) -> list[Entry]:
        """A history from Redis, oldest first (all that is kept, or what follows `after`)."""
        key = self._history_key(stream_id, lang)
        if after is None:
            raw = await self._redis.xrevrange(key, "+", "-", count=self.history)
            raw.reverse()
        else:
            raw = await self._redis.xrange(key, f"({after}", "+", count=self.history)
        return [_entry(entry_id, fields) for entry_id, fields in raw]

    async def _join(self, sub: Subscription, after: str | None) -> None:
        """Start a viewer: its backlog or what it missed, then live entries (each key
        is read from where this history read ended)."""
        assert sub.stream_id is not None
        langs = [sub.lang] if sub.lang is not None else list(self.languages)
        missed: list[tuple[Entry, str]] = []
        backlog: list[TranslationUpdate] = []
        resumed = after is not None
        heads: dict[str, str] = {}
        for lang in langs:
            entries = await self._entries(sub.stream_id, lang)
            heads[lang] = entries[-1].cursor if entries else "0-0"
            found = resume_from(entries, after) if after is not None else None
            if found is None:
                resumed = False
            else:
                missed.extend((entry, lang) for entry in found)
            backlog.extend(backlog_lines(entries))
        if resumed:
            missed.sort(key=lambda item: item[0].at)
            for entry, lang in missed:
                if entry.reply is None:
                    sub.end_at(entry.cursor, lang)
                    return
                sub.put(entry.reply, entry.cursor, lang)
        else:
            if after is not None and backlog:  # a cursor this history cannot place
                self._stats["resume_gaps"] += 1
            for update in sorted(backlog, key=by_cursor):
                sub.put(update)
        for lang in langs:
            key = self._history_key(sub.stream_id, lang)
            watch = self._watches.get(key)
            if watch is None:
                self._watches[key] = _Watch(sub.stream_id, lang, heads[lang], [sub])
            else:
                watch.subs.append(sub)
                # Entries between its head and this watch's position reach this viewer
                # from the read; those it had already are skipped by cursor.

    async def _read_loop(self) -> None:
        delay = BACKOFF[0]
        while True:
            try:
                if self._reader_id is None:
                    self._reader_id = int(await self._reader.client_id())
                while self._joining:
                    sub, after = self._joining[0]
                    if not sub.ended:
                        await self._join(sub, after)
                    self._joining.popleft()
                if not self._watches:
                    self._has_watch = anyio.Event()
                    if not self._joining:
                        await self._has_watch.wait()
                    continue
                streams = {key: watch.last for key, watch in self._watches.items()}
                self._reading = True
                try:
                    got = await self._reader.xread(streams, count=512, block=BLOCK_MS)
                finally:
                    self._reading = False
            except _redis_errors() as exc:
                self._failed("reading histories", exc)
                self._reader_id = None
                await anyio.sleep(delay)
                delay = min(delay * 2, BACKOFF[1])
                continue
            delay = BACKOFF[0]
            self._succeeded()
            self._deliver(got)

    def _deliver(self, got: Any) -> None:
        items = got.items() if isinstance(got, dict) else (got or [])
        now_ms = time.time() * 1000
        for key, raw in items:
            watch = self._watches.get(key)
            for entry_id, fields in raw:
                if watch is None:
                    break
                watch.last = entry_id
                entry = _entry(entry_id, fields)
                self._stats["entries_read"] += 1
                self.read_seconds.append(max(0.0, now_ms - entry.at[0]) / 1000)
                for sub in list(watch.subs):
                    if entry.reply is None:
                        sub.end_at(entry.cursor, watch.lang)
                    elif sub.wants(entry.reply):
                        sub.put(entry.reply, entry.cursor, watch.lang)
                if entry.reply is None:
                    watch.subs.clear()
            if watch is not None and not watch.subs:
                self._watches.pop(key, None)


def _entry(entry_id: str, fields: dict[str, str]) -> Entry:
    """A Redis Stream entry as a history entry."""
    epoch = int(fields["e"]) if fields.get("e") else None
    if fields.get("k") != _KIND_REPLY:
        return Entry(entry_id, None, epoch)
    message = protocol.parse(fields["m"], max_bytes=1 << 22, max_text_chars=1 << 20)
    if isinstance(message, TranslationUpdate):
        return Entry(entry_id, _with_cursor(message, entry_id), epoch)
    assert isinstance(message, ErrorMessage)
    return Entry(entry_id, message, epoch)


def _with_cursor(update: TranslationUpdate, cursor: str) -> TranslationUpdate:
    return replace(update, cursor=cursor)
