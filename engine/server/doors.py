"""The door every connection passes, from its accept to its WebSocket handshake: the I/O
side of the sans-I/O `admission.ConnectionGate`.

`GatedConnection` (the `websockets` connection class of a server) reports its accept, its
request and its close, and is dropped at its handshake deadline; `Doors` aborts what the
gate drops, counts refusals in `/metrics`, logs them as one line per interval, and takes
over asyncio's report of accepts that fail for want of a descriptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import math
import os
import socket
from collections.abc import Iterable
from typing import Any, ClassVar

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request

from engine.server.admission import (
    RETRY_AFTER_S,
    ConnectionGate,
    Reason,
    Tally,
    client_key,
    descriptor_limit,
)
from engine.server.handshake import Refusal
from engine.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


ACCEPT_FAILED = "socket.accept() out of system resource"
"""The message asyncio hands its exception handler when `accept()` fails for want of a
descriptor (it then stops accepting on that socket for a second)."""

_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)

ACCEPT_RETRY_DELAY = 1.0
"""Seconds asyncio stops accepting on a socket after a failed accept
(`asyncio.constants.ACCEPT_RETRY_DELAY`, not public)."""

_MARGIN_S = 0.01
"""The listener is watched only while asyncio's retry is this far off at least, so that
watching never replaces asyncio's own reader once it is back."""

HELD_REQUEST_S = 0.05
"""How long a connection taken at the descriptor limit may take to send its request
(it holds the spare descriptor meanwhile, so silent ones are answered 20 a second;
a client sends its request at once)."""


class Doors:
    """The I/O side of a server's `ConnectionGate`: it aborts the connections the gate
    drops, counts every refusal in `/metrics` and logs them as one line per interval.

    `guard` also takes over asyncio's report of failed accepts on the server's sockets
    (at the descriptor limit asyncio logs a traceback per failed `accept()`, and its
    retry loop fails many times a second): they are counted and summed up like the rest,
    and each takes the waiting connection off the backlog with a spare descriptor kept
    for that, answering it at once (`/healthz` 200, anything else 503) rather than
    leaving it to time out.
    """

    def __init__(
        self, gate: ConnectionGate, metrics: ServerMetrics, interval: float = 10.0
    ) -> None:
        self.gate = gate
        self.metrics = metrics
        self.tally = Tally(interval)
        self.ids = itertools.count(1)
        self.live: dict[int, GatedConnection] = {}
        self._flush: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: frozenset[int] = frozenset()
        self._previous: Any = None
        self._spare: int | None = None
        self._held: tuple[socket.socket, asyncio.TimerHandle] | None = None
        self._paused_until = 0.0

    # -- connections ------------------------------------------------------------------

    def arrived(self, conn: GatedConnection) -> None:
        self.live[conn.gate_id] = conn
        welcome, evicted = self.gate.arrive(conn.gate_id, conn.loop.time())
        for cid in evicted:
            victim = self.live.get(cid)
            if victim is not None:
                victim.transport.abort()
            self.refused(Reason.PENDING_EVICTED)
        if not welcome:
            self.refused(Reason.PENDING_FULL)
            conn.transport.abort()

    def left(self, conn: GatedConnection) -> None:
        self.live.pop(conn.gate_id, None)
        self.gate.leave(conn.gate_id)

    def admit(self, conn: ServerConnection) -> Refusal | None:
        """May this handshake become a WebSocket connection (the caps)?"""
        if not isinstance(conn, GatedConnection):
            return None
        refusal = self.gate.admit(conn.gate_id, conn.address)
        if refusal is not None and refusal.counted_as is not None:
            self.refused(refusal.counted_as)
        return refusal

    def refused(self, reason: str, count: int = 1) -> None:
        """Count a refusal; log the tally when a line is due, else once it is."""
        self.metrics.connections_rejected.labels(str(reason)).inc(count)
        loop = self._loop or asyncio.get_running_loop()
        self._report(self.tally.add(str(reason), loop.time(), count))
        due = self.tally.next_due
        if due is not None and self._flush is None:
            self._flush = loop.call_at(due, self._flush_due)

    def _flush_due(self) -> None:
        self._flush = None
        loop = self._loop or asyncio.get_running_loop()
        self._report(self.tally.due(loop.time()))

    def _report(self, counts: dict[str, int] | None) -> None:
        if not counts:
            return
        what = ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()))
        hint = ""
        if Reason.FD_LIMIT.value in counts:
            hint = (
                "; fd_limit: accept() found no file descriptor left, the connection was "
                "answered 503 from a spare one: raise `ulimit -n` or lower --max-connections"
            )
        log.warning(
            "connections refused: %s (summed up at most every %g s; caps: %s; "
            "descriptor limit %d%s)",
            what,
            self.tally.interval,
            self.gate.caps.describe(),
            descriptor_limit(),
            hint,
        )

    # -- accept errors ------------------------------------------------------------------

    def guard(self, loop: asyncio.AbstractEventLoop, sockets: Iterable[Any]) -> None:
        """Count failed accepts on `sockets` instead of letting asyncio log each."""
        self._loop = loop
        self._listeners = frozenset(sock.fileno() for sock in sockets)
        self._previous = loop.get_exception_handler()
        loop.set_exception_handler(self._loop_error)
        self._spare = _spare_descriptor()

    def unguard(self) -> None:
        """Give asyncio's exception handler back; log what is still held back."""
        loop, self._loop = self._loop, None
        self._listeners = frozenset()  # a handler left chained behind another only passes on
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        self._report(self.tally.due(math.inf))
        if loop is not None and loop.get_exception_handler() == self._loop_error:
            loop.set_exception_handler(self._previous)
        if self._held is not None:
            conn, timer = self._held
            self._held = None
            timer.cancel()
            if loop is not None:
                loop.remove_reader(conn.fileno())
            conn.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        sock = context.get("socket")
        if (
            context.get("message") == ACCEPT_FAILED
            and isinstance(exc, OSError)
            and exc.errno in _OUT_OF_DESCRIPTORS
            and sock is not None
            and sock.fileno() in self._listeners
        ):
            # asyncio retries accept() in a loop after a failure, most of those with no
            # connection waiting: count the connections, not the failed calls.
            if self._shed(sock.fileno()) is not False:
                self.refused(Reason.FD_LIMIT)
            # asyncio now stops accepting on this socket for a second; meanwhile every
            # connection that arrives is answered from the spare descriptor at once
            # (/healthz 200, the rest 503 with Retry-After) instead of waiting that second.
            self._paused_until = loop.time() + ACCEPT_RETRY_DELAY
            loop.call_soon(self._answer_while_paused, sock.fileno())
            return
        if self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)

    def _answer_while_paused(self, listener: int) -> None:
        """Watch `listener` while asyncio's accept is paused (it has just removed its
        reader; its retry, or the server's close, puts its own in place of this one)."""
        loop = self._loop
        if (
            loop is not None
            and listener in self._listeners
            and self._spare is not None
            and loop.time() < self._paused_until - _MARGIN_S
        ):
            loop.add_reader(listener, self._answer_waiting, loop, listener)

    def _answer_waiting(self, loop: asyncio.AbstractEventLoop, listener: int) -> None:
        answered = self._shed(listener)
        if answered:
            self.refused(Reason.FD_LIMIT)
        if answered is None or self._held is not None:
            # No spare (or it is lent to a connection whose request is on its way): the
            # listener is watched again once that one is answered, or asyncio retries.
            loop.remove_reader(listener)

    def _shed(self, listener: int) -> bool | None:
        """Out of descriptors: free the spare one, accept the connection waiting longest
        and answer it from its request (`/healthz` 200, anything else 503), waiting up to
        `HELD_REQUEST_S` for a request not in yet, then take the spare back. True: one
        was taken; False: none was waiting; None: no spare (one may be waiting, left in
        the backlog)."""
        if self._spare is None or self._held is not None:
            return None
        os.close(self._spare)
        self._spare = None
        try:
            wrapper = socket.socket(fileno=listener)  # no new descriptor: detached below
            try:
                conn, _ = wrapper.accept()
            finally:
                wrapper.detach()
        except OSError:
            conn = None
        if conn is None:
            self._spare = _spare_descriptor()
            return False
        conn.setblocking(False)
        try:
            head = conn.recv(8192)
        except BlockingIOError:  # its request is on its way (a client sends it at once)
            loop = self._loop
            if loop is not None:
                timer = loop.call_later(HELD_REQUEST_S, self._answer_held, listener, True)
                loop.add_reader(conn.fileno(), self._answer_held, listener, False)
                self._held = (conn, timer)
                return True
            head = b""
        except OSError:
            head = b""
        _answer(conn, head)
        self._spare = _spare_descriptor()
        return True

    def _answer_held(self, listener: int, timed_out: bool) -> None:
        """The held connection's request came (or its time ran out): answer it, take the
        spare back, and watch the listener again while asyncio's accept is still paused."""
        if self._held is None:
            return
        conn, timer = self._held
        self._held = None
        timer.cancel()
        loop = self._loop or asyncio.get_running_loop()
        loop.remove_reader(conn.fileno())
        head = b""
        if not timed_out:
            with contextlib.suppress(OSError):
                head = conn.recv(8192)
        _answer(conn, head)
        self._spare = _spare_descriptor()
        self._answer_while_paused(listener)


def _answer(conn: socket.socket, head: bytes) -> None:
    """Answer a connection taken at the descriptor limit from what it sent, and close it
    (after reading, so that the close sends FIN, not RST)."""
    with conn, contextlib.suppress(OSError):
        conn.send(_ALIVE if head.startswith(b"GET /healthz ") else _OUT_OF_FILES)


def _plain(status: str, text: str) -> bytes:
    body = text.encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER_S}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


_ALIVE = _plain("200 OK", "ok\n")
_OUT_OF_FILES = _plain(
    "503 Service Unavailable", "Out of file descriptors: too many connections; retry later.\n"
)


def _spare_descriptor() -> int | None:
    """A descriptor held in reserve, given up to answer a connection at the limit."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


class GatedConnection(ServerConnection):
    """A `websockets` connection that answers to its server's `Doors` from its accept:
    pending until its request is in, dropped at the handshake deadline (its descriptor
    back at once), counted out when it closes. `gated` makes the subclass per server."""

    doors: ClassVar[Doors]
    gate_id: int
    address: str
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self.gate_id = next(self.doors.ids)
        self.address = client_key(peer[0] if isinstance(peer, tuple) and peer else None)
        timeout = self.doors.gate.caps.handshake_timeout
        self._deadline = self.loop.call_later(timeout, self._handshake_expired)
        self.doors.arrived(self)

    def process_event(self, event: Any) -> None:
        if self.request is None and isinstance(event, Request):
            self._stop_deadline()
            self.doors.gate.request(self.gate_id)
        super().process_event(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        self.doors.left(self)
        super().connection_lost(exc)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _handshake_expired(self) -> None:
        self._deadline = None
        if self.doors.gate.expired(self.gate_id):
            self.doors.refused(Reason.HANDSHAKE_TIMEOUT)
            self.transport.abort()


def gated(doors: Doors) -> type[GatedConnection]:
    """The connection class of one server (`websockets.serve(create_connection=...)`)."""
    return type("GatedConnection", (GatedConnection,), {"doors": doors})
