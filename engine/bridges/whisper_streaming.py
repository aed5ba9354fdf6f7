"""whisper_streaming and SimulStreaming (ufal) to `PartialTranscript` events, sans I/O.

What their TCP servers say, as read in ufal/whisper_streaming at 1f25a1a and
ufal/SimulStreaming at 077ea37:

- The client sends raw audio, 16 kHz mono signed 16-bit little-endian, and nothing else
  (`whisper_online_server.py`, `ServerProcessor.receive_audio_chunk`; the README pipes
  `arecord -f S16_LE -c1 -r 16000 -t raw` into `nc`). The server serves one client at a
  time (`s.listen(1)`, one `ServerProcessor` after the other); when the client closes its
  side, the server stops and closes (`process`: `receive_audio_chunk` returns None; its
  `online.finish()` is commented out, so text not yet committed then is never sent).
- The server sends one line per update, UTF-8 and `"\\n"`-terminated
  (`line_packet.send_one_line`, no padding), never the same line twice in a row
  (`Connection.send`): `"%1.0f %1.0f %s" % (beg_ms, end_ms, text)`
  (`format_output_transcript`; SimulStreaming's `--out-txt`, `whisper_server.py`
  `send_result`). SimulStreaming's default is a JSON line instead: `{"start", "end"` (s),
  `"text", "tokens", "words", "is_final", "emission_time"}`, and `{"is_final": true, ...}`
  alone at the end of a voiced stretch (`--vac`; README, "Output format").
- Each line is *committed* text that follows the last one: it is never revised. Its
  words keep Whisper's own spacing where the backend has it (faster-whisper words and
  SimulStreaming tokens start with their space, so `sep` is "", `whisper_online.py`
  `FasterWhisperASR.sep`, and ", ask" may follow "my fellow Americans"); the
  whisper_timestamped and MLX backends join words with `sep = " "` and lines start without
  one.

So every event's whole text is settled (`stable_chars` = its length), and the bridge must
cut the flow into segments itself. A segment is closed, in this order of preference:

1. at a sentence end (`.`, `?`, `!`, `…`, `。`, `？`, `！`, closing quotes after them)
   inside or at the end of a line: sentences are what a translation model is trained on,
   and a final lets the engine translate with the whole sentence at once;
2. at a pause: a line that begins `pause_ms` after the last one ended (a speaker who
   stops without punctuation, e.g. a model that writes none);
3. at SimulStreaming's `is_final` (its voice activity detector heard the speech end);
4. when no line came for `idle` seconds (the I/O layer calls `idle()`): a pause whose
   next line has not come yet, so the subtitle does not wait for the next sentence;
5. at `max_chars`, so that a recogniser that never writes punctuation nor pauses cannot
   grow one segment without bound (the engine re-reads the whole segment at each event);
6. when the session ends: the text was committed, so it is a final whatever the
   `Interrupted` rule (there is no uncommitted part to drop).

A line split at a sentence end gives its times to the two parts in proportion to their
characters (the server's times are per line; a word-level split is not in the text
format). Abbreviations ("Mr.") end a segment too early; the cost is one sentence
translated in two pieces, not lost text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.bridges.events import EventWriter
from engine.bridges.upstream import read_json
from engine.languages import word_joiner
from protocol import PartialTranscript

SAMPLE_RATE = 16000

SENTENCE_END = re.compile(r"[.!?…]+[\"'”’»)\]]*(?=\s|$)|[。！？]+[」』”’）]*")
"""Where a sentence ends: Latin punctuation followed by a space or the end of the text
(so "3.5" and "e.g" do not), CJK punctuation anywhere."""

_GLUED = frozenset(",.;:!?…)]}»”’，。；：！？、）")
"""Characters that join the text before them without a space (", ask")."""


@dataclass(frozen=True, slots=True)
class Segmentation:
    """Where the bridge closes a segment of committed text (see the module)."""

    pause_ms: float = 1000.0
    max_chars: int = 500

    def __post_init__(self) -> None:
        if self.pause_ms <= 0:
            raise ValueError("pause_ms must be > 0")
        if self.max_chars < 1:
            raise ValueError("max_chars must be >= 1")


class LineSplitter:
    """Bytes from the socket to whole lines (a line may arrive in pieces, several in one
    read, or with a multi-byte character cut in two)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        return [_decode(line) for line in lines if line.strip(b"\0\r")]

    def close(self) -> list[str]:
        """What is left when the connection ends (a last line without its newline)."""
        rest, self._buffer = self._buffer, b""
        return [_decode(rest)] if rest.strip(b"\0\r") else []


def _decode(line: bytes) -> str:
    return line.replace(b"\0", b"").rstrip(b"\r").decode("utf-8", errors="replace")


class WhisperStreamingMapper:
    """Feed it the server's lines (text or SimulStreaming JSON), get events. `lang`: the
    recogniser's language, for joining lines that carry no spaces of their own."""

    def __init__(
        self,
        writer: EventWriter,
        *,
        lang: str | None = None,
        segmentation: Segmentation | None = None,
    ) -> None:
        self.writer = writer
        self.segmentation = segmentation or Segmentation()
        self._joiner = word_joiner(lang)
        # A line began with a space once: this backend writes its own spaces, so lines are
        # joined as they are (faster-whisper, SimulStreaming); else with the joiner.
        self._spaced = False
        self._text = ""  # the open segment's committed text, as the lines gave it
        self._start: float | None = None
        self._end: float | None = None
        self._last_end: float | None = None  # session clock, ms

    def feed(self, message: str | bytes) -> list[PartialTranscript]:
        line = message.decode("utf-8", "replace") if isinstance(message, bytes) else message
        line = line.strip("\0\r\n")
        if not line.strip():
            return []
        if line.lstrip().startswith("{"):
            return self._json(line)
        parts = line.split(" ", 2)
        if len(parts) < 2:
            return []
        try:
            beg, end = float(parts[0]), float(parts[1])
        except ValueError:
            return []  # not a line of this protocol
        return self._piece(beg, end, parts[2] if len(parts) == 3 else "")

    def _json(self, line: str) -> list[PartialTranscript]:
        obj = read_json(line)
        if not isinstance(obj, dict):
            return []
        events: list[PartialTranscript] = []
        text = obj.get("text")
        if isinstance(text, str) and text:
            try:
                beg, end = float(obj["start"]) * 1000.0, float(obj["end"]) * 1000.0
            except (KeyError, TypeError, ValueError):
                beg = end = self._last_end if self._last_end is not None else 0.0
            events += self._piece(beg, end, text)
        if obj.get("is_final") is True:
            events += self._close()
        return events

    def _piece(self, beg: float, end: float, text: str) -> list[PartialTranscript]:
        if not text.strip():
            return []
        events: list[PartialTranscript] = []
        pause = self.segmentation.pause_ms
        if self._text and self._last_end is not None and beg - self._last_end >= pause:
            events += self._close()
        self._last_end = end
        if text[0].isspace():
            self._spaced = True
        before = len(self._text)
        if not self._text:
            joined = text
            self._start = beg
        elif self._spaced or text[0].isspace() or self._text[-1].isspace() or text[0] in _GLUED:
            joined = self._text + text
        else:
            joined = self._text + self._joiner + text
        added = max(1, len(joined) - before)

        def at(index: int) -> float:  # a time inside this line, by characters
            return beg + (end - beg) * min(1.0, max(0, index - before) / added)

        cut = 0
        for match in SENTENCE_END.finditer(joined, before):
            head = joined[cut : match.end()]
            if head.strip():
                events += self.writer.final(head, self._start, at(match.end()))
            cut = match.end()
            self._start = at(cut)
        self._text = joined[cut:]
        self._end = end
        if not self._text.strip():
            self._text, self._start = "", None
            return events
        events += self.writer.partial(self._text, self._start, end, len(self._text))
        if len(self.writer.open_text) >= self.segmentation.max_chars:
            events += self._close()
        return events

    def _close(self) -> list[PartialTranscript]:
        text, start, end = self._text, self._start, self._end
        self._text, self._start = "", None
        if not text.strip():
            return []
        return self.writer.final(text, start, end)

    def idle(self) -> list[PartialTranscript]:
        """No line for a while: the open segment's committed text is its final."""
        return self._close()

    def end_session(self, next_offset_ms: float | None = None) -> list[PartialTranscript]:
        """The session ended: the open segment is a final (its text was committed), and
        the next session's times start from 0 again."""
        events = self._close()
        self._last_end = None
        return events + self.writer.end_session(next_offset_ms)
