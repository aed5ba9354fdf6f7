"""WhisperLive (collabora/WhisperLive) to `PartialTranscript` events, sans I/O.

What its WebSocket server says, as read in collabora/WhisperLive at bde730b:

- The client opens with one JSON config (`whisper_live/client.py`, `Client.on_open`:
  `uid`, `language`, `task`, `model`, `use_vad`, ...; the server reads `uid`, `language`,
  `task` and `model` with `options[...]`, so they must be there: `server.py`,
  `initialize_client`), then sends audio as binary frames: float32 samples at 16 kHz
  (`client.py`, `bytes_to_float_array`: int16 / 32768; `server.py`,
  `get_audio_from_websocket`: `np.frombuffer(..., float32)` unless the config names another
  `audio_format`, which older servers do not know), and `b"END_OF_AUDIO"` at the end, after
  which the server cleans up and closes at once.
- The server answers `{"uid", "message": "SERVER_READY", "backend"}` once its model is
  loaded, `{"uid", "status": "WAIT"|"ERROR"|"WARNING", "message"}`, `{"uid", "language",
  "language_prob"}`, and transcripts `{"uid", "segments": [...]}`
  (`backend/base.py`, `send_transcription_to_client`).
- `segments` is the last `send_last_n_segments` completed segments, every time again,
  then at most one incomplete segment (`base.py`, `prepare_segments`), each
  `{"start": "%.3f", "end": "%.3f", "text", "completed"}` in seconds from the session's
  start (`format_segment`). A completed segment never changes; the incomplete one is the
  hypothesis of the audio after them (`update_segments`).

The mapping: each completed segment not seen before is a final, once; the incomplete last
segment is a partial of the segment after the last final. Which completed segments are new
follows from the window itself: it is the latest completed segments in order, so the
segments already taken are the longest run at its head that ends the list of those taken,
compared by text and times. WhisperLive's own client compares times only (new when it
starts at or after the end of the last one taken, `Client.process_segments`), which a
segment whose times are missing or not numbers ("nan") defeats: it would be taken again
from every message repeating it. WhisperLive does not say which part of the incomplete
segment is settled, so partials carry no `stable_chars`.

Not mapped: the TensorRT backend's segments, which have no `completed` flag and no times
(`backend/trt_backend.py`, `handle_transcription_output`): a message like that raises
`BridgeError` rather than being read as partials whose finals never come.
"""

from __future__ import annotations

import json
import uuid
from collections import deque
from typing import Any

import numpy as np

from engine.bridges.errors import BridgeError
from engine.bridges.events import EventWriter
from engine.bridges.upstream import clean, finite, read_json
from protocol import PartialTranscript

END_OF_AUDIO = b"END_OF_AUDIO"
SERVER_READY = "SERVER_READY"
SAMPLE_RATE = 16000
CHUNK_SAMPLES = 4096
"""Samples per audio frame, as WhisperLive's client sends them (`TranscriptionTeeClient`
`chunk`)."""


def new_uid() -> str:
    """A client id like WhisperLive's client makes (`uuid4`): the server tags its replies
    with it."""
    return str(uuid.uuid4())


def config_message(uid: str, *, lang: str | None, model: str, use_vad: bool = True) -> str:
    """The first message of a session (`Client.on_open`'s keys that the server requires,
    and `use_vad`, which it reads first)."""
    return json.dumps(
        {
            "uid": uid,
            "language": lang,
            "task": "transcribe",
            "model": model,
            "use_vad": use_vad,
        }
    )


def float32_audio(pcm16: bytes) -> bytes:
    """16-bit little-endian PCM as the float32 frames WhisperLive expects (its client's
    `bytes_to_float_array`: sample / 32768)."""
    samples = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768.0
    return samples.astype("<f4").tobytes()


_REMEMBER = 256
"""Completed segments remembered per session to recognise them in later windows (the
server repeats its last `send_last_n_segments`, 10 by default)."""

_Key = tuple[str, float | None, float | None]
"""A completed segment as compared: (text, start_ms, end_ms), unknown times None."""


def _seconds(value: object) -> float | None:
    """A segment time ("%.3f" seconds) in ms; None when missing or no finite number."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return finite(seconds * 1000.0)


def _already_taken(taken: deque[_Key], window: list[_Key]) -> int:
    """How many segments at the head of `window` were taken before: the longest head that
    is also the tail of `taken`."""
    for k in range(min(len(taken), len(window)), 0, -1):
        if all(taken[len(taken) - k + i] == window[i] for i in range(k)):
            return k
    return 0


class WhisperLiveMapper:
    """Feed it the server's text messages, get events. `uid`: the session's client id
    (messages for another are ignored, as WhisperLive's client does); None takes any
    (a relayed session, whose client chose the id)."""

    def __init__(self, writer: EventWriter, uid: str | None = None) -> None:
        self.writer = writer
        self.uid = uid
        self.ready = False  # SERVER_READY came
        self.status: tuple[str, str] | None = None  # the last WAIT / ERROR / WARNING
        self.backend: str | None = None
        self._taken: deque[_Key] = deque(maxlen=_REMEMBER)  # completed ones, in order

    def feed(self, message: str | bytes) -> list[PartialTranscript]:
        obj = read_json(message)
        if not isinstance(obj, dict):
            return []
        if self.uid is not None and obj.get("uid") != self.uid:
            return []
        if "status" in obj:
            self.status = (clean(str(obj["status"])), clean(str(obj.get("message", ""))))
            return []
        if obj.get("message") == SERVER_READY:
            self.ready = True
            self.backend = clean(str(obj.get("backend", ""))) or None
            return []
        segments = obj.get("segments")
        if not isinstance(segments, list):
            return []  # "language", "DISCONNECT", translated_segments: nothing to map
        return self._segments([s for s in segments if isinstance(s, dict)])

    def _segments(self, segments: list[dict[str, Any]]) -> list[PartialTranscript]:
        if segments and not any("completed" in s for s in segments):
            raise BridgeError(
                "WhisperLive sent segments without 'completed' (its TensorRT backend?): "
                "the bridge maps the faster_whisper and openvino backends only"
            )
        window: list[_Key] = [
            (str(seg.get("text", "")), _seconds(seg.get("start")), _seconds(seg.get("end")))
            for seg in segments
            if seg.get("completed")
        ]
        events: list[PartialTranscript] = []
        for key in window[_already_taken(self._taken, window) :]:
            self._taken.append(key)
            events += self.writer.final(*key)
        if segments and not segments[-1].get("completed"):
            last = segments[-1]
            start, end = _seconds(last.get("start")), _seconds(last.get("end"))
            events += self.writer.partial(str(last.get("text", "")), start, end)
        return events

    def end_session(self, next_offset_ms: float | None = None) -> list[PartialTranscript]:
        """The session ended (END_OF_AUDIO, or the connection was lost): the incomplete
        segment is closed by the writer's `interrupted` rule (`FINAL`: sent as a final,
        as WhisperLive's client writes its last incomplete segment into its SRT file);
        the next session counts its times from 0 again."""
        self._taken.clear()
        self.ready = False
        return self.writer.end_session(next_offset_ms)

    def idle(self) -> list[PartialTranscript]:
        """Nothing: WhisperLive completes segments itself."""
        return []
