"""Cloud recognisers' streaming results to `PartialTranscript` events, sans I/O.

Cloud recognisers are reached through their SDKs, with the user's credentials, so the
bridge does not call them: the user's own process forwards the SDK's results as JSON, one
object per line (a WebSocket message may hold one line or several), and the bridge maps
them by `Dialect`. Each dialect follows its service's documented result shape:

- `google`: Speech-to-Text streaming, `StreamingRecognizeResponse` as `MessageToJson`
  (camelCase) or proto-plus `to_dict` (snake_case) writes it (cloud.google.com,
  `google.cloud.speech_v1.types.StreamingRecognitionResult`): `results[]`, each with
  `alternatives[0].transcript`, `isFinal`, `stability` (interim only; 0.0 means "not
  set") and `resultEndTime` ("1.500s"; v2: `resultEndOffset`), relative to the stream's
  start. A final result ends a segment. The interim results of one response are consecutive
  pieces of the hypothesis (the later ones carry their leading space) and the leading pieces
  with `stability` at or above `min_stability` are the settled part (`stable_chars`).
  Stability is Google's estimate, not a promise: 0.9 by default, for pieces Google rates
  at least that likely to stay.
- `deepgram`: Live Streaming `Results` messages (developers.deepgram.com, "Configure
  Endpointing and Interim Results"; the JS SDK's `LiveTranscriptionEvent`): `start` and
  `duration` (s) of the window, `channel.alternatives[0].transcript`, `is_final` (this
  window's text will not change, the utterance may go on) and `speech_final` (endpointing
  heard the utterance end); `{"type": "UtteranceEnd"}` ends one too. A segment is an
  utterance: the finalized windows joined are its settled part (`stable_chars`), the
  current interim window its tentative tail.
- `azure`: Speech SDK events (learn.microsoft.com, "Get speech recognition results"),
  forwarded as `{"event": "recognizing"|"recognized"|"canceled"|"session_stopped",
  "text", "offset", "duration", "reason"}` (the `SpeechRecognitionEventArgs.result`
  attributes; offset and duration in 100 ns ticks), or the service's own JSON of the result
  (`result.json`: `{"Text", "Offset", "Duration"}` for a hypothesis,
  `{"RecognitionStatus", "DisplayText", "Offset", "Duration"}` for a phrase). `recognizing`
  is the utterance's whole hypothesis so far, `recognized` its final (`NoMatch` or an empty
  text: nothing was said, the segment is abandoned). Azure says nothing of settled parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from engine.bridges.events import EventWriter
from engine.bridges.upstream import read_json
from engine.languages import word_joiner
from protocol import PartialTranscript


class Dialect(str, Enum):
    GOOGLE = "google"
    DEEPGRAM = "deepgram"
    AZURE = "azure"

    def __str__(self) -> str:
        return self.value


MIN_STABILITY = 0.9

_TICKS_PER_MS = 10_000.0


def _first(obj: dict[str, Any], *names: str) -> Any:
    for name in names:
        if name in obj:
            return obj[name]
    return None


def _duration_ms(value: object) -> float | None:
    """A protobuf Duration as JSON writes it ("1.500s", or seconds and nanos), or a
    number of seconds, in ms."""
    try:
        if isinstance(value, str):
            return float(value.strip().removesuffix("s")) * 1000.0
        if isinstance(value, dict):
            seconds = float(value.get("seconds", 0) or 0)
            return (seconds + float(value.get("nanos", 0) or 0) / 1e9) * 1000.0
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value) * 1000.0
    except (TypeError, ValueError):
        return None
    return None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _transcript(holder: object) -> str:
    """`alternatives[0].transcript` (the top hypothesis), or ""."""
    if not isinstance(holder, dict):
        return ""
    alternatives = holder.get("alternatives")
    if not isinstance(alternatives, list) or not alternatives:
        return ""
    best = alternatives[0]
    return str(best.get("transcript", "")) if isinstance(best, dict) else ""


@dataclass(slots=True)
class _Utterance:
    """Deepgram: the finalized windows of the utterance so far."""

    text: str = ""
    start_ms: float | None = None
    end_ms: float | None = None


class CloudMapper:
    """Feed it the forwarded JSON lines, get events. `lang`: the spoken language, for
    joining Deepgram's windows (they carry no spaces of their own)."""

    def __init__(
        self,
        writer: EventWriter,
        dialect: Dialect,
        *,
        lang: str | None = None,
        min_stability: float = MIN_STABILITY,
    ) -> None:
        self.writer = writer
        self.dialect = dialect
        self.min_stability = min_stability
        self._joiner = word_joiner(lang)
        # google: where the next result begins (a result covers the audio since the last
        # final one, the first one since the stream's start)
        self._segment_start: float | None = 0.0
        self._utterance = _Utterance()

    def feed(self, message: str | bytes) -> list[PartialTranscript]:
        text = message.decode("utf-8", "replace") if isinstance(message, bytes) else message
        events: list[PartialTranscript] = []
        for line in text.splitlines():
            if not line.strip():
                continue
            obj = read_json(line)
            if isinstance(obj, dict):
                events += self._one(obj)
        return events

    def _one(self, obj: dict[str, Any]) -> list[PartialTranscript]:
        if self.dialect is Dialect.GOOGLE:
            return self._google(obj)
        if self.dialect is Dialect.DEEPGRAM:
            return self._deepgram(obj)
        return self._azure(obj)

    # -- google -------------------------------------------------------------------------

    def _google(self, obj: dict[str, Any]) -> list[PartialTranscript]:
        results = obj.get("results")
        if not isinstance(results, list):
            results = [obj] if "alternatives" in obj else []
        events: list[PartialTranscript] = []
        interim: list[tuple[str, float, float | None]] = []
        for result in results:
            if not isinstance(result, dict):
                continue
            end = _duration_ms(
                _first(
                    result,
                    "resultEndTime",
                    "result_end_time",
                    "resultEndOffset",
                    "result_end_offset",
                )
            )
            if _first(result, "isFinal", "is_final") is True:
                events += self.writer.final(_transcript(result), self._segment_start, end)
                if end is not None:
                    self._segment_start = end
            else:
                stability = _number(result.get("stability")) or 0.0
                interim.append((_transcript(result), stability, end))
        if interim:
            text = "".join(piece for piece, _, _ in interim)
            stable: int | None = None
            if any(stability > 0.0 for _, stability, _ in interim):
                stable = 0
                for piece, stability, _ in interim:
                    if stability < self.min_stability:
                        break
                    stable += len(piece)
            ends = [end for _, _, end in interim if end is not None]
            events += self.writer.partial(
                text, self._segment_start, ends[-1] if ends else None, stable
            )
        return events

    # -- deepgram -----------------------------------------------------------------------

    def _deepgram(self, obj: dict[str, Any]) -> list[PartialTranscript]:
        kind = obj.get("type")
        if kind == "UtteranceEnd":
            return self._utterance_end()
        if kind not in (None, "Results") or not isinstance(obj.get("channel"), dict):
            return []  # Metadata, SpeechStarted, errors
        window = _transcript(obj["channel"])
        start_s, duration_s = _number(obj.get("start")), _number(obj.get("duration"))
        start = start_s * 1000.0 if start_s is not None else None
        end = start + duration_s * 1000.0 if start is not None and duration_s is not None else None
        said = self._utterance
        if obj.get("is_final") is True:
            if window.strip():
                said.text = self._join(said.text, window)
                said.start_ms = said.start_ms if said.start_ms is not None else start
                said.end_ms = end
            if obj.get("speech_final") is True:
                return self._utterance_end()
            return self.writer.partial(said.text, said.start_ms, said.end_ms, len(said.text))
        text = self._join(said.text, window)
        first = said.start_ms if said.start_ms is not None else start
        return self.writer.partial(text, first, end, len(said.text))

    def _join(self, settled: str, window: str) -> str:
        window = window.strip()
        if not settled:
            return window
        return settled + self._joiner + window if window else settled

    def _utterance_end(self) -> list[PartialTranscript]:
        """Its finalized windows are the final; an interim tail no window finalized is
        abandoned with it (Deepgram sends UtteranceEnd after the last finalized word)."""
        said, self._utterance = self._utterance, _Utterance()
        if said.text:
            return self.writer.final(said.text, said.start_ms, said.end_ms)
        if self.writer.open_text:
            self.writer.abandon()
        return []

    # -- azure --------------------------------------------------------------------------

    def _azure(self, obj: dict[str, Any]) -> list[PartialTranscript]:
        event = str(_first(obj, "event", "type") or "").lower()
        if not event:
            if "RecognitionStatus" in obj:
                event = "recognized"
            elif "Text" in obj:
                event = "recognizing"
        if event in ("canceled", "session_stopped", "sessionstopped"):
            return self.end_session()  # the SDK's session is over: a new one starts at 0
        if event not in ("recognizing", "recognized"):
            return []
        text = _first(obj, "text", "Text", "DisplayText")
        if text is None and isinstance(obj.get("NBest"), list) and obj["NBest"]:
            best = obj["NBest"][0]
            text = best.get("Display") if isinstance(best, dict) else None
        offset = _number(_first(obj, "offset", "Offset"))
        duration = _number(_first(obj, "duration", "Duration"))
        start = offset / _TICKS_PER_MS if offset is not None else None
        end = (
            (offset + duration) / _TICKS_PER_MS
            if offset is not None and duration is not None
            else None
        )
        if event == "recognizing":
            return self.writer.partial(str(text or ""), start, end)
        reason = str(_first(obj, "reason", "RecognitionStatus") or "")
        if "nomatch" in reason.lower().replace("_", ""):
            text = ""
        return self.writer.final(str(text or ""), start, end)

    # -- the session --------------------------------------------------------------------

    def idle(self) -> list[PartialTranscript]:
        """Nothing: cloud recognisers end their segments themselves."""
        return []

    def end_session(self, next_offset_ms: float | None = None) -> list[PartialTranscript]:
        """The forwarder's connection ended: the open segment is closed by the writer's
        `interrupted` rule (Deepgram's finalized windows are its settled part, so `DROP`
        still sends them); a new session's times start from 0 again."""
        self._segment_start = 0.0
        self._utterance = _Utterance()
        return self.writer.end_session(next_offset_ms)
