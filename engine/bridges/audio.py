"""The audio a bridge streams to a recogniser that wants it from its client (WhisperLive,
Vosk, whisper_streaming): a WAV file, or raw PCM on stdin, sent at the speed it plays.

Read by the speech layer's sources (`engine.asr.audio`), so a bridge takes every WAV that
`listen` takes: any rate it takes, 8-32 bit, channels mixed down. The recognisers want
16 kHz 16-bit mono, so another rate is resampled on the way (Vosk takes any rate, which
the bridge tells it). stdin ("-") is raw signed 16-bit little-endian PCM at 16 kHz, as
`arecord -f S16_LE -c1 -r 16000 -t raw` writes it (the input whisper_streaming's README
pipes into its server).

Real time matters (`paced_chunks`); the clock starts again with each recogniser session,
so that the audio that waited out a reconnect is not thrown at the new session in one
burst. The position carries over sessions: after a reconnect the audio goes on where it
was (what the lost session had not transcribed yet is lost with it; the interrupted
segment is closed by the bridge).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

from engine.asr.audio import (
    SAMPLE_BYTES,
    PcmSource,
    RawSource,
    ResampledSource,
    WavSource,
    paced_chunks,
)
from engine.asr.errors import AudioFileError
from engine.bridges.errors import BridgeError


class AudioSource:
    """PCM chunks from `path` (a WAV file, or "-" for raw PCM on stdin at `raw_rate`).
    `rate`: the sample rate the recogniser needs (None: any, the input's own; see
    `sample_rate`)."""

    def __init__(
        self, path: str, *, rate: int | None = 16000, speed: float = 1.0, raw_rate: int = 16000
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.path = path
        self.speed = speed
        self.samples = 0  # sent so far
        self.ended = False  # every chunk was taken: no session has anything left to send
        self._source: PcmSource = (
            _resampled(RawSource(sys.stdin.buffer, raw_rate), rate)
            if path == "-"
            else _resampled(_wav(path), rate)
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


def _wav(path: str) -> WavSource:
    """The WAV at `path` as 16-bit mono PCM."""
    try:
        return WavSource(path)
    except AudioFileError as exc:
        raise BridgeError(str(exc)) from None
    except OSError as exc:
        raise BridgeError(f"{path}: {exc.strerror or exc}") from None


def _resampled(source: PcmSource, rate: int | None) -> PcmSource:
    """`source` at `rate` (None: its own)."""
    return source if rate is None or source.rate == rate else ResampledSource(source, rate)
