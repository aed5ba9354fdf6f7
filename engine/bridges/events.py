"""`EventWriter`: the one place where a bridge turns a recogniser's hypotheses into
`PartialTranscript` events, whatever the recogniser.

Every mapper (`whisperlive.py`, `whisper_streaming.py`, `vosk.py`, `cloud.py`) only decides
*what* its recogniser said (this segment's hypothesis is now X; this segment is over with
text Y; the session ended). The rules the engine's protocol asks of a writer live here once,
so no mapper can get them wrong on its own:

- `seq` grows by one per event, across segments and recogniser sessions (the engine refuses
  a seq that does not grow: `engine/streaming/lifecycle.py`).
- `segment_id` grows by one per segment and is never reused, also after a segment was
  abandoned (a segment id at or below a finished one is `out_of_order`).
- A segment gets at most one final; an empty final cannot be sent (the protocol forbids
  it), so a segment the recogniser ended with nothing is abandoned instead: the next
  segment takes the next id and the engine drops the old one's partials.
- Times: recognisers count from the start of their own session, which restarts when the
  bridge reconnects; `offset_ms` moves each session onto the stream's one clock, so that
  subtitle cues keep increasing.
- An unchanged hypothesis is not sent again (Vosk answers every audio chunk, mostly with
  the same partial).
- What the recogniser says is checked like the server checks it (`upstream.py`): lone
  surrogates are dropped from its text, a time that is no number is unknown, so that no
  message of it can make an event the protocol refuses.

When a recogniser session ends in the middle of a segment (a dropped connection, the end
of the audio), `end_session` closes the segment by `Interrupted`: `FINAL` sends the last
hypothesis as the segment's final (what was heard is kept and translated; it may lack its
last words), `DROP` keeps only what the recogniser had committed (`stable_chars`) and
abandons the rest. Either way a final the recogniser already gave is never lost: it was
sent when it came. A cut-off hypothesis that repeats the previous cut-off final (a
recogniser that keeps restarting says the same thing again) is abandoned, not sent twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from engine.bridges.upstream import clean_text, finite, lone_surrogates
from protocol import PartialTranscript
from protocol.codec import MAX_TEXT_CHARS
from protocol.messages import MAX_ID


class Interrupted(str, Enum):
    """What becomes of a segment whose recogniser session ended before its final."""

    FINAL = "final"
    """Send its last hypothesis as its final (the default: nothing heard is dropped)."""
    DROP = "drop"
    """Send only the part the recogniser committed as its final; abandon the rest."""

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class _Open:
    """The segment being recognised: its last hypothesis as sent."""

    text: str = ""
    start_ms: float | None = None
    end_ms: float | None = None
    stable_chars: int | None = None
    sent: bool = False  # an event of it went out: the engine knows this segment id


def _ms(value: float | None, offset: float) -> float | None:
    """A recogniser time (ms from its session's start) on the stream's clock, within the
    protocol's range (a negative start would be refused), to the microsecond (seconds
    times 1000 in floating point are not exact)."""
    value = finite(value)
    if value is None:
        return None
    return round(min(max(0.0, value + offset), float(MAX_ID)), 3)


class EventWriter:
    """Numbers and builds the events of one stream (sans I/O: returns events, sends
    nothing). `interrupted` decides the end of a segment cut off by `end_session`."""

    def __init__(self, stream_id: str, *, interrupted: Interrupted = Interrupted.FINAL) -> None:
        # Validated once here, so that a bad id fails before any connection is made.
        PartialTranscript(stream_id, 0, 0, "", False)
        self.stream_id = stream_id
        self.interrupted = interrupted
        self.seq = 0  # the next event's
        self.segment_id = 0  # the open (or next) segment's
        self.offset_ms = 0.0  # added to the recogniser's times
        self.latest_ms = 0.0  # the latest time seen, on the stream's clock
        self.finals = 0
        self.abandoned = 0
        self.repaired = 0  # hypotheses that had characters the protocol cannot carry
        self._open: _Open | None = None
        # The text of the last final if `end_session` made it (None after a recogniser's).
        self._cut_off: str | None = None

    @property
    def open_text(self) -> str:
        """The open segment's last hypothesis ("" when none is open)."""
        return self._open.text if self._open is not None else ""

    @property
    def open_stable(self) -> int:
        """How many leading characters of the open hypothesis were committed."""
        return (self._open.stable_chars or 0) if self._open is not None else 0

    def partial(
        self,
        text: str,
        start_ms: float | None = None,
        end_ms: float | None = None,
        stable_chars: int | None = None,
    ) -> list[PartialTranscript]:
        """The open segment's hypothesis is now `text` (the whole of it, not a delta).
        Nothing is sent for a hypothesis equal to the last one, nor for an empty one
        before the segment has had any text."""
        text, stable_chars = self._clean(text, stable_chars)
        start, end = self._times(start_ms, end_ms)
        current = self._open
        if current is None:
            if not text:
                return []
            current = self._open = _Open()
        elif current.text == text and current.stable_chars == stable_chars:
            return []
        current.text, current.stable_chars, current.sent = text, stable_chars, True
        if start is not None and (current.start_ms is None or start < current.start_ms):
            current.start_ms = start
        if end is not None:
            current.end_ms = end
        return [self._event(text, False, current.start_ms, current.end_ms, stable_chars)]

    def final(
        self, text: str, start_ms: float | None = None, end_ms: float | None = None
    ) -> list[PartialTranscript]:
        """The open segment is over with `text`; the next hypothesis starts the next
        segment. An empty `text` abandons the segment (no final can be empty)."""
        self._cut_off = None
        return self._final(text, start_ms, end_ms)

    def _final(
        self, text: str, start_ms: float | None, end_ms: float | None
    ) -> list[PartialTranscript]:
        text, _ = self._clean(text, None)
        start, end = self._times(start_ms, end_ms)
        current = self._open or _Open()
        if start is None or (current.start_ms is not None and current.start_ms < start):
            start = current.start_ms
        if end is None:
            end = current.end_ms
        self._open = None
        if not text:
            if current.sent:
                self.abandoned += 1
                self.segment_id += 1
            return []
        event = self._event(text, True, start, end, None)
        self.finals += 1
        self.segment_id += 1
        return [event]

    def abandon(self) -> None:
        """Forget the open segment without a final (the recogniser took it back)."""
        self.final("")

    def end_session(self, next_offset_ms: float | None = None) -> list[PartialTranscript]:
        """The recogniser's session ended: close the open segment by `interrupted`, and
        count the next session's times from `next_offset_ms` on the stream's clock
        (default: the latest time seen, so that times never go back). A hypothesis equal
        to the last final this made is abandoned: a recogniser whose sessions keep ending
        early says the same thing in each, and one utterance is one final."""
        events: list[PartialTranscript] = []
        current = self._open
        if current is not None:
            if self.interrupted is Interrupted.FINAL:
                text = current.text
            else:
                text = current.text[: current.stable_chars or 0]
            if text and text == self._cut_off:
                text = ""
            # Its times are the open segment's, kept as they are.
            events = self._final(text, None, None)
            if events:
                self._cut_off = events[0].text
        self.offset_ms = self.latest_ms if next_offset_ms is None else next_offset_ms
        return events

    def _times(
        self, start_ms: float | None, end_ms: float | None
    ) -> tuple[float | None, float | None]:
        start, end = _ms(start_ms, self.offset_ms), _ms(end_ms, self.offset_ms)
        if start is not None and end is not None and end < start:
            end = start  # recognisers' estimates may cross; the protocol refuses that
        for value in (start, end):
            if value is not None:
                self.latest_ms = max(self.latest_ms, value)
        return start, end

    def _event(
        self,
        text: str,
        is_final: bool,
        start_ms: float | None,
        end_ms: float | None,
        stable_chars: int | None,
    ) -> PartialTranscript:
        if start_ms is not None and end_ms is not None and end_ms < start_ms:
            end_ms = start_ms
        event = PartialTranscript(
            self.stream_id,
            self.segment_id,
            self.seq,
            text,
            is_final,
            start_ms,
            end_ms,
            stable_chars,
        )
        self.seq += 1
        return event

    def _clean(self, text: str, stable_chars: int | None) -> tuple[str, int | None]:
        """The recogniser's text as the protocol takes it (`upstream.clean_text`), its
        `stable_chars` moved with it, then trimmed and cut (`_clean`)."""
        cleaned, dropped = clean_text(text)
        if dropped:
            self.repaired += 1
            if stable_chars is not None:
                stable_chars -= lone_surrogates(text[:stable_chars])
        return _clean(cleaned, stable_chars)


def _clean(text: str, stable_chars: int | None) -> tuple[str, int | None]:
    """`text` without surrounding whitespace (Whisper's words carry a leading space), its
    `stable_chars` moved with it, and cut to the protocol's length limit (a segment that
    long is a recogniser that never ends one; its head is kept)."""
    stripped = text.lstrip()
    cut = len(text) - len(stripped)
    text = stripped.rstrip()[:MAX_TEXT_CHARS]
    if stable_chars is not None:
        stable_chars = max(0, min(stable_chars - cut, len(text)))
    return text, stable_chars
