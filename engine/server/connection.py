"""The server's per-connection rules, sans I/O: authorize, parse, rate-limit, route.

Who may do what is decided once, at the handshake: `Credentials` (the server's secrets)
turn the token a client presents into its `Access` (write every stream, one stream,
watch), and the core checks every message against it, so a viewer's credential never
writes, closes or takes over a stream whatever it sends.

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeAlias
from urllib.parse import parse_qs, urlsplit

import protocol
from engine.languages import base_lang
from engine.streaming.lifecycle import Owner
from engine.streaming.subscriptions import target_language
from protocol import (
    CloseStream,
    EndAudio,
    ErrorCode,
    ErrorMessage,
    InvalidEvent,
    InvalidMessage,
    Message,
    PartialTranscript,
    StartAudio,
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

    max_message_bytes: int = protocol.codec.MAX_MESSAGE_BYTES
    max_text_chars: int = protocol.codec.MAX_TEXT_CHARS
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


@dataclass(frozen=True)
class AudioLimits:
    """Audio over the WebSocket as a connection's rules see it (`ConnectionCore.audio`;
    None: the server takes no audio).

    `max_speed`: audio may arrive at most this many times faster than real time,
    sustained; beyond that `burst_s` seconds of it may come at once (a browser that
    buffered through a network stall, a client starting with what it recorded so far).
    Past that the excess is dropped, with one `rate_limited` error per burst: a client
    pushing a file as fast as it can would queue minutes of recognition and make every
    stream's translations late. `max_streams`: audio streams at once on the whole server
    (each holds a recognizer and a worker thread). `language`: the base code of the
    language its recognizer hears, which a `start_audio`'s `lang` must name (None: any).
    """

    max_speed: float = 2.0
    burst_s: float = 6.0
    max_streams: int = 32
    language: str | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_speed) and self.max_speed >= 1.0):
            raise ValueError("max_speed must be at least 1 (real time)")
        if not (math.isfinite(self.burst_s) and self.burst_s > 0):
            raise ValueError("burst_s must be a positive number of seconds")
        if self.max_streams < 1:
            raise ValueError("max_streams must be >= 1")


AUDIO_OFF = (
    "this server takes no audio: start it with `nmt-incremental serve --asr pocketsphinx` "
    "(needs pip install -e '.[asr]'), or run a recognizer of your own and send what it "
    "hears as partial_transcript messages"
)
"""The reply to `start_audio` (and to binary frames) on a server started without a
recognizer: what to do instead."""


# --- handshake --------------------------------------------------------------------------


class Route(Enum):
    """What an HTTP request on the server's port asks for."""

    WEBSOCKET = "ws"
    PAGE = "page"
    TRANSCRIPT = "transcript"
    SPEAK = "speak"
    STATIC = "static"
    HEALTHZ = "healthz"
    READYZ = "readyz"
    METRICS = "metrics"
    NOT_FOUND = "not_found"


_ROUTES = {
    WS_PATH: Route.WEBSOCKET,
    "/": Route.PAGE,
    "/index.html": Route.PAGE,
    "/transcript": Route.TRANSCRIPT,
    "/speak": Route.SPEAK,
    "/healthz": Route.HEALTHZ,
    "/readyz": Route.READYZ,
    "/metrics": Route.METRICS,
}

PAGES: dict[Route, str] = {
    Route.PAGE: "index.html",
    Route.TRANSCRIPT: "transcript.html",
    Route.SPEAK: "speak.html",
}
"""The HTML file in `static/` of each page route (served as text/html)."""

STATIC_FILES: dict[str, str] = {
    "/subtitles.css": "text/css; charset=utf-8",
    "/subtitles.js": "text/javascript; charset=utf-8",
    "/transcript.css": "text/css; charset=utf-8",
    "/transcript.js": "text/javascript; charset=utf-8",
    "/speak.css": "text/css; charset=utf-8",
    "/speak.js": "text/javascript; charset=utf-8",
    "/pcm-worklet.js": "text/javascript; charset=utf-8",
}
"""Assets the pages load, by path, with their content type (the pages are `PAGES`)."""


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
    """An HTTP refusal of a handshake: status, body and extra headers; `counted_as`: the
    reason `/metrics` counts it under among refused connections (caps), if any."""

    status: int
    reason: str
    headers: tuple[tuple[str, str], ...] = ()
    counted_as: str | None = None


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


# --- roles --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Access:
    """What one connection may do, from the credential its handshake presented.

    `credential` names it (`writer`, `stream_key`, `viewer`, `none`). `write`: streams
    without a key of their own; `write_keyed`: those with one too (the writer token);
    `keys`: the streams whose key it presented; `keyed`: every stream that has a key.
    The default may do everything a server without secrets allows.
    """

    credential: str = "none"
    view: bool = True
    write: bool = True
    write_keyed: bool = False
    keys: frozenset[str] = frozenset()
    keyed: frozenset[str] = frozenset()

    def may_write(self, stream_id: str) -> bool:
        """May it push partials to, close or take over `stream_id`?"""
        if stream_id in self.keys:
            return True
        if stream_id in self.keyed:
            return self.write_keyed
        return self.write

    def may_view(self, stream_id: str) -> bool:
        return self.view or stream_id in self.keys


@dataclass(frozen=True)
class Credentials:
    """Who may write, who may watch, who may read `/metrics`: the server's secrets.

    `writer` (`--token`) writes and watches every stream; without it anyone may write
    (streams with a key excepted). `viewer` (`--viewer-token`) watches; without it anyone
    may watch. `stream_keys` maps a stream id to a key that writes that stream alone
    (with the writer token, nothing else does). `metrics` guards `/metrics` (without it
    the writer token does). A viewer credential never writes, closes or takes over a
    stream, so a subtitle page's URL can be handed to an audience.
    """

    writer: str | None = None
    viewer: str | None = None
    stream_keys: Mapping[str, str] = field(default_factory=dict)
    metrics: str | None = None

    def __post_init__(self) -> None:
        for name, secret in (("token", self.writer), ("viewer token", self.viewer)):
            if secret is not None and not secret:
                raise ValueError(f"the {name} must not be empty")
        if self.metrics is not None and not self.metrics:
            raise ValueError("the metrics token must not be empty")
        keys: dict[str, str] = {}
        for stream_id, key in self.stream_keys.items():
            if not key:
                raise ValueError(f"the key of stream {stream_id!r} must not be empty")
            if self.writer is not None and key == self.writer:
                raise ValueError(f"the key of stream {stream_id!r} is the writer token")
            try:  # ids as the server compares them: valid, in NFC
                keys[Subscribe(stream_id).stream_id] = key
            except InvalidMessage as exc:
                raise ValueError(f"--stream-key: {exc}") from None
        object.__setattr__(self, "stream_keys", keys)
        if self.viewer is not None and self.viewer in {self.writer, *keys.values()}:
            raise ValueError("the viewer token must differ from every writer secret")

    @property
    def any(self) -> bool:
        """Whether `/ws` knows any secret (without one, a presented token is ignored)."""
        return self.writer is not None or self.viewer is not None or bool(self.stream_keys)

    def access(self, presented: str | None) -> Access | None:
        """What a handshake presenting `presented` may do; None: refuse it (401).

        A credential adds to what anyone may do; a presented one that matches nothing is
        refused even where anyone may watch, so that a misconfigured writer hears so at
        once. Every secret is compared (in constant time), whichever matches.
        """
        keyed = frozenset(self.stream_keys)
        anyone = Access("none", self.viewer is None, self.writer is None, keyed=keyed)
        if presented is None or not self.any:
            return anyone if (anyone.view or anyone.write) else None
        writer = self.writer is not None and token_matches(presented, self.writer)
        keys = frozenset(
            [sid for sid, key in self.stream_keys.items() if token_matches(presented, key)]
        )
        viewer = self.viewer is not None and token_matches(presented, self.viewer)
        if writer:
            return Access("writer", True, True, write_keyed=True, keyed=keyed)
        if keys:
            return Access("stream_key", anyone.view, anyone.write, keys=keys, keyed=keyed)
        if viewer:
            return Access("viewer", True, anyone.write, keyed=keyed)
        return None

    def metrics_allowed(self, presented: str | None) -> bool:
        """`/metrics`: its own token, else the writer's, else open (never the viewer's)."""
        guard = self.metrics if self.metrics is not None else self.writer
        return guard is None or token_matches(presented, guard)


UNAUTHORIZED = Refusal(401, "Missing or wrong token.\n", (("WWW-Authenticate", "Bearer"),))


def authorize(
    path: str,
    authorization: str | None,
    origin: str | None,
    *,
    credentials: Credentials,
    allowed_origins: frozenset[str] | None,
) -> Refusal | Access:
    """Decide whether a WebSocket handshake may proceed, and with what rights.

    Origin is checked only when an allowlist is set and a browser sent one: a speech
    pipeline sends no Origin and is held to the token instead. Authentication comes
    first, so an unauthenticated client learns nothing about the allowlist.
    """
    access = credentials.access(presented_token(path, authorization))
    if access is None:
        return UNAUTHORIZED
    if allowed_origins is not None and origin is not None and origin not in allowed_origins:
        return Refusal(403, "Origin not allowed.\n")
    return access


# --- rate limiting ----------------------------------------------------------------------


class TokenBucket:
    """Allow `rate` events per second on average, with bursts of up to `burst`."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.updated = now

    def take(self, now: float, amount: float = 1.0) -> bool:
        """Spend `amount` tokens if there are that many; the time may only move forward."""
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
        if self.tokens >= amount:
            self.tokens -= amount
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
    # Whether the update bus publishes now (a shared one: Redis reachable); set when an
    # engine is attached. A node cut off from it is not ready: a load balancer sends
    # writers elsewhere.
    bus_ready: Callable[[], bool] | None = field(default=None, repr=False)
    # The close code a stopping server sends: 1001 (going away) alone, 1012 (service
    # restart: reconnect, to another node) when other nodes serve the same streams.
    close_code: int = 1001
    # Audio streams open on all connections (`AudioLimits.max_streams` caps them).
    audio_streams: int = 0

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
        """Model loaded, not stopping, and the bus publishing: what `/readyz` reports."""
        return self.phase is ServerPhase.READY and self.bus_up

    @property
    def bus_up(self) -> bool:
        return self.bus_ready is None or self.bus_ready()

    @property
    def stopping(self) -> bool:
        return self.phase is ServerPhase.STOPPING

    def readyz(self) -> tuple[int, str]:
        """`/readyz`'s status and body: 200 ready; 503 loading or cut off from the bus;
        404 draining."""
        if self.ready:
            return 200, "ready\n"
        if self.stopping:
            # 404, not 503: "draining", which a load balancer can tell from "failed"
            # (HAProxy's `http-check disable-on-404` then sends nothing new but keeps the
            # node's connections until it closes them itself, each after its owed finals).
            return 404, "not ready: draining (shutting down)\n"
        why = "model loading"
        if self.phase is ServerPhase.READY:
            why = "the update bus (Redis) is unreachable"
        return 503, f"not ready: {why}\n"

    def handshake_refusal(self) -> Refusal | None:
        """A 503 for a WebSocket handshake while loading or stopping, else None (a node
        cut off from its bus still lets viewers and writers in: they hear why)."""
        if self.phase is ServerPhase.READY:
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
    (None only while the server knows no languages: then every one), from after the
    cursor `after` when the viewer resumes."""

    stream_id: str
    lang: str | None = None
    after: str | None = None


@dataclass(frozen=True)
class Ignore:
    """Nothing to do (e.g. a repeated subscribe, or audio dropped after its error)."""


@dataclass(frozen=True)
class OpenAudio:
    """Start recognizing an audio stream into `stream_id`: the binary frames that follow
    are its PCM at `sample_rate` Hz (`FeedAudio`)."""

    stream_id: str
    sample_rate: int


@dataclass(frozen=True)
class FeedAudio:
    """The next chunk of the connection's audio stream (any byte count: a frame that ends
    inside a sample leaves its byte to the next)."""

    stream_id: str
    pcm: bytes


@dataclass(frozen=True)
class FinishAudio:
    """End the audio stream: the utterance in progress gets its final; then, with `close`,
    close the stream as `Close` does (close_stream arrived while its audio ran)."""

    stream_id: str
    close: bool = False


Action: TypeAlias = Reply | Push | Close | Watch | Ignore | OpenAudio | FeedAudio | FinishAudio


_MESSAGE_TYPES: dict[type, str] = {
    PartialTranscript: "partial_transcript",
    CloseStream: "close_stream",
    Subscribe: "subscribe",
    StartAudio: "start_audio",
    EndAudio: "end_audio",
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
class Listening:
    """The audio stream a connection is sending: its stream, rate and speed limit."""

    stream_id: str
    sample_rate: int
    bucket: TokenBucket  # in milliseconds of audio
    limited: bool = False  # dropping audio now (its error was sent)


@dataclass
class ConnectionCore:
    """One WebSocket connection's state and rules.

    `receive` turns each incoming frame into one `Action`. `message_type` after a call
    names what the frame was (`partial_transcript`, ..., `audio` for a binary frame of
    an audio stream, or `invalid`), for metrics. `audio`: the rules of audio input (None:
    the server takes none); `listening`: the audio stream this connection sends, if any.
    A binary frame is the audio stream's next chunk and is held to its speed limit
    instead of `Limits.rate_limit` (a client may send 10 ms frames).
    """

    connection_id: int
    limits: Limits
    server: ServerState
    now: float = 0.0
    access: Access = field(default_factory=Access)
    role: Role = Role.UNDECIDED
    watched: set[tuple[str, str | None]] = field(default_factory=set)  # (stream, language)
    message_type: str = "invalid"
    _bucket: TokenBucket | None = field(default=None, repr=False)
    audio: AudioLimits | None = None
    listening: Listening | None = None
    dropped_audio_ms: float = 0.0  # audio dropped for arriving too fast, in all
    _stray_reported: bool = field(default=False, repr=False)

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
        if not isinstance(data, str):
            return self._binary(data, now)
        self._stray_reported = False
        allowed = self._bucket is None or self._bucket.take(now)
        message = protocol.parse(
            data,
            max_bytes=self.limits.max_message_bytes,
            max_text_chars=self.limits.max_text_chars,
            accept=protocol.codec.TO_ENGINE_TYPES,
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
            if not self.access.may_write(message.stream_id):
                return Reply(self._unauthorized("closing", message))
            if self.listening is not None and self.listening.stream_id == message.stream_id:
                self._stop_listening()
                return FinishAudio(message.stream_id, close=True)
            return Close(message.stream_id)
        if isinstance(message, StartAudio):
            return self._start_audio(message, now)
        if isinstance(message, EndAudio):
            return self._end_audio(message)
        assert isinstance(message, Subscribe)
        return self._subscribe(message)

    # -- audio ----------------------------------------------------------------------------

    def audio_ended(self, stream_id: str) -> None:
        """The I/O layer ended the audio stream on its own (its recognizer failed or could
        not start, or the connection is gone): binary frames are stray from now on, and
        the server's audio slot is free."""
        if self.listening is not None and self.listening.stream_id == stream_id:
            self._stop_listening()

    def _stop_listening(self) -> None:
        self.listening = None
        self.server.audio_streams = max(0, self.server.audio_streams - 1)

    def _start_audio(self, message: StartAudio, now: float) -> Action:
        sid = message.stream_id
        audio = self.audio
        if audio is None:
            off = _error(ErrorCode.INVALID_MESSAGE, AUDIO_OFF, field="type", context=message)
            return Reply(off)
        if not self.access.may_write(sid):
            return Reply(self._unauthorized("streaming audio to", message))
        if self.role is Role.VIEWER:
            return Reply(
                _error(
                    ErrorCode.FORBIDDEN,
                    "this connection is a viewer (it subscribed); stream audio from another "
                    "connection",
                    context=message,
                )
            )
        if self.listening is not None:
            return Reply(
                _error(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"this connection streams audio to {self.listening.stream_id!r} already; "
                    "binary frames carry no stream id, so a connection has one audio stream "
                    "at a time: send end_audio first, or open another connection",
                    field="stream_id",
                    context=message,
                )
            )
        if (
            message.lang is not None
            and audio.language is not None
            and base_lang(message.lang) != audio.language
        ):
            return Reply(
                _error(
                    ErrorCode.INVALID_MESSAGE,
                    f"this server's recognizer hears {audio.language!r} speech, not "
                    f"{message.lang!r}",
                    field="lang",
                    context=message,
                )
            )
        if self.server.audio_streams >= audio.max_streams:
            return Reply(
                _error(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"the server is recognizing {self.server.audio_streams} audio streams, "
                    "its limit; try again later",
                    context=message,
                )
            )
        self.role = Role.WRITER
        self.server.audio_streams += 1
        bucket = TokenBucket(audio.max_speed * 1000.0, audio.burst_s * 1000.0, now)
        self.listening = Listening(sid, message.sample_rate, bucket)
        return OpenAudio(sid, message.sample_rate)

    def _end_audio(self, message: EndAudio) -> Action:
        listening = self.listening
        if listening is None or listening.stream_id != message.stream_id:
            now = (
                "none is running"
                if listening is None
                else f"its audio goes to {listening.stream_id!r}"
            )
            return Reply(
                _error(
                    ErrorCode.UNKNOWN_STREAM,
                    f"end_audio: this connection streams no audio to {message.stream_id!r} "
                    f"({now})",
                    field="stream_id",
                    context=message,
                )
            )
        self._stop_listening()
        return FinishAudio(message.stream_id)

    def _binary(self, data: bytes, now: float) -> Action:
        """A binary frame: the next chunk of the audio stream, or a stray one (reported
        once per run of stray frames: a client streaming into nothing learns it from the
        first, and the rest would only bury its other replies)."""
        listening = self.listening
        if listening is None or self.server.stopping:
            if self._stray_reported:
                return Ignore()
            self._stray_reported = True
            if self.server.stopping:
                return Reply(self.server.shutting_down())
            if self.audio is None:
                why = "binary frames are not accepted: send each message as a JSON text frame"
                return Reply(_error(ErrorCode.INVALID_MESSAGE, f"{why} ({AUDIO_OFF})"))
            return Reply(
                _error(
                    ErrorCode.INVALID_MESSAGE,
                    "a binary frame is audio, and this connection has no audio stream (none "
                    "started, or it ended): send start_audio first; further stray frames are "
                    "dropped without a word",
                )
            )
        self.message_type = "audio"
        sid = listening.stream_id
        ms = len(data) / 2 * 1000.0 / listening.sample_rate
        if len(data) > self.limits.max_message_bytes or ms > listening.bucket.burst:
            return Reply(
                ErrorMessage(
                    ErrorCode.TOO_LARGE,
                    f"an audio frame of {len(data)} bytes ({ms / 1000:.1f} s) exceeds the "
                    f"limit of {self.limits.max_message_bytes} bytes or "
                    f"{listening.bucket.burst / 1000:g} s; send about 100 ms per frame",
                    stream_id=sid,
                )
            )
        if not listening.bucket.take(now, ms):
            self.dropped_audio_ms += ms
            if listening.limited:
                return Ignore()
            listening.limited = True
            speed = listening.bucket.rate / 1000.0
            return Reply(
                ErrorMessage(
                    ErrorCode.RATE_LIMITED,
                    f"audio for stream {sid!r} arrives faster than {speed:g}x real time: "
                    "what comes faster is dropped; send audio as it is captured",
                    stream_id=sid,
                )
            )
        listening.limited = False
        return FeedAudio(sid, bytes(data))

    def _unauthorized(self, what: str, message: Message) -> ErrorMessage:
        sid = getattr(message, "stream_id", "")
        if what == "watching":
            needs = "the viewer token"
        else:
            needs = "the writer token" + (" or this stream's key" if self.access.keyed else "")
        return _error(
            ErrorCode.UNAUTHORIZED,
            f"{what} stream {sid!r} needs {needs}, and this connection did not present it "
            "(send it as 'Authorization: Bearer' or ?token= when connecting)",
            context=message,
        )

    def _partial(self, event: PartialTranscript) -> Action:
        if not self.access.may_write(event.stream_id):
            return Reply(self._unauthorized("writing", event))
        if self.listening is not None and self.listening.stream_id == event.stream_id:
            return Reply(
                _error(
                    ErrorCode.FORBIDDEN,
                    f"stream {event.stream_id!r} is fed by this connection's audio: its "
                    "transcripts come from the recognizer (send end_audio first)",
                    context=event,
                )
            )
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
        if not self.access.may_view(sid):
            return Reply(self._unauthorized("watching", message))
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
        return Watch(sid, lang, message.after)
