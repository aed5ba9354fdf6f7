"""The server's per-connection rules, sans I/O: authorize, parse, rate-limit, route.

Nothing here touches a socket, a clock or the engine. The I/O layer (`app.py`) feeds in
what arrived (a handshake's path and headers, a frame, the current time) and carries out
the `Action` it gets back. Which connection owns which stream is not decided here: each
connection is an `Owner` to the engine, whose one state machine per stream
(`engine.streaming.lifecycle`) admits, refuses and releases; nothing is reported back.
Keeping the connection's own rules here makes every one of them testable without a model
or a network, in the manner of the `websockets` library's own sans-I/O core.

`ServerState` is the server's one record of whether it takes work, and the one place
that decides what a loading or stopping server refuses (handshakes, `/readyz`, messages).
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeAlias
from urllib.parse import parse_qs, urlsplit

import protocol
from engine.streaming.lifecycle import Owner
from engine.streaming.subscriptions import target_language
from protocol import (
    CloseStream,
    ErrorCode,
    ErrorMessage,
    InvalidEvent,
    Message,
    PartialTranscript,
    Subscribe,
)

WS_PATH = "/ws"


# --- options ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What one connection may do; `None` turns a limit off.

    `max_message_bytes` is the codec's limit: a larger message gets a `too_large` error
    and the connection goes on (the socket's own frame limit, above it, closes it).
    `rate_limit` is in messages per second with bursts of `rate_burst` (default: one
    second's worth, at least one message).
    """

    max_message_bytes: int = protocol.MAX_MESSAGE_BYTES
    max_text_chars: int = protocol.MAX_TEXT_CHARS
    max_streams_per_connection: int = 16
    rate_limit: float | None = 50.0
    rate_burst: float | None = None

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1:
            raise ValueError("max_message_bytes must be >= 1")
        if self.max_text_chars < 1:
            raise ValueError("max_text_chars must be >= 1")
        if self.max_streams_per_connection < 1:
            raise ValueError("max_streams_per_connection must be >= 1")
        if self.rate_limit is not None and not (
            math.isfinite(self.rate_limit) and self.rate_limit > 0
        ):
            raise ValueError("rate_limit must be a positive number of messages per second")
        if self.rate_burst is not None and not (
            math.isfinite(self.rate_burst) and self.rate_burst >= 1
        ):
            raise ValueError("rate_burst must be >= 1")


# --- handshake --------------------------------------------------------------------------


class Route(Enum):
    """What an HTTP request on the server's port asks for."""

    WEBSOCKET = "ws"
    PAGE = "page"
    STATIC = "static"
    HEALTHZ = "healthz"
    READYZ = "readyz"
    METRICS = "metrics"
    NOT_FOUND = "not_found"


_ROUTES = {
    WS_PATH: Route.WEBSOCKET,
    "/": Route.PAGE,
    "/index.html": Route.PAGE,
    "/healthz": Route.HEALTHZ,
    "/readyz": Route.READYZ,
    "/metrics": Route.METRICS,
}

STATIC_FILES: dict[str, str] = {
    "/subtitles.css": "text/css; charset=utf-8",
    "/subtitles.js": "text/javascript; charset=utf-8",
}
"""Assets the page loads, by path, with their content type (the page itself is `/`)."""


def route(path: str) -> Route:
    """Classify a request path (the query is ignored)."""
    bare = urlsplit(path).path
    if bare in STATIC_FILES:
        return Route.STATIC
    return _ROUTES.get(bare, Route.NOT_FOUND)


def request_path(path: str) -> str:
    """The path without its query, for logs: a query may carry the token."""
    return urlsplit(path).path


@dataclass(frozen=True)
class Refusal:
    """An HTTP refusal of a handshake: status, body and extra headers."""

    status: int
    reason: str
    headers: tuple[tuple[str, str], ...] = ()


# Headers the server decides on: a request carrying one of them twice is ambiguous (which
# token, which origin?), and proxies disagree on which copy wins, so it is refused.
SINGLE_HEADERS = ("Authorization", "Origin", "Accept")


def duplicate_headers(counts: Mapping[str, int]) -> Refusal | None:
    """A 400 when a header of `SINGLE_HEADERS` came more than once (`counts`: how many
    times each came), else `None`."""
    twice = [name for name in SINGLE_HEADERS if counts.get(name, 0) > 1]
    if not twice:
        return None
    return Refusal(400, f"Duplicate {', '.join(twice)} header: send it once.\n")


def presented_token(path: str, authorization: str | None) -> str | None:
    """The token a request carries: `Authorization: Bearer X`, else `?token=X`.

    The query form exists because browsers cannot set headers on a WebSocket.
    """
    if authorization is not None:
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            return credentials.strip()
    values = parse_qs(urlsplit(path).query).get("token")
    return values[0] if values else None


def token_matches(presented: str | None, expected: str) -> bool:
    """Constant-time comparison, so response timing does not leak the secret."""
    given = (presented or "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, expected.encode("utf-8"))


def check_handshake(
    path: str,
    authorization: str | None,
    origin: str | None,
    *,
    token: str | None,
    allowed_origins: frozenset[str] | None,
) -> Refusal | None:
    """Decide whether a WebSocket handshake may proceed; `None` means yes.

    Origin is checked only when an allowlist is set and a browser sent one: a speech
    pipeline sends no Origin and is held to the token instead. Authentication comes
    first, so an unauthenticated client learns nothing about the allowlist.
    """
    if token is not None and not token_matches(presented_token(path, authorization), token):
        return Refusal(401, "Missing or wrong token.\n", (("WWW-Authenticate", "Bearer"),))
    if allowed_origins is not None and origin is not None and origin not in allowed_origins:
        return Refusal(403, "Origin not allowed.\n")
    return None


# --- rate limiting ----------------------------------------------------------------------


class TokenBucket:
    """Allow `rate` events per second on average, with bursts of up to `burst`."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.updated = now

    def take(self, now: float) -> bool:
        """Spend one token if there is one; the time may only move forward."""
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


# --- server state -------------------------------------------------------------------------


class ServerPhase(Enum):
    """Where the server is in its life."""

    LOADING = "loading"  # no model yet: health checks answer, /readyz and /ws do not
    READY = "ready"
    STOPPING = "stopping"  # a shutdown began: nothing new is taken, from then on


@dataclass
class ServerState:
    """What every connection of a server shares: its phase, the one record of whether it
    takes work, and the target languages it translates into, the default (first) one
    first (empty until a model is loaded). Every refusal that a server loading or
    stopping sends is decided here."""

    phase: ServerPhase = ServerPhase.LOADING
    languages: tuple[str, ...] = ()

    def attach(self, languages: Iterable[str]) -> None:
        """A model is loaded: ready, unless a shutdown began meanwhile."""
        self.languages = tuple(languages)
        if self.phase is ServerPhase.LOADING:
            self.phase = ServerPhase.READY

    def stop(self) -> bool:
        """Begin stopping; False when the server was stopping already."""
        if self.phase is ServerPhase.STOPPING:
            return False
        self.phase = ServerPhase.STOPPING
        return True

    @property
    def ready(self) -> bool:
        """Model loaded and not stopping: what `/readyz` reports."""
        return self.phase is ServerPhase.READY

    @property
    def stopping(self) -> bool:
        return self.phase is ServerPhase.STOPPING

    def readyz(self) -> tuple[int, str]:
        """`/readyz`'s status and body."""
        if self.ready:
            return 200, "ready\n"
        why = "shutting down" if self.stopping else "model loading"
        return 503, f"not ready: {why}\n"

    def handshake_refusal(self) -> Refusal | None:
        """A 503 for a WebSocket handshake while not ready, else None."""
        if self.ready:
            return None
        why = "the server is shutting down" if self.stopping else "the model is loading"
        return Refusal(503, f"Not ready: {why}.\n")

    def shutting_down(self, context: Message | None = None) -> ErrorMessage:
        """The reply to a message that a stopping server (or its closed engine) refuses."""
        return _error(
            ErrorCode.UNAVAILABLE,
            "the server is shutting down and takes no new messages",
            context=context,
        )


# --- actions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """Send this error back; the message that caused it is dropped. `about_final`: the
    message was a final transcript, whose reply must never be dropped (every final gets
    exactly one reply)."""

    error: ErrorMessage
    about_final: bool = False


@dataclass(frozen=True)
class Push:
    """Hand the event to the engine as this connection's (`ConnectionCore.owner`); the
    engine's lifecycle admits it or says why not (ownership, order, limits, text)."""

    event: PartialTranscript


@dataclass(frozen=True)
class Close:
    """Ask the engine to close the stream as this connection's; it refuses a stream that
    is not this connection's or not open."""

    stream_id: str


@dataclass(frozen=True)
class Watch:
    """Subscribe this (viewer) connection to the stream's updates in language `lang`
    (None only while the server knows no languages: then every one)."""

    stream_id: str
    lang: str | None = None


@dataclass(frozen=True)
class Ignore:
    """Nothing to do (e.g. a repeated subscribe)."""


Action: TypeAlias = Reply | Push | Close | Watch | Ignore


_MESSAGE_TYPES: dict[type, str] = {
    PartialTranscript: "partial_transcript",
    CloseStream: "close_stream",
    Subscribe: "subscribe",
}
"""The metrics' name of each message type a client may send."""


class Role(Enum):
    """A connection writes (pushes partials) or views (subscribes); never both, so that a
    subtitle screen can never inject text and a pipeline never gets duplicate updates."""

    UNDECIDED = "undecided"
    WRITER = "writer"
    VIEWER = "viewer"


def _error(
    code: ErrorCode, message: str, *, field: str | None = None, context: Message | None = None
) -> ErrorMessage:
    stream_id = getattr(context, "stream_id", None)
    seq = getattr(context, "seq", None)
    return ErrorMessage(code, message, field, stream_id, seq)


@dataclass
class ConnectionCore:
    """One WebSocket connection's state and rules.

    `receive` turns each incoming frame into one `Action`. `message_type` after a call
    names what the frame was (`partial_transcript`, ..., or `invalid`), for metrics.
    """

    connection_id: int
    limits: Limits
    server: ServerState
    now: float = 0.0
    role: Role = Role.UNDECIDED
    watched: set[tuple[str, str | None]] = field(default_factory=set)  # (stream, language)
    message_type: str = "invalid"
    _bucket: TokenBucket | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.owner = Owner(
            f"connection {self.connection_id}", self.limits.max_streams_per_connection
        )
        rate = self.limits.rate_limit
        if rate is not None:
            burst = self.limits.rate_burst or max(1.0, rate)
            self._bucket = TokenBucket(rate, burst, self.now)

    # -- input ------------------------------------------------------------------------

    def receive(self, data: str | bytes, now: float) -> Action:
        """Decide what to do with one frame received at `now` (seconds, monotonic)."""
        self.message_type = "invalid"
        allowed = self._bucket is None or self._bucket.take(now)
        if isinstance(data, str):
            message = protocol.parse(
                data,
                max_bytes=self.limits.max_message_bytes,
                max_text_chars=self.limits.max_text_chars,
                accept=protocol.TO_ENGINE_TYPES,
            )
        else:
            message = _error(
                ErrorCode.INVALID_MESSAGE,
                "binary frames are not accepted: send each message as a JSON text frame",
            )
        final = isinstance(message, PartialTranscript) and message.is_final
        if not allowed:
            return Reply(
                _error(
                    ErrorCode.RATE_LIMITED,
                    f"more than {self.limits.rate_limit:g} messages per second on this "
                    "connection; message dropped",
                    context=message,
                ),
                about_final=final,
            )
        if isinstance(message, ErrorMessage):
            return Reply(message)
        # parse(accept=TO_ENGINE_TYPES) returns nothing else.
        self.message_type = _MESSAGE_TYPES[type(message)]
        if self.server.stopping:
            return Reply(self.server.shutting_down(message), about_final=final)
        if isinstance(message, PartialTranscript):
            action = self._partial(message)
            return Reply(action.error, about_final=final) if isinstance(action, Reply) else action
        if isinstance(message, CloseStream):
            return Close(message.stream_id)
        assert isinstance(message, Subscribe)
        return self._subscribe(message)

    def _partial(self, event: PartialTranscript) -> Action:
        if self.role is Role.VIEWER:
            return Reply(
                _error(
                    ErrorCode.FORBIDDEN,
                    "this connection is a viewer (it subscribed); push from another connection",
                    context=event,
                )
            )
        self.role = Role.WRITER
        return Push(event)

    def _subscribe(self, message: Subscribe) -> Action:
        if self.role is Role.WRITER:
            return Reply(
                _error(
                    ErrorCode.FORBIDDEN,
                    "this connection writes streams and already receives their updates; "
                    "subscribe from another connection",
                    context=message,
                )
            )
        sid = message.stream_id
        # A viewer shows one language: without `lang`, the server's default (first) one,
        # so a viewer written before fan-out never gets two languages mixed in one feed.
        languages = self.server.languages
        lang = message.lang if message.lang is not None or not languages else languages[0]
        if lang is not None and languages:
            try:
                lang = target_language(lang, languages, sid)
            except InvalidEvent as exc:
                return Reply(exc.error)
        if (sid, lang) in self.watched:
            return Ignore()
        if len(self.watched) >= self.limits.max_streams_per_connection:
            return Reply(
                _error(
                    ErrorCode.LIMIT_EXCEEDED,
                    "too many subscriptions on this connection "
                    f"(limit {self.limits.max_streams_per_connection})",
                    field="stream_id",
                    context=message,
                )
            )
        self.role = Role.VIEWER
        self.watched.add((sid, lang))
        return Watch(sid, lang)
