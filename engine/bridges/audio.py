"""The audio a bridge streams to a recogniser that wants it from its client (WhisperLive,
Vosk, whisper_streaming): a WAV file, or raw PCM on stdin, sent at the speed it plays.

Read by the speech layer's sources (`engine.asr.audio`), but 16-bit mono PCM only and no
resampling: the recognisers want 16 kHz 16-bit mono (Vosk takes any rate, which the bridge
tells it), and converting a file is `ffmpeg`'s job, not a bridge's. stdin ("-") is raw
signed 16-bit little-endian PCM at 16 kHz, as `arecord -f S16_LE -c1 -r 16000 -t raw`
writes it (the input whisper_streaming's README pipes into its server).

Real time matters (`paced_chunks`); the clock starts again with each recogniser session,
so that the audio that waited out a reconnect is not thrown at the new session in one
burst. The position carries over sessions: after a reconnect the audio goes on where it
was (what the lost session had not transcribed yet is lost with it; the interrupted
segment is closed by the bridge).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

from engine.asr.audio import SAMPLE_BYTES, PcmSource, RawSource, WavSource, paced_chunks
from engine.asr.errors import AudioFileError
from engine.bridges.errors import BridgeError


class AudioSource:
    """PCM chunks from `path` (a WAV file, or "-" for raw PCM on stdin). `rate`: the
    sample rate the recogniser needs (None: any, the file's own; see `sample_rate`)."""

    def __init__(self, path: str, *, rate: int | None = 16000, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.path = path
        self.speed = speed
        self.samples = 0  # sent so far
        self.ended = False  # every chunk was taken: no session has anything left to send
        self._source: PcmSource = (
            RawSource(sys.stdin.buffer, rate or 16000) if path == "-" else _wav(path, rate)
        )
        self.sample_rate = self._source.rate

    @property
    def position_ms(self) -> float:
        """Where the audio is: the time, on the audio's clock, of the next sample."""
        return self.samples * 1000.0 / self.sample_rate

    async def chunks(self, samples: int) -> AsyncIterator[bytes]:
        """The rest of the audio in chunks of `samples`, each when it is due; the clock
        starts at the first one."""
        async for chunk in paced_chunks(self._source, samples, self.speed):
            self.samples += len(chunk) // SAMPLE_BYTES
            yield chunk
        self.ended = True

    def close(self) -> None:
        self._source.close()


def _wav(path: str, rate: int | None) -> WavSource:
    """The WAV at `path`, if it is what the recogniser takes as it is."""
    try:
        wav = WavSource(path)
    except AudioFileError as exc:
        raise BridgeError(str(exc)) from None
    if wav.channels != 1 or wav.width != SAMPLE_BYTES or (rate is not None and wav.rate != rate):
        found = f"{wav.rate} Hz, {8 * wav.width}-bit, {wav.channels} channel(s)"
        wav.close()
        want = f"{rate} Hz " if rate is not None else ""
        raise BridgeError(
            f"{path}: {found}; the recogniser needs {want}16-bit mono PCM "
            f"(convert it: ffmpeg -i {path} -ar {rate or 16000} -ac 1 -c:a pcm_s16le OUT.wav)"
        )
    return wav
