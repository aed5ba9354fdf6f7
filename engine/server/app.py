"""The live-subtitle server: a thin asyncio layer over `IncrementalTranslator`.

One port serves the WebSocket endpoint `/ws` (partials in, translation updates out), the
subtitle page `/` and `/healthz`, `/readyz`, `/metrics` (plain HTTP through the
`websockets` handshake hook). The rules live in `connection.py`; this module only moves
bytes and awaits: per connection, one task receives and one task sends, and the engine
hands updates to a bounded `Outbox` without ever waiting on a socket.
"""

from __future__ import annotations

import functools
import http
import itertools
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.resources import files
from types import TracebackType

import anyio
import anyio.abc
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

import protocol
from engine.server.connection import (
    SINGLE_HEADERS,
    STATIC_FILES,
    Close,
    ConnectionCore,
    Ignore,
    Limits,
    Push,
    Refusal,
    Reply,
    Role,
    Route,
    ServerState,
    Watch,
    check_handshake,
    duplicate_headers,
    presented_token,
    request_path,
    route,
    token_matches,
)
from engine.server.metrics import ServerMetrics
from engine.server.outbox import Outbox
from engine.streaming.controller import IncrementalTranslator, Subscription
from protocol import EngineClosed, ErrorCode, ErrorMessage, InvalidEvent, TranslationUpdate

log = logging.getLogger(__name__)

# An update goes to its writer and to every viewer of the stream: encode it once. Updates
# are frozen (hashable) and the cache holds the last few thousand, far more than are ever
# in flight at once.
_encoded = functools.lru_cache(maxsize=4096)(protocol.serialize)

ABORT_GRACE = 2.0
"""Seconds past the shutdown timeout for the `unavailable` replies to reach their clients."""

_PAGE_HEADERS = (
    # The page needs nothing but itself and a WebSocket back to this server.
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'",
    ),
    # The page URL may carry the token: never send it on in a Referer.
    ("Referrer-Policy", "no-referrer"),
    ("X-Content-Type-Options", "nosniff"),
    ("Cache-Control", "no-cache"),
)


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


@dataclass(eq=False)
class _Client:
    """The I/O side of one connection."""

    ws: ServerConnection
    core: ConnectionCore
    outbox: Outbox
    io: anyio.abc.TaskGroup | None = None
    subscriptions: set[Subscription] = field(default_factory=set)
    writes: Subscription | None = None  # the replies of the streams it writes
    pumps: int = 0
    gone: bool = False
    sent: anyio.Event = field(default_factory=anyio.Event)
    role: Role = Role.UNDECIDED


def _static(name: str) -> bytes:
    return files("engine.server").joinpath("static", name).read_bytes()


def _response(
    status: int, body: bytes, content_type: str, headers: Iterable[tuple[str, str]] = ()
) -> Response:
    h = Headers([("Content-Type", content_type), ("Content-Length", str(len(body)))])
    for name, value in headers:
        h[name] = value
    return Response(status, http.HTTPStatus(status).phrase, h, body)


def _text(status: int, text: str, headers: Iterable[tuple[str, str]] = ()) -> Response:
    return _response(status, text.encode("utf-8"), "text/plain; charset=utf-8", headers)


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
            self.state.languages = tuple(engine.languages)
        self.metrics = ServerMetrics(
            open_streams=lambda: len(self.engine.streams) if self.engine else 0,
            engine_stats=lambda: self.engine.stats if self.engine else None,
            scheduler_stats=self._scheduler_stats,
            models=self._models,
        )
        self._allowed = (
            frozenset(self.options.allowed_origins)
            if self.options.allowed_origins is not None
            else None
        )
        self._assets = {"/": _static("index.html")} | {
            path: _static(path.lstrip("/")) for path in STATIC_FILES
        }
        self._ids = itertools.count(1)
        self._clients: set[_Client] = set()
        self._server: Server | None = None
        self._stopping = False
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
            process_request=self._process_request,
            max_size=self.options.frame_limit,
            compression=None,  # short messages: not worth per-connection zlib state
        )

    def attach(self, engine: IncrementalTranslator) -> None:
        """Start serving `engine` (running, i.e. inside its `async with`)."""
        if self.engine is not None:
            raise RuntimeError("an engine is already attached")
        self.state.languages = tuple(engine.languages)
        self.engine = engine

    def _scheduler_stats(self) -> dict[str, Counter[str]] | None:
        """Each model's decode scheduler counters, by target language."""
        if self.engine is None:
            return None
        return {lang: t.scheduler.stats for lang, t in self.engine.targets.items()}

    def _models(self) -> list[dict[str, str]]:
        """What `nmt_model_info` says about each loaded model, default language first."""
        if self.engine is None:
            return []
        targets = self.engine.targets
        return [
            {
                "lang": lang,
                "source_lang": t.config.source_lang or "",
                "model": str(t.model.model_dir),
                "batching": t.scheduler.batching,
                "default": str(lang == targets.default).lower(),
            }
            for lang, t in targets.items()
        ]

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
        return self.engine is not None and not self._stopping

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
        2. Close every stream in the engine, so that accepted finals are translated.
        3. Flush every connection's outbox (within `shutdown_timeout`).
        4. Past the timeout, answer every accepted final not translated yet with an
           `unavailable` error and give those replies `ABORT_GRACE` seconds to go out.
        5. Close the connections with 1001 (going away) and the listener.
        """
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        self.state.accepting = False
        try:
            with anyio.move_on_after(self.options.shutdown_timeout) as deadline:
                await self._drain()
            engine = self.engine
            if deadline.cancelled_caught and engine is not None:
                answered = engine.abort(
                    "the server shut down before this final transcript could be translated"
                )
                log.info("shutdown timeout: %d finals answered as unavailable", answered)
                with anyio.move_on_after(ABORT_GRACE):
                    await self._flush()
        finally:
            if self._server is not None:
                self._server.close()  # code 1001
                with anyio.move_on_after(self.options.shutdown_timeout):
                    await self._server.wait_closed()
            self._stopped.set()

    async def _drain(self) -> None:
        engine = self.engine
        if engine is not None:
            # Every stream closes; its accepted finals are translated and delivered, then
            # every subscription (writers' and viewers') ends.
            await engine.aclose()
        await self._flush()

    async def _flush(self) -> None:
        """Close every outbox once its subscriptions have ended; wait until all is sent."""
        for client in list(self._clients):
            if client.pumps == 0:
                client.outbox.close()
        for client in list(self._clients):
            await client.sent.wait()

    async def __aenter__(self) -> SubtitleServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self.shutdown()

    # -- HTTP -----------------------------------------------------------------------

    def _process_request(self, ws: ServerConnection, request: Request) -> Response | None:
        counts = {name: len(request.headers.get_all(name)) for name in SINGLE_HEADERS}
        refusal = duplicate_headers(counts)
        if refusal is not None:
            self.metrics.handshakes_refused.labels(str(refusal.status)).inc()
            return _text(refusal.status, refusal.reason, refusal.headers)
        kind = route(request.path)
        if kind is Route.WEBSOCKET:
            return self._handshake(request)
        if kind is Route.PAGE or kind is Route.STATIC:
            path = "/" if kind is Route.PAGE else request_path(request.path)
            content_type = STATIC_FILES.get(path, "text/html; charset=utf-8")
            return _response(200, self._assets[path], content_type, _PAGE_HEADERS)
        if kind is Route.HEALTHZ:
            return _text(200, "ok\n")
        if kind is Route.READYZ:
            if self.ready:
                return _text(200, "ready\n")
            why = "shutting down" if self._stopping else "model loading"
            return _text(503, f"not ready: {why}\n")
        if kind is Route.METRICS:
            token = self.options.token
            if token is not None and not token_matches(
                presented_token(request.path, request.headers.get("Authorization")), token
            ):
                return _text(401, "Missing or wrong token.\n", [("WWW-Authenticate", "Bearer")])
            body, content_type = self.metrics.render(request.headers.get("Accept"))
            return _response(200, body, content_type)
        return _text(404, "Not found.\n")

    def _handshake(self, request: Request) -> Response | None:
        refusal = check_handshake(
            request.path,
            request.headers.get("Authorization"),
            request.headers.get("Origin"),
            token=self.options.token,
            allowed_origins=self._allowed,
        )
        if refusal is None and not self.ready:
            why = "the server is shutting down" if self._stopping else "the model is loading"
            refusal = Refusal(503, f"Not ready: {why}.\n")
        if refusal is None:
            return None  # websockets goes on with the handshake (426 if it is not one)
        self.metrics.handshakes_refused.labels(str(refusal.status)).inc()
        return _text(refusal.status, refusal.reason, refusal.headers)

    # -- WebSocket ------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        engine = self.engine
        if engine is None:  # refused at the handshake; only a race with attach() gets here
            await ws.close(1013, "not ready")
            return
        core = ConnectionCore(next(self._ids), self.options.limits, self.state, time.monotonic())
        client = _Client(ws, core, Outbox(self.options.queue_size))
        self._clients.add(client)
        self.metrics.connections_accepted.inc()
        self.metrics.connections.labels(client.role.value).inc()
        try:
            async with anyio.create_task_group() as io:
                client.io = io
                io.start_soon(self._send_loop, client)
                try:
                    await self._receive_loop(client, engine)
                finally:
                    # Gone mid-stream: its streams close (viewers still get the finals
                    # it sent) and free their slots; stop sending to it.
                    client.gone = True
                    engine.owner_left(core.owner)
                    for sub in list(client.subscriptions):
                        engine.unsubscribe(sub)
                    io.cancel_scope.cancel()
        finally:
            self._clients.discard(client)
            client.sent.set()
            self.metrics.connections.labels(client.role.value).dec()

    def _track_role(self, client: _Client) -> None:
        if client.role is not client.core.role:
            self.metrics.connections.labels(client.role.value).dec()
            client.role = client.core.role
            self.metrics.connections.labels(client.role.value).inc()

    async def _receive_loop(self, client: _Client, engine: IncrementalTranslator) -> None:
        try:
            async for data in client.ws:
                action = client.core.receive(data, time.monotonic())
                self.metrics.messages_in.labels(client.core.message_type).inc()
                self._track_role(client)
                if isinstance(action, Reply):
                    self._reply(client, action.error, action.about_final)
                elif isinstance(action, Push):
                    await self._push(client, engine, action)
                elif isinstance(action, Close):
                    try:
                        engine.begin_close(action.stream_id, client.core.owner)
                    except InvalidEvent as exc:
                        self._reply(client, exc.error)
                elif isinstance(action, Watch):
                    assert client.io is not None
                    client.io.start_soon(self._view, client, engine, action.stream_id, action.lang)
                else:
                    assert isinstance(action, Ignore)
        except ConnectionClosed:
            pass

    async def _push(self, client: _Client, engine: IncrementalTranslator, action: Push) -> None:
        event = action.event
        if client.writes is None:  # subscribe before the first push: nothing is missed
            client.writes = engine.updates(owner=client.core.owner)
            self._start_forward(client, client.writes, owner=True)
        try:
            await engine.push(event, client.core.owner)
        except InvalidEvent as exc:
            self._reply(client, exc.error, event.is_final)
        except EngineClosed:
            error = ErrorMessage(
                ErrorCode.UNAVAILABLE,
                "the server is shutting down and takes no new messages",
                stream_id=event.stream_id,
                seq=event.seq,
            )
            self._reply(client, error, event.is_final)

    async def _view(
        self, client: _Client, engine: IncrementalTranslator, stream_id: str, lang: str | None
    ) -> None:
        """Follow a stream in one language for a viewer, across restarts of the stream: a
        subtitle screen outlives the pipeline connection that feeds it."""
        while not (self._stopping or client.gone):
            sub = engine.updates(stream_id, lang=lang)
            self._adopt(client, sub)
            got = await self._forward(client, sub, False)
            if not got and stream_id not in engine.streams:
                await anyio.sleep(0.1)  # never spin on a subscription that ends at once

    @staticmethod
    def _adopt(client: _Client, sub: Subscription) -> None:
        # Counted from the moment it exists, so a shutdown never closes the outbox while
        # a forwarder is still to start.
        client.pumps += 1
        client.subscriptions.add(sub)

    def _start_forward(self, client: _Client, sub: Subscription, owner: bool) -> None:
        self._adopt(client, sub)
        assert client.io is not None
        client.io.start_soon(self._forward, client, sub, owner)

    async def _forward(self, client: _Client, sub: Subscription, owner: bool) -> int:
        """Move an adopted subscription's updates into the outbox as they come; returns
        how many. The owner's forwarder is the one place each update passes exactly
        once, so it records the engine latency."""
        count = 0
        try:
            async for update in sub:
                count += 1
                if isinstance(update, ErrorMessage):  # in place of a final's update
                    if owner:
                        self._reply(client, update, about_final=True)
                    continue
                if owner:
                    lang = update.lang or ""
                    self.metrics.update_latency.labels(lang).observe(update.latency_ms / 1000.0)
                before = client.outbox.dropped_updates
                client.outbox.put_update(update)
                if client.outbox.dropped_updates > before:
                    self.metrics.dropped_updates.inc()
        finally:
            client.subscriptions.discard(sub)
            engine = self.engine
            if engine is not None:
                engine.unsubscribe(sub)  # a no-op unless this task was cancelled
            if sub.dropped:
                self.metrics.dropped_updates.inc(sub.dropped)
            client.pumps -= 1
            if self._stopping and client.pumps == 0:
                client.outbox.close()
        return count

    def _reply(self, client: _Client, error: ErrorMessage, about_final: bool = False) -> None:
        self.metrics.errors.labels(error.code).inc()
        if client.outbox.put_error(error, keep=about_final):
            return
        self.metrics.dropped_errors.inc()
        if about_final and not client.outbox.closed:
            # Finals it cannot be told about: a client that sends and never reads.
            cid = client.core.connection_id
            log.warning("closing connection %d: it does not read its replies", cid)
            assert client.io is not None
            client.io.start_soon(client.ws.close, 1008, "not reading replies")

    async def _send_loop(self, client: _Client) -> None:
        """The only task that awaits this client's socket."""
        try:
            while (item := await client.outbox.get()) is not None:
                await client.ws.send(_encoded(item))
                kind = "translation_update" if isinstance(item, TranslationUpdate) else "error"
                self.metrics.messages_out.labels(kind).inc()
        except ConnectionClosed:
            pass
        finally:
            client.sent.set()
