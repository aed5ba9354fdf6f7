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

The mapping: each completed segment not seen before is a final (once: a completed segment
is new when it starts at or after the end of the last one taken, the test WhisperLive's own
client applies in `Client.process_segments`); the incomplete last segment is a partial of
the segment after the last final. WhisperLive does not say which part of the incomplete
segment is settled, so partials carry no `stable_chars`.

Not mapped: the TensorRT backend's segments, which have no `completed` flag and no times
(`backend/trt_backend.py`, `handle_transcription_output`): a message like that raises
`BridgeError` rather than being read as partials whose finals never come.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np

from engine.bridges.errors import BridgeError
from engine.bridges.events import EventWriter
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


def _seconds(value: object) -> float | None:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return seconds * 1000.0


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
        self._taken_until = -1.0  # end (ms, session clock) of the last completed segment

    def feed(self, message: str | bytes) -> list[PartialTranscript]:
        try:
            obj = json.loads(message)
        except ValueError:
            return []
        if not isinstance(obj, dict):
            return []
        if self.uid is not None and obj.get("uid") != self.uid:
            return []
        if "status" in obj:
            self.status = (str(obj["status"]), str(obj.get("message", "")))
            return []
        if obj.get("message") == SERVER_READY:
            self.ready = True
            self.backend = str(obj.get("backend", "")) or None
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
        events: list[PartialTranscript] = []
        for i, seg in enumerate(segments):
            text = str(seg.get("text", ""))
            start, end = _seconds(seg.get("start")), _seconds(seg.get("end"))
            if seg.get("completed"):
                if start is None or end is None or start < self._taken_until:
                    continue  # sent before: the window repeats the last n segments
                self._taken_until = end
                events += self.writer.final(text, start, end)
            elif i == len(segments) - 1:
                events += self.writer.partial(text, start, end)
        return events

    def end_session(self, next_offset_ms: float | None = None) -> list[PartialTranscript]:
        """The session ended (END_OF_AUDIO, or the connection was lost): the incomplete
        segment is closed by the writer's `interrupted` rule (`FINAL`: sent as a final,
        as WhisperLive's client writes its last incomplete segment into its SRT file);
        the next session counts its times from 0 again."""
        self._taken_until = -1.0
        self.ready = False
        return self.writer.end_session(next_offset_ms)

    def idle(self) -> list[PartialTranscript]:
        """Nothing: WhisperLive completes segments itself."""
        return []
