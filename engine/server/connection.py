"""The server's per-connection rules, sans I/O: authorize, parse, rate-limit, route.

Nothing here touches a socket, a clock or the engine. The I/O layer (`app.py`) feeds in
what arrived (a handshake's path and headers, a frame, the current time) and carries out
the `Action` it gets back. Which connection owns which stream is not decided here: each
connection is an `Owner` to the engine, whose one state machine per stream
(`engine.streaming.lifecycle`) admits, refuses and releases; nothing is reported back.
Keeping the connection's own rules here makes every one of them testable without a model
or a network, in the manner of the `websockets` library's own sans-I/O core.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeAlias
from urllib.parse import parse_qs, urlsplit

import protocol
from engine.languages import match_lang
from engine.streaming.lifecycle import Owner
from protocol import (
    CloseStream,
    ErrorCode,
    ErrorMessage,
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


@dataclass
class ServerState:
    """What every connection of a server shares: whether it still takes work (false from
    the start of a shutdown), and the target languages it translates into, the default
    (first) one first (empty until a model is loaded)."""

    accepting: bool = True
    languages: tuple[str, ...] = ()


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
        if isinstance(message, PartialTranscript):
            self.message_type = "partial_transcript"
            action = self._partial(message)
            return Reply(action.error, about_final=final) if isinstance(action, Reply) else action
        if isinstance(message, CloseStream):
            self.message_type = "close_stream"
            return self._close(message)
        if isinstance(message, Subscribe):
            self.message_type = "subscribe"
            return self._subscribe(message)
        # decode(accept=TO_ENGINE_TYPES) returns nothing else.
        raise AssertionError(f"unexpected message {type(message).__name__}")

    def _shutting_down(self, message: PartialTranscript | CloseStream | Subscribe) -> Reply:
        return Reply(
            _error(
                ErrorCode.UNAVAILABLE,
                "the server is shutting down and takes no new messages",
                context=message,
            )
        )

    def _partial(self, event: PartialTranscript) -> Action:
        if not self.server.accepting:
            return self._shutting_down(event)
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

    def _close(self, message: CloseStream) -> Action:
        if not self.server.accepting:
            return self._shutting_down(message)
        return Close(message.stream_id)

    def _subscribe(self, message: Subscribe) -> Action:
        if not self.server.accepting:
            return self._shutting_down(message)
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
            lang = match_lang(lang, languages)
            if lang is None:
                return Reply(
                    _error(
                        ErrorCode.INVALID_MESSAGE,
                        f"no translation into {message.lang!r} here; languages: "
                        + ", ".join(languages),
                        field="lang",
                        context=message,
                    )
                )
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
