"""Plain HTTP on the server's port: the subtitle, transcript and speaker pages and their
assets, what the server offers (`/info`), health, readiness, metrics, and the gate in front
of a WebSocket handshake.

Everything here answers from the request alone (and the server's state and metrics;
`/terms` asks the engine, which may ask the update bus); it runs inside the `websockets`
handshake hook, so a request is answered before any WebSocket exists and a refused
handshake never reaches the connection code.
"""

from __future__ import annotations

import http
import json
from collections.abc import Awaitable, Iterable
from importlib.resources import files
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from engine.server.connection import AUDIO_OFF
from engine.server.credentials import UNAUTHORIZED, Access, Credentials, authorize, presented_token
from engine.server.doors import Doors
from engine.server.handshake import (
    PAGES,
    SINGLE_HEADERS,
    STATIC_FILES,
    Refusal,
    Route,
    duplicate_headers,
    request_path,
    route,
)
from engine.server.metrics import ServerMetrics
from engine.server.state import ServerState
from protocol import InvalidEvent
from protocol.messages import MAX_STREAM_ID_CHARS

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

_NO_CACHE = (("Cache-Control", "no-cache"),)  # what `/info` and `/terms` say changes

_PAGE_EXTRA: dict[Route, tuple[tuple[str, str], ...]] = {
    # The speaker page asks for the microphone: this origin may, no frame of another may.
    Route.SPEAK: (("Permissions-Policy", "microphone=(self)"),),
}


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


class HttpRoutes:
    """The `process_request` hook of the server: a `Response` for every plain HTTP
    request and every refused handshake, None to let a WebSocket handshake go on.

    `credentials`: who may write, watch and read `/metrics`; `allowed_origins`: browser
    origins allowed to open `/ws` (None: any); `doors`: the caps on connections that a
    WebSocket handshake passes last (None: none); `takes_audio`: the server recognizes
    audio (`/info` says so, for the speaker page to know before it asks for a microphone).
    """

    def __init__(
        self,
        state: ServerState,
        metrics: ServerMetrics,
        *,
        credentials: Credentials,
        allowed_origins: Iterable[str] | None,
        doors: Doors | None = None,
        takes_audio: bool = False,
    ) -> None:
        self.state = state
        self.takes_audio = takes_audio
        self.metrics = metrics
        self.credentials = credentials
        self.doors = doors
        self.allowed_origins = frozenset(allowed_origins) if allowed_origins is not None else None
        # Read once: the pages and their assets are part of the package.
        self._pages = {kind: _static(name) for kind, name in PAGES.items()}
        self._assets = {path: _static(path.lstrip("/")) for path in STATIC_FILES}

    def __call__(
        self, ws: ServerConnection, request: Request
    ) -> Response | Awaitable[Response] | None:
        counts = {name: len(request.headers.get_all(name)) for name in SINGLE_HEADERS}
        refusal = duplicate_headers(counts)
        if refusal is not None:
            self.metrics.handshakes_refused.labels(str(refusal.status)).inc()
            return _text(refusal.status, refusal.reason, refusal.headers)
        kind = route(request.path)
        if kind is Route.WEBSOCKET:
            return self._handshake(ws, request)
        if kind in self._pages:
            page = self._pages[kind]
            headers = _PAGE_HEADERS + _PAGE_EXTRA.get(kind, ())
            return _response(200, page, "text/html; charset=utf-8", headers)
        if kind is Route.STATIC:
            path = request_path(request.path)
            return _response(200, self._assets[path], STATIC_FILES[path], _PAGE_HEADERS)
        if kind is Route.INFO:
            return _response(200, self.info(), "application/json", _NO_CACHE)
        if kind is Route.TERMS:
            return self.terms(request)
        if kind is Route.HEALTHZ:
            return _text(200, "ok\n")
        if kind is Route.READYZ:
            return _text(*self.state.readyz())
        if kind is Route.METRICS:
            presented = presented_token(request.path, request.headers.get("Authorization"))
            if not self.credentials.metrics_allowed(presented):
                return _text(UNAUTHORIZED.status, UNAUTHORIZED.reason, UNAUTHORIZED.headers)
            body, content_type = self.metrics.render(request.headers.get("Accept"))
            return _response(200, body, content_type)
        return _text(404, "Not found.\n")

    def info(self) -> bytes:
        """`/info`: what a client may ask of this server before it connects: the target
        languages (the default first; empty while loading), the models' source language
        (`source`, when known: a glossary's header names it, so the speaker page can
        write one) and whether it takes audio, with what to do instead when it does not
        (`no_audio`, the reply `start_audio` would get). Nothing in it is secret: it needs
        no token."""
        body: dict[str, object] = {"languages": list(self.state.languages)}
        if self.state.source_language:
            body["source"] = self.state.source_language
        body["audio"] = self.takes_audio
        if not self.takes_audio:
            body["no_audio"] = AUDIO_OFF
        return json.dumps(body).encode("utf-8")

    async def terms(self, request: Request) -> Response:
        """`/terms?stream=ID`: a stream's glossary terms over its finals so far, per
        target language, matched and placed (`/metrics` sums every stream's: a series
        per stream id would grow without bound). Whoever may watch the stream may ask
        (the viewer token, the writer's, or its key), on any node: the node holding its
        writer counts them and keeps them on the update bus, where the others read them
        (the one request here that waits, on the bus). 404 for a stream no node has
        open; 503 when the bus cannot be reached."""
        presented = presented_token(request.path, request.headers.get("Authorization"))
        access = self.credentials.access(presented)
        values = parse_qs(urlsplit(request.path).query).get("stream", [])
        if len(values) != 1 or not 0 < len(values[0]) <= MAX_STREAM_ID_CHARS:
            return _text(400, "Give one stream id: /terms?stream=ID.\n")
        stream_id = values[0]
        if access is None or not access.may_view(stream_id):
            return _text(UNAUTHORIZED.status, UNAUTHORIZED.reason, UNAUTHORIZED.headers)
        try:
            counts = await self.state.stream_terms(stream_id) if self.state.stream_terms else {}
        except InvalidEvent as exc:
            return _text(503, f"Cannot read the stream's counts: {exc.error.message}.\n")
        if not counts:
            return _text(404, f"Stream {stream_id!r} is not open on any server node.\n")
        body = {
            "stream_id": stream_id,
            "terms": {
                lang: {"matched": matched, "placed": placed}
                for lang, (matched, placed) in counts.items()
            },
        }
        return _response(200, json.dumps(body).encode("utf-8"), "application/json", _NO_CACHE)

    def access(self, request: Request) -> Access | None:
        """What the connection of an accepted handshake may do (its credential's rights)."""
        presented = presented_token(request.path, request.headers.get("Authorization"))
        return self.credentials.access(presented)

    def _handshake(self, ws: ServerConnection, request: Request) -> Response | None:
        verdict = authorize(
            request.path,
            request.headers.get("Authorization"),
            request.headers.get("Origin"),
            credentials=self.credentials,
            allowed_origins=self.allowed_origins,
        )
        refusal = verdict if isinstance(verdict, Refusal) else self.state.handshake_refusal()
        if refusal is None and self.doors is not None:
            refusal = self.doors.admit(ws)  # last: only a connection that may come in counts
        if refusal is None:
            return None  # websockets goes on with the handshake (426 if it is not one)
        self.metrics.handshakes_refused.labels(str(refusal.status)).inc()
        return _text(refusal.status, refusal.reason, refusal.headers)
