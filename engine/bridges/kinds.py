"""The recognisers a bridge speaks to, and the one mapper each gets (`make_mapper`).

A mapper is the sans-I/O part of a bridge: feed it what the recogniser sent, get the
`PartialTranscript` events to push. All of them share one `EventWriter`, which owns the
protocol's numbering rules; each mapper owns only its recogniser's reading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from engine.bridges.cloud import MIN_STABILITY, CloudMapper, Dialect
from engine.bridges.events import EventWriter, Interrupted
from engine.bridges.vosk import VoskMapper
from engine.bridges.whisper_streaming import Segmentation, WhisperStreamingMapper
from engine.bridges.whisperlive import WhisperLiveMapper
from protocol import PartialTranscript


class Kind(str, Enum):
    """A recogniser family, as `nmt-incremental bridge KIND` names it."""

    WHISPERLIVE = "whisperlive"
    WHISPER_STREAMING = "whisper-streaming"
    VOSK = "vosk"
    CLOUD = "cloud"

    def __str__(self) -> str:
        return self.value

    @property
    def wants_audio(self) -> bool:
        """Its server transcribes audio its client sends (so the bridge sends it, or
        relays a client that does); a cloud forwarder sends results only."""
        return self is not Kind.CLOUD


class Mapper(Protocol):
    """What the I/O layer needs of a mapper."""

    writer: EventWriter

    def feed(self, message: str | bytes) -> list[PartialTranscript]:
        """Events for one message (or line) from the recogniser."""
        ...

    def idle(self) -> list[PartialTranscript]:
        """Events for "nothing came for a while" (only whisper_streaming acts on it)."""
        ...

    def end_session(self, next_offset_ms: float | None = None) -> list[PartialTranscript]:
        """Events for "the recogniser's session ended": its open segment closed."""
        ...


@dataclass(frozen=True, slots=True)
class MapperOptions:
    """What shapes a mapping besides the recogniser's messages."""

    lang: str | None = None
    interrupted: Interrupted = Interrupted.FINAL
    dialect: Dialect = Dialect.GOOGLE
    min_stability: float = MIN_STABILITY
    segmentation: Segmentation = field(default_factory=Segmentation)


def make_mapper(kind: Kind, stream_id: str, options: MapperOptions | None = None) -> Mapper:
    """A fresh mapper for one stream (seq and segment ids from 0)."""
    options = options or MapperOptions()
    writer = EventWriter(stream_id, interrupted=options.interrupted)
    if kind is Kind.WHISPERLIVE:
        return WhisperLiveMapper(writer)
    if kind is Kind.WHISPER_STREAMING:
        return WhisperStreamingMapper(writer, lang=options.lang, segmentation=options.segmentation)
    if kind is Kind.VOSK:
        return VoskMapper(writer)
    return CloudMapper(
        writer, options.dialect, lang=options.lang, min_stability=options.min_stability
    )
