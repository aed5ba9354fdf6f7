"""Who gets a connection, sans I/O: caps on connections (in all and per client address),
the handshake deadline, and a tally of refusals for metrics and the log.

Every TCP connection holds a file descriptor from its accept to its close. At the
process's descriptor limit `accept()` fails (EMFILE), the health checks cannot get in
either, and asyncio logs a traceback per failed accept. So the caps are derived from the
descriptor limit and stay below it: WebSocket connections past `max_connections` (or past
`max_per_address` from one client) are answered 503 (429) at once instead of held; a
connection still in its handshake is dropped at `handshake_timeout`, or sooner when
`max_pending` newer ones wait behind it and it has waited `EVICTION_AGE` (the oldest goes
first: silent connects cannot fill the pending room for the clients that do send a
request; while every pending one is younger, the newcomer is dropped instead). What is
refused is counted by `Reason`, for `/metrics` and for one log line per interval
(`Tally`).

The I/O side (`client.GatedConnection`, `app.SubtitleServer`) feeds in what happened to
each connection and carries out what it is told (abort this one, answer that refusal).
"""

from __future__ import annotations

import ipaddress
import math
import resource
from collections import Counter, OrderedDict
from dataclasses import dataclass
from enum import Enum

from engine.server.handshake import Refusal

DEFAULT_HANDSHAKE_TIMEOUT = 5.0
"""Seconds from accept to a complete HTTP request; a client on a slow phone link sends its
few hundred bytes well within it, a silent connect gives its descriptor back."""

EVICTION_AGE = 0.1
"""Seconds a pending connection is safe from newcomers. A client sends its request right
behind the TCP handshake's last packet, so a connection whose request has not come in a
tenth of a second after its accept (a few turns of a busy event loop) is slow or silent."""

MAX_DEFAULT_CONNECTIONS = 10_000
"""The derived default never exceeds this, however high the descriptor limit."""

RETRY_AFTER_S = 5
"""`Retry-After` of a refusal for a cap: when a client may try again."""


class Reason(str, Enum):
    """Why a connection was refused or dropped (`/metrics` label `reason`)."""

    MAX_CONNECTIONS = "max_connections"  # 503: the server holds its cap of connections
    PER_ADDRESS = "per_address"  # 429: that client address holds its cap
    HANDSHAKE_TIMEOUT = "handshake_timeout"  # no complete request within the deadline
    PENDING_EVICTED = "pending_evicted"  # the oldest unfinished handshake, for a new one
    PENDING_FULL = "pending_full"  # a new connection, while every pending one is young
    FD_LIMIT = "fd_limit"  # accept() failed: no descriptor left (EMFILE/ENFILE)

    def __str__(self) -> str:
        return self.value


def descriptor_limit() -> int:
    """The process's soft limit on open files (`ulimit -n`); unlimited reads as 2**20."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2**20 if soft == resource.RLIM_INFINITY or soft < 0 else soft


ACCEPT_BURST = 100
"""The most connections asyncio accepts in one turn of its loop (its listen backlog, the
default of `loop.create_server`): each holds a descriptor before the gate can drop any."""


def accept_burst(limit: int) -> int:
    """The listen backlog for a descriptor limit: asyncio accepts up to this many at once
    and the next turn's accepts come before the first turn's drops have closed theirs, so
    at a low limit a burst of the default 100 ran out of descriptors (EMFILE), and asyncio
    then stops accepting for a whole second, /healthz included."""
    return max(8, min(ACCEPT_BURST, limit // 16))


def descriptor_reserve(limit: int) -> int:
    """Descriptors kept for everything but client connections: the listener, log and model
    files, the runtime's threads, subtitle files being written, and two bursts of accepts
    (the second accepted before the first's drops are closed)."""
    return max(32, limit // 4) + 2 * accept_burst(limit)


@dataclass(frozen=True)
class ConnectionCaps:
    """How many connections a server holds at once.

    `max_connections`: WebSocket connections (writers and viewers) in all;
    `max_per_address`: from one client address (an IPv6 client by its /64; None: no
    cap); `max_pending`: connections whose HTTP request has not arrived yet (health
    checks and pages pass through here too, for milliseconds); `handshake_timeout`:
    seconds a connection may take to send its request.
    """

    max_connections: int = 1000
    max_per_address: int | None = 500
    max_pending: int = 125
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if self.max_per_address is not None and self.max_per_address < 1:
            raise ValueError("max_per_address must be >= 1 (None: no cap)")
        if self.max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        if not (math.isfinite(self.handshake_timeout) and self.handshake_timeout > 0):
            raise ValueError("handshake_timeout must be a positive number of seconds")

    @property
    def eviction_age(self) -> float:
        """Seconds a pending connection waits before a newcomer may push it out."""
        return min(EVICTION_AGE, self.handshake_timeout)

    @classmethod
    def derive(
        cls,
        limit: int | None = None,
        *,
        max_connections: int | None = None,
        max_per_address: int | None = None,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    ) -> ConnectionCaps:
        """Caps that fit in the descriptor limit (`limit`, default the process's): a
        reserve for everything else (`descriptor_reserve`), a quarter of the rest for
        pending handshakes, the remainder for connections (at most
        `MAX_DEFAULT_CONNECTIONS`); one address may hold half of them. A value given
        overrides its derivation (`max_per_address=0`: no per-address cap)."""
        limit = descriptor_limit() if limit is None else limit
        usable = max(16, limit - descriptor_reserve(limit))
        pending = max(8, usable // 4)
        if max_connections is None:
            max_connections = min(MAX_DEFAULT_CONNECTIONS, usable - pending)
        else:
            pending = max(8, min(pending, max_connections // 2))
        per_address: int | None
        if max_per_address is None:
            per_address = max(1, max_connections // 2)
        else:
            per_address = max_per_address or None
        return cls(max_connections, per_address, pending, handshake_timeout)

    def descriptors(self) -> int:
        """Descriptors the caps may hold at once (connections and pending ones)."""
        return self.max_connections + self.max_pending

    def describe(self) -> str:
        per = "no cap" if self.max_per_address is None else str(self.max_per_address)
        return (
            f"{self.max_connections} connections, {per} per address, "
            f"{self.max_pending} pending handshakes, handshake timeout "
            f"{self.handshake_timeout:g} s"
        )


def client_key(host: str | None) -> str:
    """The address a per-address cap counts by: an IPv4 address as it is (and an
    IPv4-mapped IPv6 one as IPv4), an IPv6 one by its /64 (one host commonly holds a
    whole /64), anything else (a Unix socket) as one client."""
    if not host:
        return "local"
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class ConnectionGate:
    """The connections a server holds, and whether one more may come in.

    Every accepted connection `arrive`s as pending; it stops being pending when its
    request is in (`request`) or it leaves (`leave`). A WebSocket handshake asks `admit`.
    Ids are the I/O layer's, one per connection; times are seconds, monotonic.
    """

    def __init__(self, caps: ConnectionCaps) -> None:
        self.caps = caps
        self._pending: OrderedDict[int, float] = OrderedDict()  # id -> arrival, oldest first
        self._open: dict[int, str] = {}  # admitted WebSocket connections -> client key
        self._per_address: Counter[str] = Counter()

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def open(self) -> int:
        return len(self._open)

    def arrive(self, cid: int, now: float) -> tuple[bool, list[int]]:
        """A connection was accepted at `now`. Returns whether it may wait for its request
        (False: drop it, the pending room is full of young handshakes) and the pending
        connections to drop for it (the oldest, once past `eviction_age`), already
        forgotten here."""
        evicted: list[int] = []
        while len(self._pending) >= self.caps.max_pending:
            oldest, since = next(iter(self._pending.items()))
            if now - since < self.caps.eviction_age:
                return False, evicted
            del self._pending[oldest]
            evicted.append(oldest)
        self._pending[cid] = now
        return True, evicted

    def request(self, cid: int) -> None:
        """Its request arrived: it is answered at once, no longer pending."""
        self._pending.pop(cid, None)

    def expired(self, cid: int) -> bool:
        """Its handshake deadline passed: True when it was still pending (drop it)."""
        return self._pending.pop(cid, None) is not None

    def admit(self, cid: int, address: str) -> Refusal | None:
        """May this connection become a WebSocket connection? None: yes, and it counts
        until it `leave`s; else the refusal to answer (503 or 429, with Retry-After)."""
        retry = (("Retry-After", str(RETRY_AFTER_S)),)
        if len(self._open) >= self.caps.max_connections:
            return Refusal(
                503,
                f"Too many connections (the server's limit is {self.caps.max_connections}); "
                "retry later.\n",
                retry,
                counted_as=Reason.MAX_CONNECTIONS.value,
            )
        cap = self.caps.max_per_address
        if cap is not None and self._per_address[address] >= cap:
            return Refusal(
                429,
                f"Too many connections from your address (the limit is {cap}); close one "
                "or retry later.\n",
                retry,
                counted_as=Reason.PER_ADDRESS.value,
            )
        self._open[cid] = address
        self._per_address[address] += 1
        return None

    def leave(self, cid: int) -> None:
        """The connection closed (in any state); idempotent."""
        self._pending.pop(cid, None)
        address = self._open.pop(cid, None)
        if address is not None:
            self._per_address[address] -= 1
            if self._per_address[address] <= 0:
                del self._per_address[address]


class Tally:
    """Counts refusals by reason and says when to log them: the first at once, then at
    most one line per `interval` seconds with the counts since the last, so that a flood
    of refusals costs a line every few seconds, not a line (or a traceback) each."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.total: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._logged_at: float | None = None

    def add(self, reason: str, now: float, count: int = 1) -> Counter[str] | None:
        """Count `count` refusals; the counts to log now, if a line is due."""
        self.total[reason] += count
        self._counts[reason] += count
        return self.due(now)

    def due(self, now: float) -> Counter[str] | None:
        """The counts since the last line, if there are some and a line is due (for a
        timer at `next_due` too); they are then reset."""
        if not self._counts:
            return None
        if self._logged_at is not None and now - self._logged_at < self.interval:
            return None
        counts, self._counts = self._counts, Counter()
        self._logged_at = now
        return counts

    @property
    def next_due(self) -> float | None:
        """When counts held back now are due (None: nothing held back)."""
        if not self._counts or self._logged_at is None:
            return None
        return self._logged_at + self.interval
