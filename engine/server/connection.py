"""One connection's rules, sans I/O: parse, rate-limit, authorize each message, route it.

Nothing here touches a socket, a clock or the engine. The I/O layer (`client.py`) feeds in
what arrived (a frame, the current time) and carries out the `Action` it gets back. What
a connection may do was decided at its handshake (`credentials.Access`); the server's
phase is `state.ServerState`; the limits and their token bucket are in `limits`. Which
connection owns which stream is not decided here: each connection is an `Owner` to the
engine, whose one state machine per stream (`engine.streaming.lifecycle`) admits, refuses
and releases; nothing is reported back. Keeping the connection's own rules here makes
every one of them testable without a model or a network, in the manner of the
`websockets` library's own sans-I/O core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TypeAlias

import protocol
from engine.distribution import install_hint
from engine.languages import base_lang
from engine.server.credentials import Access
from engine.server.limits import AudioLimits, AudioSlot, Limits, Refused, TokenBucket
from engine.server.state import ServerState
from engine.streaming.lifecycle import Owner
from engine.streaming.subscriptions import target_language
from protocol import (
    CloseStream,
    EndAudio,
    ErrorCode,
    ErrorMessage,
    InvalidEvent,
    Message,
    PartialTranscript,
    SetGlossary,
    StartAudio,
    Subscribe,
)

AUDIO_OFF = (
    "this server takes no audio: start it with `nmt-incremental serve --asr pocketsphinx` "
    f"(needs {install_hint('asr')}), or run a recognizer of your own and send what it "
    "hears as partial_transcript messages"
)
"""The reply to `start_audio` (and to binary frames) on a server started without a
recognizer: what to do instead."""


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
class SetOwnGlossary:
    """Give the writer's stream its own glossary (`SetGlossary`); the engine checks the
    text and ownership, and the connection answers `glossary_set` or the error."""

    message: SetGlossary


@dataclass(frozen=True)
class Ignore:
    """Nothing to do (e.g. a repeated subscribe, or audio dropped after its error)."""


@dataclass(frozen=True)
class OpenAudio:
    """Start recognizing an audio stream into `stream_id`: the binary frames that follow
    are its PCM at `sample_rate` Hz (`FeedAudio`). `slot`: its place among the server's
    audio streams, which the I/O layer marks `started` once the recognizer is made and
    `release`s once it is gone."""

    stream_id: str
    sample_rate: int
    slot: AudioSlot | None = field(default=None, compare=False, repr=False)


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


Action: TypeAlias = (
    Reply | Push | Close | Watch | Ignore | OpenAudio | FeedAudio | FinishAudio | SetOwnGlossary
)


_MESSAGE_TYPES: dict[type, str] = {
    PartialTranscript: "partial_transcript",
    CloseStream: "close_stream",
    Subscribe: "subscribe",
    StartAudio: "start_audio",
    EndAudio: "end_audio",
    SetGlossary: "set_glossary",
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
    the server takes none); `listening`: the audio stream this connection sends, if any;
    `address`: the client's address as per-address caps count it.
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
    address: str = "local"

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
        if isinstance(message, SetGlossary):
            return self._set_glossary(message)
        assert isinstance(message, Subscribe)
        return self._subscribe(message)

    # -- audio ----------------------------------------------------------------------------

    def audio_ended(self, stream_id: str) -> None:
        """The I/O layer ended the audio stream on its own (its recognizer failed, could
        not start or heard nothing for the idle timeout, or the connection is gone):
        binary frames are stray from now on. (Its slot is the I/O layer's to release,
        once the recognizer is gone.)"""
        if self.listening is not None and self.listening.stream_id == stream_id:
            self._stop_listening()

    def _stop_listening(self) -> None:
        self.listening = None

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
        slot = self.server.audio.take(audio, self.address)
        if isinstance(slot, Refused):
            # The frames sent right behind the refused start are dropped without a word of
            # their own: its refusal said why.
            self._stray_reported = True
            return Reply(_error(slot.code, slot.message, field="type", context=message))
        self.role = Role.WRITER
        bucket = TokenBucket(audio.max_speed * 1000.0, audio.burst_s * 1000.0, now)
        self.listening = Listening(sid, message.sample_rate, bucket)
        return OpenAudio(sid, message.sample_rate, slot)

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
                    f"end_audio: this connection streams no audio to {message.stream_id!r} ({now})",
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

    def _set_glossary(self, message: SetGlossary) -> Action:
        if not self.access.may_write(message.stream_id):
            return Reply(self._unauthorized("giving a glossary to", message))
        if self.role is Role.VIEWER:
            return Reply(
                _error(
                    ErrorCode.FORBIDDEN,
                    "this connection is a viewer (it subscribed); only a stream's writer "
                    "gives it a glossary: send set_glossary from the writer's connection",
                    context=message,
                )
            )
        self.role = Role.WRITER
        return SetOwnGlossary(message)

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
