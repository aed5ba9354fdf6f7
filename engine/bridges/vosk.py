"""Vosk server (alphacep/vosk-server, `websocket/asr_server.py`) to `PartialTranscript`
events, sans I/O.

What its WebSocket server says, as read in alphacep/vosk-server at c2e82f0 and
alphacep/vosk-api `src/recognizer.cc`:

- The client may first send `{"config": {"sample_rate": ..., "words": ...,
  "max_alternatives": ...}}` (`recognize`), then binary audio frames (16-bit mono PCM at
  that rate; `websocket/test.py` sends 0.2 s frames), and `{"eof" : 1}` at the end.
- Every frame is answered by one message (`process_chunk`): `PartialResult()` while the
  utterance goes on, `{"partial": "..."}` (with `"partial_result": [words]` when partial
  words are on); `Result()` when the recogniser found an endpoint,
  `{"result": [{"conf", "end", "start", "word"}, ...], "text": "..."}` (`MbrResult`; no
  `result` without words), or with `max_alternatives`, `{"alternatives": [{"text",
  "confidence", "result"?}, ...]}` best first (`NbestResult`); an endpoint with nothing
  recognised is `{"text": ""}` (`StoreEmptyReturn`). `{"eof" : 1}` is answered by
  `FinalResult()` and the server closes.
- Word times are seconds from the recogniser's creation, one per connection.

The mapping: a partial is the open segment's hypothesis (Vosk says nothing of which part
is settled: no `stable_chars`); a result is the segment's final (its first and last words'
times when it has words), and the next partial starts the next segment. An empty result
after partials means the recogniser heard nothing after all: the segment is abandoned
(there is no empty final).

Each connection is its own recogniser: a second client cannot listen to someone else's
session, so `--listen` relays a client's session through the bridge instead.
"""

from __future__ import annotations

import json
from typing import Any

from engine.bridges.events import EventWriter
from engine.bridges.upstream import read_json
from protocol import PartialTranscript

EOF_MESSAGE = '{"eof" : 1}'
CHUNK_SECONDS = 0.2


def config_message(sample_rate: int) -> str:
    """The session's config: the audio's rate, and word times for the segments' times."""
    return json.dumps({"config": {"sample_rate": sample_rate, "words": 1}})


def _span(words: object) -> tuple[float | None, float | None]:
    """First start and last end (ms) of a Vosk word list."""
    if not isinstance(words, list) or not words:
        return None, None
    first, last = words[0], words[-1]
    if not isinstance(first, dict) or not isinstance(last, dict):
        return None, None
    try:
        return float(first["start"]) * 1000.0, float(last["end"]) * 1000.0
    except (KeyError, TypeError, ValueError):
        return None, None


class VoskMapper:
    """Feed it the server's text messages, get events."""

    def __init__(self, writer: EventWriter) -> None:
        self.writer = writer

    def feed(self, message: str | bytes) -> list[PartialTranscript]:
        obj: Any = read_json(message)
        if not isinstance(obj, dict):
            return []
        if "partial" in obj:
            start, end = _span(obj.get("partial_result"))
            return self.writer.partial(str(obj["partial"]), start, end)
        alternatives = obj.get("alternatives")
        if isinstance(alternatives, list):
            obj = alternatives[0] if alternatives and isinstance(alternatives[0], dict) else {}
        elif "text" not in obj:
            return []
        start, end = _span(obj.get("result"))
        return self.writer.final(str(obj.get("text", "")), start, end)

    def idle(self) -> list[PartialTranscript]:
        """Nothing: Vosk ends utterances itself (it answers every frame)."""
        return []

    def end_session(self, next_offset_ms: float | None = None) -> list[PartialTranscript]:
        """The connection ended without the utterance's result: the writer's
        `interrupted` rule closes it; the next recogniser counts from 0 again."""
        return self.writer.end_session(next_offset_ms)
