"""The live-subtitle server: a thin asyncio layer over `IncrementalTranslator`.

One port serves the WebSocket endpoint `/ws` (partials in, translation updates out), the
subtitle page `/` and `/healthz`, `/readyz`, `/metrics` (plain HTTP through the
`websockets` handshake hook). `SubtitleServer` only puts the pieces together: the rules
are in `connection` (sans I/O, with the server's state), plain HTTP in `routes`, each
connection's I/O in `client` and the order of a shutdown in `shutdown`.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio
from websockets.asyncio.server import Server, ServerConnection, serve

from engine.server.client import Client
from engine.server.connection import ConnectionCore, Limits, ServerState
from engine.server.metrics import ServerMetrics
from engine.server.outbox import Outbox
from engine.server.routes import HttpRoutes
from engine.server.shutdown import close_listener, drain
from engine.streaming import IncrementalTranslator


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and whom it lets in.

    `allowed_origins`: browser origins allowed to open `/ws` (None: any); clients that
    send no Origin (speech pipelines) are held to the token alone. `max_frame_bytes` is
    the socket's hard limit (default four times the codec's `max_message_bytes`):
    between the two a message gets a `too_large` error, above it the connection is
    closed (1009), because the whole frame would have to be buffered.
    """

    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None
    allowed_origins: tuple[str, ...] | None = None
    limits: Limits = field(default_factory=Limits)
    max_frame_bytes: int | None = None
    queue_size: int = 256
    shutdown_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.token is not None and not self.token:
            raise ValueError("token must not be empty")
        if self.max_frame_bytes is not None and self.max_frame_bytes < (
            self.limits.max_message_bytes
        ):
            raise ValueError("max_frame_bytes must be at least max_message_bytes")
        if self.queue_size < 1:
            raise ValueError("queue_size must be >= 1")

    @property
    def frame_limit(self) -> int:
        return self.max_frame_bytes or 4 * self.limits.max_message_bytes


class SubtitleServer:
    """Serve an `IncrementalTranslator` over WebSocket, with the subtitle page.

    ```python
    async with IncrementalTranslator(translator) as nmt, SubtitleServer(nmt) as server:
        print(server.url)
        await server.wait_shutdown()     # until shutdown() (e.g. from a signal handler)
    ```

    The engine may be attached later (`attach`), so that health checks answer while the
    model loads; `/readyz` and `/ws` answer 503 until then. Leaving the `async with`
    shuts down gracefully (see `shutdown`).
    """

    def __init__(
        self, engine: IncrementalTranslator | None = None, options: ServerOptions | None = None
    ) -> None:
        self.options = options or ServerOptions()
        self.engine = engine
        self.state = ServerState()
        if engine is not None:
            self.state.attach(engine.languages)
        self.metrics = ServerMetrics.watching(lambda: self.engine)
        self._routes = HttpRoutes(
            self.state,
            self.metrics,
            token=self.options.token,
            allowed_origins=self.options.allowed_origins,
        )
        self._ids = itertools.count(1)
        self._clients: set[Client] = set()
        self._server: Server | None = None
        self._stopped = anyio.Event()

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Start listening (port 0 picks a free port; see `port`)."""
        if self._server is not None:
            raise RuntimeError("server already started")
        self._server = await serve(
            self._handle,
            self.options.host,
            self.options.port,
            process_request=self._routes,
            max_size=self.options.frame_limit,
            compression=None,  # short messages: not worth per-connection zlib state
        )

    def attach(self, engine: IncrementalTranslator) -> None:
        """Start serving `engine` (running, i.e. inside its `async with`)."""
        if self.engine is not None:
            raise RuntimeError("an engine is already attached")
        self.engine = engine
        self.state.attach(engine.languages)

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        host = self.options.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/"

    @property
    def ready(self) -> bool:
        """Model loaded and not shutting down: what `/readyz` reports."""
        return self.state.ready

    def role_counts(self) -> Counter[str]:
        """Open connections by role (`writer`, `viewer`, `undecided`)."""
        return Counter(client.core.role.value for client in self._clients)

    async def wait_shutdown(self) -> None:
        """Return once `shutdown` has finished."""
        await self._stopped.wait()

    async def shutdown(self) -> None:
        """Stop gracefully; idempotent.

        1. Stop taking work: `/readyz` and new `/ws` handshakes answer 503, messages on
           open connections get an error (the listener stays up for health checks).
        2. Shut the engine down, so that accepted finals are translated.
        3. Flush every connection's outbox (within `shutdown_timeout`).
        4. Past the timeout, answer every accepted final not translated yet with an
           `unavailable` error and give those replies `ABORT_GRACE` seconds to go out.
        5. Close the connections with 1001 (going away) and the listener.
        """
        if not self.state.stop():
            await self._stopped.wait()
            return
        try:
            await drain(self.engine, self._clients, self.options.shutdown_timeout)
        finally:
            await close_listener(self._server, self.options.shutdown_timeout)
            self._stopped.set()

    async def __aenter__(self) -> SubtitleServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Shut down (shielded: a cancelled caller still drains); exceptions propagate."""
        with anyio.CancelScope(shield=True):
            await self.shutdown()

    # -- WebSocket ------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        engine = self.engine
        if engine is None:  # refused at the handshake; only a race with attach() gets here
            await ws.close(1013, "not ready")
            return
        core = ConnectionCore(next(self._ids), self.options.limits, self.state, time.monotonic())
        client = Client(ws, core, Outbox(self.options.queue_size), engine, self.state, self.metrics)
        self._clients.add(client)
        self.metrics.connections_accepted.inc()
        try:
            await client.serve()
        finally:
            self._clients.discard(client)
