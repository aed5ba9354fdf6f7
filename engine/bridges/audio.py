"""The audio a bridge streams to a recogniser that wants it from its client (WhisperLive,
Vosk, whisper_streaming): a WAV file, or raw PCM on stdin, sent at the speed it plays.

16-bit mono PCM only, and no resampling: the recognisers want 16 kHz 16-bit mono (Vosk
takes any rate, which the bridge tells it), and converting is `ffmpeg`'s job
(`ffmpeg -i IN -ar 16000 -ac 1 -c:a pcm_s16le OUT.wav`), not a bridge's. stdin ("-") is
raw signed 16-bit little-endian PCM at 16 kHz, as `arecord -f S16_LE -c1 -r 16000 -t raw`
writes it (the input whisper_streaming's README pipes into its server).

Real time matters: a recogniser shown an hour of audio in a second answers as it would
never answer live. Each chunk is sent when it is due (`speed` > 1 plays faster, for
tests); the clock starts again with each recogniser session, so that the audio that waited
out a reconnect is not thrown at the new session in one burst. The position carries over
sessions: after a reconnect the audio goes on where it was (what the lost session had
not transcribed yet is lost with it; the interrupted segment is closed by the bridge).
"""

from __future__ import annotations

import sys
import time
import wave
from collections.abc import AsyncIterator
from typing import BinaryIO

import anyio
import anyio.to_thread

from engine.bridges.errors import BridgeError

SAMPLE_WIDTH = 2  # bytes: 16-bit PCM


class AudioSource:
    """PCM chunks from `path` (a WAV file, or "-" for raw PCM on stdin). `rate`: the
    sample rate the recogniser needs (None: any, the file's own; see `sample_rate`)."""

    def __init__(self, path: str, *, rate: int | None = 16000, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.path = path
        self.speed = speed
        self.samples = 0  # sent so far
        self._wav: wave.Wave_read | None = None
        self._stdin: BinaryIO | None = None
        if path == "-":
            self._stdin = sys.stdin.buffer
            self.sample_rate = rate or 16000
            return
        try:
            wav = wave.open(path, "rb")  # noqa: SIM115 (kept open across sessions; `close`)
        except (wave.Error, EOFError) as exc:
            raise BridgeError(f"{path}: not a WAV file ({exc})") from None
        if (
            wav.getnchannels() != 1
            or wav.getsampwidth() != SAMPLE_WIDTH
            or (rate is not None and wav.getframerate() != rate)
        ):
            found = (
                f"{wav.getframerate()} Hz, {8 * wav.getsampwidth()}-bit, "
                f"{wav.getnchannels()} channel(s)"
            )
            wav.close()
            want = f"{rate} Hz " if rate is not None else ""
            raise BridgeError(
                f"{path}: {found}; the recogniser needs {want}16-bit mono PCM "
                f"(convert it: ffmpeg -i {path} -ar {rate or 16000} -ac 1 -c:a pcm_s16le OUT.wav)"
            )
        self._wav = wav
        self.sample_rate = wav.getframerate()

    @property
    def position_ms(self) -> float:
        """Where the audio is: the time, on the audio's clock, of the next sample."""
        return self.samples * 1000.0 / self.sample_rate

    async def chunks(self, samples: int) -> AsyncIterator[bytes]:
        """The rest of the audio in chunks of `samples`, each when it is due; the clock
        starts at the first one."""
        began = time.monotonic()
        sent = 0
        while True:
            chunk = await self._read(samples)
            if not chunk:
                return
            delay = began + sent / self.sample_rate / self.speed - time.monotonic()
            if delay > 0:
                await anyio.sleep(delay)
            sent += len(chunk) // SAMPLE_WIDTH
            self.samples += len(chunk) // SAMPLE_WIDTH
            yield chunk

    async def _read(self, samples: int) -> bytes:
        if self._wav is not None:
            return self._wav.readframes(samples)
        if self._stdin is None:
            return b""
        data: bytes = await anyio.to_thread.run_sync(
            self._stdin.read, samples * SAMPLE_WIDTH, abandon_on_cancel=True
        )
        return data[: len(data) - len(data) % SAMPLE_WIDTH]

    def close(self) -> None:
        if self._wav is not None:
            self._wav.close()
            self._wav = None
