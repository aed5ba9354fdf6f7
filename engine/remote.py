"""`RemoteTranslator`: the `NmtIncremental` API over a server's WebSocket.

For a speech pipeline that embeds a remote engine (`nmt-incremental serve`, one node or
several behind a load balancer) with the same code it would use for an in-process
`IncrementalTranslator`::

    async with RemoteTranslator("ws://host:8765/ws", token=SECRET) as nmt:
        await nmt.push(PartialTranscript("mic-1", 0, 0, "hello", is_final=False))
        async for reply in nmt.updates("mic-1"):
            ...

It is one writer connection (it never subscribes as a viewer) and it follows the writer's
rule of `protocol/writer.py`: each final is kept in a `FinalLedger` until answered; when the
connection drops, closes (1012 from a draining node, 1001 from a single server) or a final
is answered `unavailable`, it reconnects to the same URL with backoff and resends every
final still owed, in order, with its ids, before anything new. A node that lost its
connection to the shared store, or that stops, is left behind without the pipeline noticing:
the answer to each final arrives exactly once (duplicates after a resend race are dropped).

It keeps within the server's rate limit (`rate`, a `Pacer`): a burst of partials is
coalesced per stream (the latest waits for its turn and goes; the ones it replaced never
do), finals wait for their turn and are never dropped. The server's limit is not announced:
each `rate_limited` answer halves the pace, and a final it did not take is sent again on a
new connection like one answered `unavailable`.

The connecting half (backoff over an outage, fatal answers raised) is
`engine.reconnect.Reconnector`, which a writer keeping its own `FinalLedger` uses alone
(examples/replay_client.py).

An I/O adapter like `engine/server`, but it only needs `protocol`, `anyio` and `websockets`.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from types import TracebackType

import anyio
from anyio.abc import TaskGroup
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus

import protocol

# A new subscription starts, like the engine's own backlog, with RECENT_FINALS final updates
# per stream and language, then the current segment's latest update.
from engine.reconnect import GaveUp, Reconnector, why_lost
from engine.replies import RECENT_FINALS, Reply, ReplyQueue
from protocol import (
    Backoff,
    CloseStream,
    EngineClosed,
    ErrorCode,
    ErrorMessage,
    FinalLedger,
    InvalidEvent,
    InvalidMessage,
    Outcome,
    Pacer,
    PartialTranscript,
    SetGlossary,
    TranslationUpdate,
)
from protocol.codec import FROM_ENGINE_TYPES
from protocol.messages import TooLarge

CLOSE_WAIT = 2.0
"""Seconds `aclose` waits for the server to answer the connection's close."""

RATE = 40.0
"""Messages per second a writer keeps within by default: below the server's default limit
(50 per second), so that a burst never meets it."""


@dataclass
class RemoteStats:
    """What the connection went through: `disconnects` says why each connection was lost,
    `reconnects` counts new connections made, `resent` finals sent again on them,
    `duplicates` answers received twice and dropped, `dropped_partials` partials pushed
    while no connection was ready (a newer one supersedes them; finals are kept),
    `coalesced` partials replaced by a newer event of their stream before their turn to go
    came, `rate_limited` the server's `rate_limited` answers (not delivered: the pace was
    halved, a final was sent again)."""

    disconnects: list[str] = field(default_factory=list)
    reconnects: int = 0
    resent: int = 0
    duplicates: int = 0
    dropped_partials: int = 0
    coalesced: int = 0
    rate_limited: int = 0


class RemoteSubscription(ReplyQueue):
    """A bounded queue of replies for one consumer of `RemoteTranslator.updates` (the
    engine's `ReplyQueue`: full, it drops its oldest non-final update; finals and errors,
    which answer finals, are never dropped). Ends when its stream is closed (all its
    finals answered) or the translator closes; `aclose()` ends it early."""

    def __init__(self, owner: RemoteTranslator, stream_id: str | None, max_items: int) -> None:
        super().__init__(max_items)
        self.stream_id = stream_id  # None: every stream
        self._owner = owner

    async def aclose(self) -> None:
        """Stop receiving; what is queued is dropped."""
        self._owner._unsubscribe(self)
        self._items.clear()
        self.end()


class RemoteTranslator:
    """`NmtIncremental` over the WebSocket of `nmt-incremental serve` (see the module).

    Replies are asynchronous over a socket, so `push` cannot raise `InvalidEvent` for
    what the server refuses (`out_of_order`, `too_large`, `limit_exceeded`, ...): those
    refusals arrive as `ErrorMessage` items in `updates()`, naming the stream and seq, as
    they answer finals for a server's writer. `push` raises `InvalidEvent` only for what
    is no event at all, and `EngineClosed` when the translator is not running (not
    started, closed, or given up after an outage).

    `unavailable` errors are not delivered: they mean "this node cannot do it", and the
    translator answers them by moving to another node. Nor are `rate_limited` ones: the
    translator slows down and sends again a final the server did not take. Should an
    outage outlast `reconnect_for` seconds (or `backoff.total`), the translator stops:
    each final still owed is answered with an `unavailable` error (per language still
    missing), every subscription ends, and `push` raises `EngineClosed`; `aclose()` does
    the same for the finals not answered within `drain_timeout`. So every final gets
    exactly one reply.

    `token`: the server's writer token (sent as a bearer header). `queue_size`: each
    subscription's bound. `max_size`: the largest message accepted from the server.
    `rate`: messages per second sent at most, in bursts of as many (None: no pacing); a
    `push` of a final may wait for its turn.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        reconnect_for: float = 30.0,
        backoff: Backoff | None = None,
        drain_timeout: float = 30.0,
        queue_size: int = 256,
        max_size: int = 2**22,
        open_timeout: float = 10.0,
        rate: float | None = RATE,
    ) -> None:
        if queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        self._pacer = Pacer(rate, now=time.monotonic()) if rate is not None else None
        self._parked = anyio.Event()  # a partial waits for its turn
        self._finals_waiting = 0  # finals (and closes) waiting for a turn: they go first
        self.url = url
        self.backoff = backoff or Backoff(total=reconnect_for)
        self.drain_timeout = drain_timeout
        self.queue_size = queue_size
        self.max_size = max_size
        self._dialer = Reconnector(
            url, token, backoff=self.backoff, max_size=max_size, open_timeout=open_timeout
        )
        self.ledger = FinalLedger()
        self._stats = RemoteStats()
        self._ws: ClientConnection | None = None  # the connection in use
        self._ready = False  # `_ws` took every owed final: new events may follow
        self._send_lock = anyio.Lock()  # one writer of frames: resends before new events
        self._group: TaskGroup | None = None
        self._running = False
        self._stopped = False  # takes nothing more (closed, or given up)
        self._closed = False  # `aclose` ran
        self._healthy = False  # this connection delivered an update: an outage is over
        self._open: set[str] = set()  # streams pushed to, not closed
        # Streams open on the current connection: those of an earlier one were closed by
        # the server when it ended (their writer left), so a close is sent only for these.
        self._here: set[str] = set()
        self._closing: set[str] = set()  # closed, some final still owed
        self._subs: list[RemoteSubscription] = []
        # Each stream's own glossaries as sent (`set_glossary`), sent again after a reconnect.
        self._glossaries: dict[str, dict[str, SetGlossary]] = {}
        # (stream, language) -> recent updates, for a new subscription's first lines.
        self._recent: dict[str, dict[str | None, deque[TranslationUpdate]]] = {}

    # -- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> RemoteTranslator:
        """Connect (retrying like a reconnect; the last failure is raised if it gives up)
        and start reading replies."""
        if self._running or self._stopped or self._closed:
            raise RuntimeError("a RemoteTranslator starts once")
        ws = await self._dialer.connect()
        self._ws, self._ready, self._running = ws, True, True
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._group.start_soon(self._run, ws)
        if self._pacer is not None:
            self._group.start_soon(self._send_parked, self._pacer)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """`aclose()`; exceptions are never suppressed."""
        await self.aclose()

    async def aclose(self) -> None:
        """Close every stream, wait (up to `drain_timeout`) for the finals still owed,
        then close the connection; what is still owed is answered `unavailable`.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._running:
                self._running = False
                for stream_id in sorted(self._open):
                    await self._close(stream_id)
                with anyio.move_on_after(self.drain_timeout):
                    while self.ledger.pending and not self._stopped:
                        await anyio.sleep(0.02)
        finally:
            # Also when the caller is cancelled meanwhile (a second Ctrl-C): the task
            # group entered in `__aenter__` must be left here, in this task, or every
            # cancel scope around it fails to exit ("Attempted to exit a cancel scope").
            self._stop("the translator was closed before this final was answered")
            group, self._group = self._group, None
            ws, self._ws = self._ws, None
            if group is not None:
                # Its own scope, shielded: the one current here, so it may be left; and
                # a cancelled caller still waits (briefly) for its tasks to end.
                group.cancel_scope.shield = True
                group.cancel_scope.cancel()
                await group.__aexit__(None, None, None)
            if ws is not None:
                with anyio.move_on_after(CLOSE_WAIT, shield=True):
                    await ws.close()

    def abandon(self, reason: str) -> None:
        """Stop waiting for the server now: each final still owed is answered with an
        `unavailable` error giving `reason` (as after an outage that outlasted
        `reconnect_for`), the subscriptions end, `push` raises `EngineClosed`, and
        `aclose` then closes without waiting. For a caller told to stop (`bridge`'s
        Ctrl-C) whose server keeps refusing or cannot be reached: `ledger.owed()` still
        names the finals it never answered."""
        self._stop(reason)

    @property
    def stats(self) -> RemoteStats:
        """Disconnects, reconnects, resends and duplicates so far."""
        self._stats.resent = self.ledger.resent
        self._stats.duplicates = self.ledger.duplicates
        self._stats.coalesced = self._pacer.coalesced if self._pacer is not None else 0
        return self._stats

    @property
    def streams(self) -> list[str]:
        """Streams pushed to and not yet closed, and closing ones still owed a final."""
        return sorted(self._open | self._closing)

    # -- API ----------------------------------------------------------------------------

    async def push(self, event: PartialTranscript) -> None:
        """Send an event and return; its replies come through `updates()`.

        A final is kept until answered (and resent after a reconnect), and waits for its
        turn within `rate`; a partial that finds no turn waits as its stream's latest, and
        one pushed while the connection is being made again is dropped (the next one
        supersedes it). Raises `EngineClosed` when not running."""
        if not self._running:
            raise EngineClosed("RemoteTranslator is not running (use `async with`)")
        if not isinstance(event, PartialTranscript):
            raise InvalidEvent(
                ErrorMessage(
                    ErrorCode.INVALID_MESSAGE,
                    f"expected a PartialTranscript, got {type(event).__name__}",
                )
            )
        if event.stream_id not in self._closing:
            self._open.add(event.stream_id)
        pacer = self._pacer
        if pacer is not None:
            pacer.unpark(event.stream_id)  # an older partial still waiting: superseded
            if event.is_final:
                await self._turn(pacer)
            elif self._finals_waiting or not pacer.take(time.monotonic()):
                pacer.park(event)
                self._parked.set()
                return
        async with self._send_lock:
            ws = self._ws
            if not self._ready or ws is None:
                if event.is_final:
                    self.ledger.hold(event)  # goes out with the resends
                else:
                    self._stats.dropped_partials += 1
                return
            self.ledger.hold(event)  # kept first: the send may fail
            try:
                await ws.send(protocol.serialize(event))
            except ConnectionClosed:
                if not event.is_final:
                    self._stats.dropped_partials += 1
                return  # a final stays owed: the reconnect resends it
            self.ledger.sent(event)
            self._here.add(event.stream_id)

    async def set_glossary(self, stream_id: str, glossary: str) -> None:
        """Give a stream its own glossary for one target language (`glossary`: the text
        of a glossary file, docs/glossaries.md): the server applies it from the
        stream's next partial. Sent again on every new connection (before the finals
        resent there), so a server that lost the stream still applies it; the server's
        refusal (a bad line, `too_large`, ...) arrives in `updates()` as an error naming
        the stream. Raises `InvalidEvent` for text past the protocol's bounds,
        `EngineClosed` when not running."""
        if not self._running:
            raise EngineClosed("RemoteTranslator is not running (use `async with`)")
        try:
            message = SetGlossary(stream_id, glossary)
        except InvalidMessage as exc:
            code = ErrorCode.TOO_LARGE if isinstance(exc, TooLarge) else ErrorCode.INVALID_MESSAGE
            raise InvalidEvent(ErrorMessage(code, exc.message, exc.field, stream_id)) from None
        header = next(
            (line for line in glossary.split("\n") if line.strip() and not line.startswith("#")),
            "",
        )
        self._glossaries.setdefault(message.stream_id, {})[header.strip()] = message
        if self._pacer is not None:
            await self._turn(self._pacer)
        async with self._send_lock:
            ws = self._ws
            if self._ready and ws is not None:  # else it goes out with the resends
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(protocol.serialize(message))

    def updates(self, stream_id: str | None = None) -> RemoteSubscription:
        """Subscribe now to the replies of one of this writer's streams, or of all of them
        (None): updates, duplicates dropped, and the errors that refuse its events. It
        starts with each stream's last few final updates and its current segment's latest
        update, then yields what arrives; it ends when its stream is closed (its finals
        answered) or the translator closes."""
        if stream_id is not None:
            stream_id = _stream_id(stream_id)
        sub = RemoteSubscription(self, stream_id, self.queue_size)
        if self._stopped:
            sub.end()
            return sub
        for update in self._backlog(stream_id):
            sub.put(update)
        self._subs.append(sub)
        return sub

    async def close_stream(self, stream_id: str) -> None:
        """End a stream: the server answers its finals still owed, then frees it; its
        subscriptions end once they are answered. Raises `InvalidEvent`
        (`unknown_stream`) for a stream this translator has not open, `EngineClosed` when
        not running."""
        if not self._running:
            raise EngineClosed("RemoteTranslator is not running (use `async with`)")
        stream_id = _stream_id(stream_id)
        if stream_id not in self._open:
            raise InvalidEvent(
                ErrorMessage(
                    ErrorCode.UNKNOWN_STREAM,
                    f"no open stream {stream_id!r}",
                    "stream_id",
                    stream_id,
                )
            )
        await self._close(stream_id)

    async def _close(self, stream_id: str) -> None:
        self._open.discard(stream_id)
        self._closing.add(stream_id)
        if self._pacer is not None:
            self._pacer.unpark(stream_id)
            await self._turn(self._pacer)
        async with self._send_lock:
            ws = self._ws
            if self._ready and ws is not None and stream_id in self._here:
                # Lost with the connection, the close is moot: the server closes the
                # streams of a writer that left, and a resend is followed by a new close.
                self._here.discard(stream_id)
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(protocol.serialize(CloseStream(stream_id)))
        self._settle(stream_id)

    # -- the connection -----------------------------------------------------------------

    async def _run(self, ws: ClientConnection) -> None:
        """Read replies; when the connection is lost, make a new one and resend."""
        resend = False
        while True:
            self._healthy = self.ledger.pending == 0
            reason = await self._serve(ws, resend)
            self._ready = False
            self._ws = None
            await ws.close()
            self._stats.disconnects.append(reason)
            try:
                ws = await self._dialer.reconnect(self._healthy)
            except GaveUp:
                self._stop(f"the server could not be reached again ({reason})")
                return
            except InvalidStatus as exc:
                self._stop(f"the server refused to reconnect ({exc})")
                return
            self._ws = ws  # not ready for new events until the resends are out
            self._stats.reconnects += 1
            resend = True

    async def _serve(self, ws: ClientConnection, resend: bool) -> str:
        """Resend what is owed (on a new connection), then deliver replies until the
        connection is lost; returns why."""
        if resend:
            async with self._send_lock:
                owed = self.ledger.owed()
                self._here = set()
                try:
                    # The streams' glossaries first: they apply to what is sent after.
                    for stream_id in sorted(self._open | {e.stream_id for e in owed}):
                        for glossary in self._glossaries.get(stream_id, {}).values():
                            if self._pacer is not None:
                                await self._turn(self._pacer)
                            await ws.send(protocol.serialize(glossary))
                    for event in owed:
                        if self._pacer is not None:
                            await self._turn(self._pacer)
                        await ws.send(protocol.serialize(event))
                        self.ledger.sent(event)
                        self._here.add(event.stream_id)
                    # The resends open their streams again here; closed ones close again.
                    for stream_id in sorted(self._here & self._closing):
                        self._here.discard(stream_id)
                        if self._pacer is not None:
                            await self._turn(self._pacer)
                        await ws.send(protocol.serialize(CloseStream(stream_id)))
                except ConnectionClosed as exc:
                    return why_lost(ws, exc)
                self._ready = True
        try:
            async for data in ws:
                message = protocol.parse(data, max_bytes=self.max_size, accept=FROM_ENGINE_TYPES)
                if not isinstance(message, TranslationUpdate | ErrorMessage):
                    continue
                got = self.ledger.received(message)
                limited = (
                    isinstance(message, ErrorMessage) and message.code == ErrorCode.RATE_LIMITED
                )
                if limited:
                    self._stats.rate_limited += 1
                    if self._pacer is not None:
                        self._pacer.slow_down(time.monotonic())
                if got.outcome is Outcome.MUST_RECONNECT:
                    return f"{_code(message)}: {_text(message)}"
                if isinstance(message, TranslationUpdate):
                    self._healthy = True
                if (
                    got.outcome is Outcome.DUPLICATE
                    or limited
                    or (isinstance(message, ErrorMessage) and message.code == ErrorCode.UNAVAILABLE)
                ):
                    continue
                self._deliver(message)
        except ConnectionClosed as exc:
            return why_lost(ws, exc)
        return why_lost(ws)

    # -- pacing -------------------------------------------------------------------------

    async def _turn(self, pacer: Pacer) -> None:
        """Wait for a turn to send a final or a close (ahead of waiting partials)."""
        self._finals_waiting += 1
        try:
            while not pacer.take(time.monotonic()):
                await anyio.sleep(pacer.delay(time.monotonic()))
        finally:
            self._finals_waiting -= 1

    async def _send_parked(self, pacer: Pacer) -> None:
        """Send the partials that found no turn, each stream's latest, as turns come
        (after the finals waiting for one)."""
        while True:
            await self._parked.wait()
            self._parked = anyio.Event()
            while pacer.parked:
                delay = pacer.delay(time.monotonic())
                if self._finals_waiting or delay > 0:
                    await anyio.sleep(max(delay, 0.005))
                    continue
                async with self._send_lock:
                    event = pacer.next_parked() if pacer.take(time.monotonic()) else None
                    ws = self._ws if self._ready else None
                    if event is None:
                        continue  # a newer event of its stream went out meanwhile
                    with contextlib.suppress(ConnectionClosed):
                        if ws is not None:
                            await ws.send(protocol.serialize(event))
                            self._here.add(event.stream_id)
                            continue
                    self._stats.dropped_partials += 1  # the next one supersedes it

    # -- delivery -----------------------------------------------------------------------

    def _deliver(self, reply: Reply) -> None:
        stream_id = reply.stream_id
        if isinstance(reply, TranslationUpdate) and reply.stream_id in self.streams:
            recent = self._recent.setdefault(reply.stream_id, {})
            recent.setdefault(reply.lang, deque(maxlen=4 * RECENT_FINALS)).append(reply)
        for sub in list(self._subs):
            if sub.stream_id is None or sub.stream_id == stream_id:
                sub.put(reply)
        if stream_id is not None:
            self._settle(stream_id)

    def _settle(self, stream_id: str) -> None:
        """A closing stream whose finals are all answered is over: its subscriptions end
        and its id is free."""
        if stream_id not in self._closing or self.ledger.owed(stream_id):
            return
        self._closing.discard(stream_id)
        if stream_id in self._open:  # pushed to again after the close: a new stream
            return
        self._recent.pop(stream_id, None)
        for sub in [s for s in self._subs if s.stream_id == stream_id]:
            self._subs.remove(sub)
            sub.end()

    def _backlog(self, stream_id: str | None) -> list[TranslationUpdate]:
        """Recent finals, then the current segment's latest update, per stream and
        language (like the engine's backlog for a late subscriber)."""
        lines: list[TranslationUpdate] = []
        for sid, by_lang in self._recent.items():
            if stream_id is not None and sid != stream_id:
                continue
            for updates in by_lang.values():
                finals = [u for u in updates if u.is_final][-RECENT_FINALS:]
                last = updates[-1] if updates else None
                lines += finals
                if last is not None and not last.is_final:
                    lines.append(last)
        return lines

    def _unsubscribe(self, sub: RemoteSubscription) -> None:
        with contextlib.suppress(ValueError):
            self._subs.remove(sub)

    def _stop(self, reason: str) -> None:
        """Take nothing more: answer each final still owed `unavailable` (in each
        language it is missing), end every subscription."""
        if self._stopped:
            return
        self._running = False
        self._stopped = True
        self._ready = False
        for event in self.ledger.owed():
            for lang in sorted(self.ledger.missing(event), key=lambda x: x or ""):
                error = ErrorMessage(
                    ErrorCode.UNAVAILABLE, reason, None, event.stream_id, event.seq, lang
                )
                for sub in self._subs:
                    if sub.stream_id in (None, event.stream_id):
                        sub.put(error)
        for sub in self._subs:
            sub.end()
        self._subs.clear()


def _stream_id(stream_id: str) -> str:
    """The id as messages hold it (NFC), or `InvalidEvent` for one no message may hold."""
    try:
        return CloseStream(stream_id).stream_id
    except InvalidMessage as exc:
        raise InvalidEvent(
            ErrorMessage(ErrorCode.INVALID_MESSAGE, exc.message, exc.field)
        ) from None


def _text(message: Reply) -> str:
    return message.message if isinstance(message, ErrorMessage) else "no message"


def _code(message: Reply) -> str:
    return str(message.code) if isinstance(message, ErrorMessage) else "update"
