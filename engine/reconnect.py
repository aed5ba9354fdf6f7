"""The client's connection to a server: dialed again after each loss with backoff over an
outage, refusals that retrying cannot help raised at once, and why a connection ended.

The connecting half of the writer's rule (`protocol/writer.py`), apart from what is sent
over it: `engine.remote.RemoteTranslator` uses it, and so does a writer that keeps its own
`FinalLedger` (examples/replay_client.py). It needs only `protocol`, `anyio` and
`websockets`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import anyio
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from protocol import Backoff

PING_INTERVAL = 5.0
"""Seconds between pings, and how long a pong may take: a node that vanished without
closing (its host gone, a partition) is noticed within about twice this, not the minute
of a default keepalive, and its owed finals go elsewhere."""

_FATAL_STATUS = frozenset(range(400, 500)) - {408, 429}
"""Handshake answers that are mistakes (bad token, wrong path), not outages: retrying
cannot help. 408 and 429 are a balancer's "try again later"."""


class GaveUp(Exception):
    """An outage outlasted the backoff's total; `__cause__` is the last failure."""


class Reconnector:
    """Connections to one URL, made again after each loss with backoff: the connecting half
    of the writer's rule, for `RemoteTranslator` and for a writer that keeps its own
    `FinalLedger` (examples/replay_client.py).

    An outage spans the connections lost before one worked: the caller says whether the
    lost one worked (`healthy`), and the next loss after a healthy connection starts a new
    outage with the backoff's whole budget. A handshake answer that retrying cannot help
    (bad token, wrong path) is raised at once. `on_retry` hears of each failed try that
    will be tried again (the outage's try count so far, and the failure), so that a client
    can say at once that it is waiting rather than stay silent through the backoff.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        backoff: Backoff | None = None,
        max_size: int = 2**22,
        open_timeout: float = 10.0,
        on_retry: Callable[[int, Exception], None] | None = None,
    ) -> None:
        self.url = url
        self.on_retry = on_retry
        self.backoff = backoff or Backoff()
        self.max_size = max_size
        self.open_timeout = open_timeout
        self._headers = {"Authorization": f"Bearer {token}"} if token else None
        self._outage: float | None = None  # when the current outage began
        self._attempt = 0  # failed tries in it

    async def connect(self) -> ClientConnection:
        """The first connection, retried like a reconnect; when the backoff gives up, the
        last failure itself is raised (`OSError`, `InvalidHandshake`, a timeout)."""
        try:
            ws, _ = await self._dial(time.monotonic(), 0, first=True)
        except GaveUp as exc:
            raise (exc.__cause__ or ConnectionError("could not connect")) from None
        return ws

    async def reconnect(self, healthy: bool) -> ClientConnection:
        """A new connection after one was lost; `healthy`: the lost one worked (a new
        outage begins), else the same outage goes on. Raises `GaveUp` when the outage
        outlasts the backoff, `InvalidStatus` when the server refuses for good."""
        if healthy or self._outage is None:
            self._outage, self._attempt = time.monotonic(), 0
        else:
            self._attempt += 1  # that connection never worked
        ws, self._attempt = await self._dial(self._outage, self._attempt)
        return ws

    async def _dial(
        self, began: float, attempt: int, *, first: bool = False
    ) -> tuple[ClientConnection, int]:
        """A new connection, retried with backoff while the failure looks passing;
        returns it with the outage's try count."""
        while True:
            if not first:
                if self.backoff.gives_up(time.monotonic() - began, attempt):
                    raise GaveUp
                await anyio.sleep(self.backoff.jittered(attempt))
            first = False
            try:
                ws = await connect(
                    self.url,
                    additional_headers=self._headers,
                    max_size=self.max_size,
                    open_timeout=self.open_timeout,
                    ping_interval=PING_INTERVAL,
                    ping_timeout=PING_INTERVAL,
                    close_timeout=2.0,
                )
                return ws, attempt
            except InvalidStatus as exc:
                if exc.response.status_code in _FATAL_STATUS:
                    raise
                failure: Exception = exc
            except (OSError, asyncio.TimeoutError, InvalidHandshake) as exc:  # refused, DNS...
                failure = exc
            attempt += 1
            if self.backoff.gives_up(time.monotonic() - began, attempt):
                raise GaveUp from failure
            if self.on_retry is not None:
                self.on_retry(attempt, failure)


def why_lost(ws: ClientConnection, closed: ConnectionClosed | None = None) -> str:
    """Why a connection ended, for the disconnect log: the close frame received (code and
    reason), else "connection dropped"; `closed`: what a read or a send raised."""
    if closed is not None:
        if closed.rcvd is None:
            return "connection dropped"
        return f"close {closed.rcvd.code} {closed.rcvd.reason}".rstrip()
    code = ws.close_code
    if code is None or code == 1006:
        return "connection dropped"
    return f"close {code} {ws.close_reason or ''}".rstrip()
