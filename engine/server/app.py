"""The live-subtitle server: a thin asyncio layer over `IncrementalTranslator`.

One port serves the WebSocket endpoint `/ws` (partials in, translation updates out; with
audio input, speech in too), the subtitle page `/`, the transcript `/transcript`, the
speaker page `/speak`, `/info` and `/healthz`, `/readyz`, `/metrics` (plain HTTP through the
`websockets` handshake hook). `SubtitleServer` only puts the pieces together: the rules
are in `connection` (sans I/O; the server's state in `state`), plain HTTP in `routes`, each
connection's I/O in `client` and the order of a shutdown in `shutdown`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import anyio
from websockets.asyncio.server import Server, ServerConnection, serve

from engine.server.admission import (
    ConnectionCaps,
    ConnectionGate,
    accept_burst,
    client_key,
    descriptor_limit,
)
from engine.server.audio import AudioInput, AudioService
from engine.server.client import Client
from engine.server.connection import ConnectionCore
from engine.server.credentials import Credentials
from engine.server.doors import Doors, gated
from engine.server.limits import Limits
from engine.server.metrics import ServerMetrics
from engine.server.outbox import Outbox
from engine.server.routes import HttpRoutes
from engine.server.shutdown import shut_down
from engine.server.state import ServerState
from engine.streaming.controller import IncrementalTranslator


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and whom it lets in.

    Roles (`Credentials`): `token` is the writer's secret (writes and watches every
    stream; without it anyone may write); `viewer_token` lets a connection watch
    (without it anyone may); `stream_keys` maps a stream id to a key that writes that
    stream alone; `metrics_token` guards `/metrics` (without it the writer token does).
    `allowed_origins`: browser origins allowed to open `/ws` (None: any); clients that
    send no Origin (speech pipelines) are held to the tokens alone. `connections`: the
    caps on connections and the handshake deadline (default: derived from the
    process's descriptor limit). `max_frame_bytes` is the socket's hard limit (default
    four times the codec's `max_message_bytes`): between the two a message gets a
    `too_large` error, above it the connection is closed (1009), because the whole
    frame would have to be buffered. `audio`: take audio over the WebSocket (a writer's
    `start_audio` and binary PCM frames) and recognize it with this input's recognizer;
    None: `start_audio` is refused with a note on how to enable it. `reuse_port`: listen
    with SO_REUSEPORT, so that several processes share the port (`serve --workers`).
    """

    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None
    allowed_origins: tuple[str, ...] | None = None
    limits: Limits = field(default_factory=Limits)
    max_frame_bytes: int | None = None
    queue_size: int = 256
    shutdown_timeout: float = 10.0
    viewer_token: str | None = None
    stream_keys: Mapping[str, str] = field(default_factory=dict)
    metrics_token: str | None = None
    connections: ConnectionCaps = field(default_factory=ConnectionCaps.derive)
    audio: AudioInput | None = None
    reuse_port: bool = False

    def __post_init__(self) -> None:
        self.credentials  # noqa: B018  (validates the secrets: ValueError)
        if self.max_frame_bytes is not None and self.max_frame_bytes < (
            self.limits.max_message_bytes
        ):
            raise ValueError("max_frame_bytes must be at least max_message_bytes")
        if self.queue_size < 1:
            raise ValueError("queue_size must be >= 1")

    @property
    def frame_limit(self) -> int:
        return self.max_frame_bytes or 4 * self.limits.max_message_bytes

    @property
    def credentials(self) -> Credentials:
        return Credentials(
            writer=self.token,
            viewer=self.viewer_token,
            stream_keys=self.stream_keys,
            metrics=self.metrics_token,
        )


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
            self._attach_state(engine)
        self.metrics = ServerMetrics.watching(lambda: self.engine)
        self.gate = ConnectionGate(self.options.connections)
        self.metrics.pending_handshakes.set_function(lambda: float(self.gate.pending))
        self.metrics.max_connections.set(self.options.connections.max_connections)
        self.audio = AudioService(self.options.audio) if self.options.audio is not None else None
        if self.audio is not None:
            self.metrics.registry.register(self.audio.collector)
        self._doors = Doors(self.gate, self.metrics)
        self._routes = HttpRoutes(
            self.state,
            self.metrics,
            credentials=self.options.credentials,
            allowed_origins=self.options.allowed_origins,
            doors=self._doors,
            takes_audio=self.audio is not None,
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
            create_connection=gated(self._doors),
            backlog=accept_burst(descriptor_limit()),
            # The gate drops a connection at the deadline; this is the library's backstop.
            open_timeout=self.options.connections.handshake_timeout + 1.0,
            reuse_port=self.options.reuse_port or None,
        )
        self._doors.guard(asyncio.get_running_loop(), self._server.sockets)
        if self.audio is not None:  # listening first: a port in use starts no process
            await self.audio.start()

    def attach(self, engine: IncrementalTranslator) -> None:
        """Start serving `engine` (running, i.e. inside its `async with`)."""
        if self.engine is not None:
            raise RuntimeError("an engine is already attached")
        self.engine = engine
        self._attach_state(engine)

    def _attach_state(self, engine: IncrementalTranslator) -> None:
        self.state.bus_ready = lambda: engine.ready
        self.state.close_code = 1012 if engine.bus.shared else 1001
        self.state.stream_terms = engine.terms
        self.state.attach(engine.languages, engine.targets.source_lang)

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
           open connections get an error (the listener stays up for health checks);
           audio streams end, their last utterances pushed as finals (within part of
           `shutdown_timeout`, then each ends with the words shown last: see
           `engine.server.shutdown`).
        2. Shut the engine down, so that accepted finals are translated.
        3. Flush every connection's outbox (within `shutdown_timeout`); each answers what
           it read meanwhile (`unavailable`), then sends its close frame (1001).
        4. Past the timeout, answer every accepted final not translated yet with an
           `unavailable` error; those replies and the close handshakes get
           `ABORT_GRACE` seconds.
        5. Close the listener; cut the connections whose client has not answered the
           close frame by then (`CLOSE_GRACE` after it, at the latest `ABORT_GRACE`
           past the timeout), so that the whole shutdown is bounded.
        6. Stop the recognition processes, if any (whatever happened before).
        """
        if not self.state.stop():
            await self._stopped.wait()
            return
        try:
            await shut_down(self.engine, self._clients, self._server, self.options.shutdown_timeout)
        finally:
            self._doors.unguard()
            if self.audio is not None:
                await self.audio.aclose()
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
        access = self._routes.access(ws.request) if ws.request is not None else None
        if access is None:  # refused at the handshake; only a race gets here
            await ws.close(1008, "unauthorized")
            return
        core = ConnectionCore(
            next(self._ids),
            self.options.limits,
            self.state,
            time.monotonic(),
            access,
            audio=self.audio.limits if self.audio is not None else None,
            address=client_key(ws.remote_address[0] if ws.remote_address else None),
        )
        client = Client(
            ws,
            core,
            Outbox(self.options.queue_size),
            engine,
            self.state,
            self.metrics,
            audio=self.audio,
        )
        self._clients.add(client)
        self.metrics.connections_accepted.inc()
        try:
            await client.serve()
        finally:
            self._clients.discard(client)
