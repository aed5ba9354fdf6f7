"""What a bridge is asked to do (`BridgeOptions`: what it connects, how it maps) and what
it did (`BridgeResult`), checked when built so that a bad combination of options fails
before anything connects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.bridges.cloud import Dialect
from engine.bridges.errors import BridgeError
from engine.bridges.events import Interrupted
from engine.bridges.kinds import Kind, MapperOptions
from engine.bridges.whisper_streaming import Segmentation
from engine.remote import RATE
from protocol import Backoff, ErrorMessage, PartialTranscript, TranslationUpdate

Reply = TranslationUpdate | ErrorMessage

DEFAULT_TO = "ws://127.0.0.1:8765/ws"


@dataclass(frozen=True)
class BridgeOptions:
    """One bridge: what it connects, and how it maps (see `nmt-incremental bridge -h`).

    `url`: the recogniser's server (`ws://` for WhisperLive, Vosk and a cloud forwarder;
    `host:port` or `tcp://host:port` for whisper_streaming); with `listen`, where the
    relayed sessions go (None for a `cloud` forwarder, which connects to the bridge).
    `end_wait`: after the audio, how long the recogniser may go quiet before the bridge
    ends the session (WhisperLive's own client waits for its answers the same way), and how
    long it waits for the server to close then. `idle`: whisper_streaming only, see
    `WhisperStreamingMapper.idle`. `short_session`, `max_short_sessions`: in connect mode
    a recogniser session that ends within this many seconds is a failure (it does not end
    an outage), and this many in a row give up. `rate`: the messages per second to our
    server that the bridge keeps within (`RemoteTranslator`'s `rate`). `glossary`: the
    text of a glossary file, sent as the stream's own (`set_glossary`) before its first
    partial, and again after each reconnect."""

    kind: Kind
    url: str | None
    stream_id: str
    to: str = DEFAULT_TO
    token: str | None = None
    lang: str | None = None
    audio: str | None = None
    audio_rate: int = 16000
    listen: tuple[str, int] | None = None
    speed: float = 1.0
    dialect: Dialect = Dialect.GOOGLE
    interrupted: Interrupted = Interrupted.FINAL
    model: str = "small"
    segmentation: Segmentation = field(default_factory=Segmentation)
    min_stability: float = 0.9
    idle: float = 2.0
    end_wait: float = 10.0
    ready_timeout: float = 120.0
    reconnect_for: float = 30.0
    backoff: Backoff | None = None
    drain_timeout: float = 30.0
    stop_timeout: float = 5.0  # after `stop`: the most time closing the stream may take
    short_session: float = 5.0
    max_short_sessions: int = 5
    rate: float | None = RATE
    glossary: str | None = None  # the stream's own glossary (a file's text), sent first

    def __post_init__(self) -> None:
        if self.listen is None and self.url is None:
            raise BridgeError("give the recogniser's URL, or --listen")
        if self.kind.wants_audio and self.listen is None and self.audio is None:
            raise BridgeError(
                f"{self.kind} transcribes audio from its client: give --audio FILE.wav (or "
                "- for raw PCM on stdin), or --listen HOST:PORT to relay your own client"
            )
        if self.kind.wants_audio and self.listen is not None and self.url is None:
            raise BridgeError(f"--listen relays sessions to the {self.kind} server: give its URL")
        if self.audio is not None and self.listen is not None:
            raise BridgeError("--audio and --listen exclude each other")
        if self.kind is Kind.CLOUD and self.audio is not None:
            raise BridgeError("cloud takes results from a forwarder, not audio")
        if self.max_short_sessions < 1 or self.short_session < 0:
            raise BridgeError("max_short_sessions must be >= 1 and short_session >= 0")
        if not self.stop_timeout >= 0:
            raise BridgeError("stop_timeout must be >= 0 seconds")
        if self.rate is not None and not self.rate > 0:
            raise BridgeError("rate must be a positive number of messages per second")

    @property
    def recogniser_backoff(self) -> Backoff:
        return self.backoff or Backoff(total=self.reconnect_for)

    def mapper_options(self) -> MapperOptions:
        return MapperOptions(
            lang=self.lang,
            interrupted=self.interrupted,
            dialect=self.dialect,
            min_stability=self.min_stability,
            segmentation=self.segmentation,
        )


@dataclass
class BridgeResult:
    """What one bridge run did: the `events` it pushed, the `replies` it got (updates
    and errors), the recogniser `sessions` it had, and why each ended (`disconnects`: in
    connect mode the sessions lost before the input was over, in listen mode every relayed
    session); `unanswered`: finals our server had not answered when the bridge stopped
    (answered `unavailable` by `RemoteTranslator` then), and those the recogniser gave
    that a stop or our server's loss kept from being sent; `gave_up`: why it stopped
    before its input ended."""

    events: list[PartialTranscript] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    sessions: int = 0
    disconnects: list[str] = field(default_factory=list)
    unanswered: list[PartialTranscript] = field(default_factory=list)
    gave_up: str | None = None

    @property
    def finals(self) -> list[PartialTranscript]:
        return [event for event in self.events if event.is_final]

    @property
    def translated(self) -> list[TranslationUpdate]:
        """The final updates received (one per final and language)."""
        return [r for r in self.replies if isinstance(r, TranslationUpdate) and r.is_final]

    @property
    def refused(self) -> list[ErrorMessage]:
        """Errors that answered a final of this bridge."""
        seqs = {event.seq for event in self.finals}
        return [r for r in self.replies if isinstance(r, ErrorMessage) and r.seq in seqs]
