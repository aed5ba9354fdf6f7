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
  per reply, a close mark when the writer closes the stream, and a restart mark when a
  writer starts over (numbering from 0 again). An entry's id is the
  update's `cursor`. The owner appends (`engine.streaming.redis_appends`, many replies per
  round trip); a writer's own replies go back to it only once Redis has them, so a reply
  the writer saw is one every viewer will see.
- **Term counts.** A stream's glossary terms matched and placed, per language, in a small
  hash beside its histories, written by its current life when they change (a final),
  riding on that final's append (no round trip of their own), deleted by the close mark:
  any node answers `/terms` for the stream from it.
- **Viewers.** Each node reads, with one blocking `XREAD` on one connection, the keys its
  local viewers watch, each once whatever the number of viewers, and fans out locally.
  A new viewer starts from the history (its backlog, or what came after its `after`
  cursor), read by a task apart from the live reads, so a crowd joining never holds up
  the viewers already watching (`engine.streaming.redis_viewers`).
- **Faults** (`engine.streaming.redis_health`). Redis unreachable at start:
  `BusUnavailable` (the server exits 2). Lost later, or refusing writes (out of memory,
  found by the node's appends or by the test write it makes every third of a lease term,
  so a node that writes nothing finds it too): `ready` is False (`/readyz` says so)
  until a write goes through; replies that cannot be
  appended are not dropped silently (a final's becomes an `unavailable` error to its
  writer saying why, which sends it again; a partial's is counted), and every loop
  reconnects with backoff and resumes from the ids it had: redis-py reconnects a
  connection, not a blocking read or a lease.

Nothing here knows about sockets or HTTP: the server reads `ready` and `stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.abc

import protocol
from engine.distribution import install_hint
from engine.replies import Reply
from engine.streaming.bus import BusUnavailable, Claim
from engine.streaming.fanout import Hub
from engine.streaming.history import HISTORY, Entry, answered_through
from engine.streaming.lifecycle import Owner
from engine.streaming.redis_appends import HISTORY_TTL_MS, Appender, Call, send_scripts
from engine.streaming.redis_health import BACKOFF, Health, refusal
from engine.streaming.redis_store import (
    APPEND,
    CLAIM,
    KEEP_HASH,
    KIND_CLOSED,
    KIND_REPLY,
    KIND_STARTED_OVER,
    RELEASE,
    RENEW,
    Append,
    Keys,
    entry_of,
    redacted,
    redis_errors,
    terms_of,
)
from engine.streaming.redis_viewers import BLOCK_MS, RedisViewers
from engine.streaming.subscriptions import Subscription
from protocol import ErrorCode, ErrorMessage, InvalidEvent

log = logging.getLogger(__name__)

LEASE_MS = 3000
"""How long a stream stays its node's without a renewal. A node that dies holds its
streams this long at most: the writer, reconnecting elsewhere, waits for it."""

SAMPLES = 2048
"""Latency samples kept for the metrics' quantiles."""

CONNECTIONS = 64
"""Connections a node keeps to Redis for its commands (claims, appends, renewals, history
reads; the blocking read has its own). A command finding them all busy waits for one
(up to `CONNECTION_WAIT` seconds) rather than failing: a reconnect storm's claims queue,
they are not refused as if Redis were unreachable (redis-py's default pool raises past
100 at once)."""

CONNECTION_WAIT = 10.0
"""Seconds a command waits for a free connection before it fails (Redis that slow is as
good as unreachable)."""


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
        self.history_size = history
        self.prefix = prefix
        self.keys = Keys(prefix)
        self.node = node or uuid.uuid4().hex[:12]
        self.languages: list[str] = []
        self._stats: Counter[str] = Counter()
        self.publish_seconds: deque[float] = deque(maxlen=SAMPLES)
        self.read_seconds: deque[float] = deque(maxlen=SAMPLES)
        self.health = Health(self._stats)
        self._redis: Any = None
        self._reader: Any = None
        self._scripts: dict[str, Any] = {}
        self._group: anyio.abc.TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._closing = False
        self._held: dict[str, int] = {}  # stream -> epoch of the life this node holds
        self._lost: set[str] = set()  # held streams whose lease went to another life
        self._fresh: dict[str, int] = {}  # claimed streams whose epoch counter the claim made
        self._renewing = anyio.Event()  # set while no renewal is in flight
        self._renewing.set()
        self._hub = Hub(queue_size)
        self._appends = Appender(
            self.keys, history, self._hub, self.health, self._stats, self.publish_seconds
        )
        self._viewers = RedisViewers(self._hub, self.keys, history, self.health, self.read_seconds)

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def hub(self) -> Hub:
        return self._hub

    @property
    def ready(self) -> bool:
        return self.health.ok

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
            self._viewers.languages = self.languages
        if self._runner is not None:
            return
        try:
            import redis.asyncio as aioredis
        except ImportError as exc:  # pragma: no cover - the extra is not installed
            raise BusUnavailable(
                f"the Redis bus needs the redis package: {install_hint('cluster')}"
            ) from exc
        pool = aioredis.BlockingConnectionPool.from_url(
            self.url,
            max_connections=CONNECTIONS,
            timeout=CONNECTION_WAIT,
            decode_responses=True,
            socket_timeout=5,
            socket_connect_timeout=3,
        )
        self._redis = aioredis.Redis.from_pool(pool)
        self._reader = aioredis.Redis.from_url(
            self.url,
            decode_responses=True,
            single_connection_client=True,
            socket_timeout=BLOCK_MS / 1000 + 5,
            socket_connect_timeout=3,
        )
        failures: tuple[type[BaseException], ...] = (*redis_errors(), TimeoutError)
        try:
            with anyio.fail_after(5):
                info = await self._redis.info("server")
        except failures as exc:
            await self._disconnect()
            raise BusUnavailable(f"cannot reach Redis at {redacted(self.url)}: {exc}") from None
        version = str(info.get("redis_version", "0"))
        if int(version.split(".")[0]) < 7:
            await self._disconnect()
            raise BusUnavailable(
                f"Redis at {redacted(self.url)} is {version}; the bus needs 7 or later"
            )
        self._scripts = {
            name: self._redis.register_script(source)
            for name, source in (
                ("claim", CLAIM),
                ("append", APPEND),
                ("renew", RENEW),
                ("release", RELEASE),
                ("keep_hash", KEEP_HASH),
            )
        }
        try:  # the append loop sends them by digest, which Redis must know
            for name in ("append", "keep_hash"):
                await self._redis.script_load(self._scripts[name].script)
        except failures as exc:
            await self._disconnect()
            raise BusUnavailable(f"cannot reach Redis at {redacted(self.url)}: {exc}") from None
        self.health.reachable = True
        # The loops live in a task of their own (redis-py's client is asyncio's), so the
        # bus may be started before the engine that uses it and closed by that engine
        # without crossing the engine's task group.
        started = anyio.Event()
        self._runner = asyncio.get_running_loop().create_task(self._run(started))
        await started.wait()

    async def _run(self, started: anyio.Event) -> None:
        async with anyio.create_task_group() as group:
            self._group = group
            group.start_soon(self._appends.run, self._redis, self._scripts)
            group.start_soon(self._renew_loop)
            await self._viewers.run(self._redis, self._reader, group)
            started.set()

    async def aclose(self) -> None:
        """Append what is queued (within a second), let go of every lease, stop."""
        if self._runner is None or self._closing:
            return
        with anyio.move_on_after(1.0):
            while self._appends.busy:
                await anyio.sleep(0.005)
        self._closing = self.health.closing = True
        self.health.flush(force=True)
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

    def _unavailable(self, stream_id: str, message: str) -> InvalidEvent:
        return InvalidEvent(ErrorMessage(ErrorCode.UNAVAILABLE, message, None, stream_id))

    # -- ownership ------------------------------------------------------------------------

    async def claim(self, stream_id: str) -> Claim:
        deadline = anyio.current_time() + 2 * self.lease_ms / 1000
        waited = False
        while True:
            try:
                granted, value, *created = await self._scripts["claim"](
                    keys=[self.keys.lease(stream_id), self.keys.epoch(stream_id)],
                    args=[self.node, self.lease_ms, int(time.time() * 1000), HISTORY_TTL_MS],
                )
                through = await self._answered_through(stream_id) if granted else None
            except redis_errors() as exc:
                why = self.health.failed("claiming a stream", exc)
                raise self._unavailable(stream_id, f"{why}: try again shortly") from None
            self.health.succeeded()
            if granted:
                epoch = int(value)
                self._held[stream_id] = epoch
                self._lost.discard(stream_id)
                if created and int(created[0]):
                    self._fresh[stream_id] = epoch
                else:
                    self._fresh.pop(stream_id, None)
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
                self.keys.history(stream_id, lang), "+", "-", count=16
            )
            entries = [entry_of(entry_id, fields) for entry_id, fields in reversed(raw)]
            seq = answered_through(entries)
            if seq is not None and (highest is None or seq > highest):
                highest = seq
        return highest

    def release(self, stream_id: str) -> None:
        if stream_id in self._held and self._group is not None:
            self._group.start_soon(self._release_now, stream_id, True)

    async def _release_now(self, stream_id: str, unused: bool = False) -> None:
        """Let the lease go; `unused`: the claim opened nothing, so an epoch counter it
        made goes too (nothing is left of a stream refused after its claim)."""
        self._held.pop(stream_id, None)
        self._lost.discard(stream_id)
        fresh = self._fresh.pop(stream_id, None)
        made = str(fresh) if unused and fresh is not None else ""
        # A renewal in flight would take the lease (and the epoch) back after this.
        await self._renewing.wait()
        try:
            await self._scripts["release"](
                keys=[self.keys.lease(stream_id), self.keys.epoch(stream_id)],
                args=[self.node, made],
            )
        except redis_errors() as exc:  # it expires by itself
            self.health.failed("releasing a lease", exc)

    async def _renew_loop(self) -> None:
        delay = BACKOFF[0]
        while True:
            await anyio.sleep(self.lease_ms / 3000)
            self.health.flush()
            held = dict(self._held)
            renewing = self._renewing = anyio.Event()
            try:
                # Every turn, so that a node that appends nothing (no writer, or silent
                # ones) learns that Redis refuses writes too (out of memory): not ready.
                await self._probe_write()
                # By digest, as the appends go: a pipeline of script objects would ask
                # Redis whether it has the script first (`SCRIPT EXISTS`) every turn.
                calls: list[Call] = [
                    (
                        self._scripts["renew"],
                        [
                            self.keys.lease(stream_id),
                            self.keys.epoch(stream_id),
                            self.keys.glossaries(stream_id),
                            self.keys.terms(stream_id),
                        ],
                        [self.node, self.lease_ms, epoch, HISTORY_TTL_MS],
                    )
                    for stream_id, epoch in held.items()
                ]
                results = (
                    await send_scripts(self._redis, calls, self._stats, "renewal_round_trips")
                    if calls
                    else []
                )
                failed = next((r for r in results if isinstance(r, BaseException)), None)
                if failed is not None:
                    raise failed
            except redis_errors() as exc:
                renewing.set()
                delay = await self.health.back_off("renewing leases", exc, delay)
                continue
            finally:
                renewing.set()
            delay = BACKOFF[0]
            self.health.succeeded()
            for (stream_id, epoch), ok in zip(held.items(), results, strict=True):
                if self._held.get(stream_id) != epoch:
                    continue  # released or claimed anew meanwhile
                if ok:
                    self._stats["lease_renewals"] += 1
                elif stream_id not in self._lost:
                    self._lost.add(stream_id)
                    self._stats["lease_losses"] += 1
                    log.warning("Redis bus: stream %r was taken over elsewhere", stream_id)

    async def _probe_write(self) -> None:
        """Whether Redis takes a write (a key that expires at once): a node is not ready
        while it does not, whether or not it has replies to append, and ready again as
        soon as it does, without waiting for a reply to append."""
        try:
            await self._redis.set(f"{self.prefix}:probe:{self.node}", "1", px=1000)
        except redis_errors() as exc:
            if not refusal(exc):
                raise
            self.health.write_refused("a test write", exc)
        else:
            self.health.wrote()

    # -- appending ------------------------------------------------------------------------

    async def history(self, stream_id: str, lang: str) -> list[Entry]:
        try:
            return await self._viewers.entries(stream_id, lang)
        except redis_errors() as exc:
            why = self.health.failed("reading a history", exc)
            raise self._unavailable(stream_id, why) from None

    def publish(self, reply: Reply, owner: Owner | None, epoch: int | None = None) -> None:
        stream_id = reply.stream_id or ""
        if epoch is None:
            epoch = self._held.get(stream_id, 0)
        langs = [reply.lang] if reply.lang is not None else list(self.languages)
        self._queue(
            Append(
                stream_id,
                langs,
                epoch,
                KIND_REPLY,
                protocol.serialize(reply),
                reply,
                owner,
                time.perf_counter(),
            )
        )

    def _queue(self, item: Append) -> None:
        self._appends.queue(item)

    async def keep_glossaries(self, stream_id: str, epoch: int, texts: Mapping[str, str]) -> None:
        pairs = [part for lang, text in sorted(texts.items()) for part in (lang, text)]
        try:
            await self._scripts["keep_hash"](
                keys=[self.keys.epoch(stream_id), self.keys.glossaries(stream_id)],
                args=[epoch, HISTORY_TTL_MS, *pairs],
            )
        except redis_errors() as exc:
            why = self.health.failed("keeping a stream's glossary", exc)
            raise self._unavailable(stream_id, f"{why}: send it again shortly") from None
        self.health.succeeded()

    async def kept_glossaries(self, stream_id: str) -> dict[str, str]:
        try:
            raw = await self._redis.hgetall(self.keys.glossaries(stream_id))
        except redis_errors() as exc:
            why = self.health.failed("reading a stream's glossary", exc)
            raise self._unavailable(stream_id, f"{why}: try again shortly") from None
        self.health.succeeded()
        return {str(lang): str(text) for lang, text in raw.items()}  # decode_responses

    def keep_terms(self, stream_id: str, epoch: int, counts: Mapping[str, tuple[int, int]]) -> None:
        # Queued: they ride on the stream's next append (`engine.streaming.redis_appends`).
        self._appends.keep_terms(stream_id, epoch, counts)

    async def kept_terms(self, stream_id: str) -> dict[str, tuple[int, int]]:
        try:
            raw = await self._redis.hgetall(self.keys.terms(stream_id))
        except redis_errors() as exc:
            why = self.health.failed("reading a stream's term counts", exc)
            raise self._unavailable(stream_id, f"{why}: try again shortly") from None
        self.health.succeeded()
        return terms_of(raw)

    def start_over(self, stream_id: str, epoch: int) -> None:
        # Queued like a reply and fenced by its epoch: it lands before the new life's
        # first reply, and never after another life took the stream.
        if self.languages:
            self._queue(
                Append(
                    stream_id,
                    list(self.languages),
                    epoch,
                    KIND_STARTED_OVER,
                    "",
                    None,
                    None,
                    time.perf_counter(),
                )
            )

    def end_stream(self, stream_id: str, closed: bool = True) -> None:
        epoch = self._held.get(stream_id)
        if closed and epoch is not None and self.languages:
            self._queue(
                Append(
                    stream_id,
                    list(self.languages),
                    epoch,
                    KIND_CLOSED,
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
        while self._appends.holds(stream_id):
            await anyio.sleep(0.005)
        if self._held.get(stream_id) == epoch:
            await self._release_now(stream_id)

    # -- reading --------------------------------------------------------------------------

    def watch(self, sub: Subscription, after: str | None = None) -> None:
        if sub.stream_id is None:
            # Every stream: those written on this node (the nodes keep no list of all).
            self._hub.join(sub, [])
            return
        self._viewers.watch(sub, after)
