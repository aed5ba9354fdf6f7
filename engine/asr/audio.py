"""Audio input, read and cut one way for every entry: 16-bit mono PCM from a WAV file, a
pipe or stdin (`PcmSource`: `WavSource`, `RawSource`), or frames pushed over the WebSocket
(`Backlog`); rates checked (`check_rate`) and converted (`Resampler`, `ResampledSource`).

`listen`, the server's audio route and the bridges all read audio here, so a rate one of
them takes, or a WAV one of them can read, is taken and read by all.
"""

from __future__ import annotations

import math
import time
import wave
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Protocol

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from engine.asr.errors import AudioFileError, AudioFormatError

MIN_RATE = 8000
"""Lowest input rate taken: telephone audio. Below it speech loses the band (to 4 kHz) that
recognizers need, so a lower rate is a wrong `--rate` rather than audio to resample."""
MAX_RATE = 192_000
"""Highest input rate taken (studio audio); past it a rate is a mistake (bytes per second,
or a stereo rate counted twice), and resampling it would only hide that."""

SAMPLE_BYTES = 2  # 16-bit PCM


def check_rate(rate: object) -> int:
    """The sample rate as an int, or `AudioFormatError` saying what is wrong with it."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise AudioFormatError(f"sample rate must be a number of Hz, got {type(rate).__name__}")
    if not math.isfinite(rate) or rate != int(rate):
        raise AudioFormatError(f"sample rate must be a whole number of Hz, got {rate}")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioFormatError(
            f"sample rate {int(rate)} Hz is outside {MIN_RATE}..{MAX_RATE} Hz: is it the "
            "rate of 16-bit mono PCM (not bytes per second, not a stereo rate)?"
        )
    return int(rate)


# -- resampling ----------------------------------------------------------------------------

_ZEROS = 16  # sinc zero crossings on each side of an output sample (at the lower rate)
_CUTOFF = 0.9  # pass band edge, as a share of the lower rate's Nyquist frequency
_MAX_TABLE = 2_000_000  # kernel taps kept in a table; past it, made per chunk


class Resampler:
    """Streaming resampling of 16-bit mono PCM, in numpy: polyphase windowed-sinc
    (band-limited) interpolation at the exact ratio of the two rates.

    Output sample m lies at input position m * rate_in / rate_out, whose fraction takes
    one of rate_out / gcd(rate_in, rate_out) values (the phases); each phase has one
    kernel, a sinc cut below the lower rate's Nyquist frequency under a Blackman window,
    normalised to unit gain, kept in a table. So: one code path down and up; every output
    sample computed from the same input samples whatever the chunking (a stream cut
    anywhere gives the same bytes as the whole); a state of a few dozen samples.

    Why not linear interpolation, which is simpler: down from 48 kHz it folds fricatives
    and hiss into the speech band, and up from 8 kHz it dulls the higher formants;
    recognizers hear both. Why not scipy's `resample_poly`: it is not streaming, and
    scipy is not a dependency.
    """

    def __init__(self, rate_in: int, rate_out: int) -> None:
        self.rate_in = check_rate(rate_in)
        self.rate_out = check_rate(rate_out)
        g = math.gcd(self.rate_in, self.rate_out)
        self._up, self._down = self.rate_out // g, self.rate_in // g
        scale = min(1.0, self.rate_out / self.rate_in)  # the lower rate, in input units
        self._fc = 0.5 * scale * _CUTOFF  # cycles per input sample
        self._half = half = math.ceil(_ZEROS / scale)
        self._offsets = np.arange(-half + 1, half + 1)
        phases = np.arange(self._up) / self._up
        small = self._up * 2 * half <= _MAX_TABLE  # every common pair of rates is
        self._table = self._kernels(phases) if small else None
        # Input samples still needed, from global index `_base` (zeros before the start).
        self._buf: npt.NDArray[np.float64] = np.zeros(half)
        self._base = -half
        self._emitted = 0  # output samples made
        self._consumed = 0  # input samples taken

    def _kernels(self, fractions: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """The kernel of each fractional position (rows of `2 * half` taps)."""
        d = fractions[:, None] - self._offsets[None, :]  # output position - input sample
        x = d / self._half
        window = 0.42 + 0.5 * np.cos(np.pi * x) + 0.08 * np.cos(2 * np.pi * x)
        kernel = np.sinc(2 * self._fc * d) * window
        normalised: npt.NDArray[np.float64] = kernel / kernel.sum(axis=1, keepdims=True)
        return normalised

    def process(self, samples: npt.NDArray[np.int16]) -> npt.NDArray[np.int16]:
        """The output samples that `samples` (the next input) completes."""
        self._buf = np.concatenate([self._buf, samples.astype(np.float64)])
        self._consumed += len(samples)
        ready = self._base + len(self._buf) - 1 - self._half  # last centre with its taps
        if ready < 0:
            return np.zeros(0, dtype=np.int16)
        return self._emit(((ready + 1) * self._up - 1) // self._down)

    def flush(self) -> npt.NDArray[np.int16]:
        """The output samples still owed at the end of the input (up to its last one)."""
        if self._consumed == 0:
            return np.zeros(0, dtype=np.int16)
        self._buf = np.concatenate([self._buf, np.zeros(self._half)])
        return self._emit((self._consumed - 1) * self._up // self._down)

    def _emit(self, last: int) -> npt.NDArray[np.int16]:
        """Output samples `_emitted` to `last`, then forget the input they alone needed."""
        m = np.arange(self._emitted, last + 1, dtype=np.int64)
        if len(m) == 0:
            return np.zeros(0, dtype=np.int16)
        centre = m * self._down // self._up
        phase = m * self._down % self._up
        kernels = self._table[phase] if self._table is not None else self._kernels(phase / self._up)
        taps = self._buf[(centre - self._base)[:, None] + self._offsets[None, :]]
        out = (taps * kernels).sum(axis=1)
        self._emitted = last + 1
        keep = self._emitted * self._down // self._up - self._half + 1 - self._base
        if keep > 0:
            self._buf = self._buf[keep:]
            self._base += keep
        samples: npt.NDArray[np.int16] = np.clip(np.rint(out), -32768, 32767).astype(np.int16)
        return samples


def resample(pcm: bytes, rate_in: int, rate_out: int) -> bytes:
    """A whole recording of 16-bit mono PCM from `rate_in` to `rate_out` (e.g. espeak-ng's
    22050 Hz to a recognizer's 16 kHz), the same as streaming it through `Resampler`."""
    if len(pcm) % SAMPLE_BYTES:
        raise AudioFormatError(f"{len(pcm)} bytes is not a whole number of 16-bit samples")
    if rate_in == rate_out:
        check_rate(rate_in)
        return bytes(pcm)
    resampler = Resampler(rate_in, rate_out)
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.int16)
    out = np.concatenate([resampler.process(samples), resampler.flush()])
    return out.astype("<i2").tobytes()


def to_mono16(raw: bytes, width: int, channels: int) -> bytes:
    """WAV frames of `width`-byte integer samples and `channels` channels as 16-bit mono
    (channels averaged; 8-bit WAV is unsigned, the others signed little-endian)."""
    if width == 2 and channels == 1:
        return raw
    count = len(raw) // width
    data = np.frombuffer(raw[: count * width], dtype=np.uint8).reshape(count, width)
    if width == 1:
        samples = (data[:, 0].astype(np.int32) - 128) << 8
    else:  # the two most significant bytes of a little-endian sample
        top = data[:, width - 2 :].copy()
        samples = top.view("<i2").reshape(count).astype(np.int32)
    frames = samples[: len(samples) // channels * channels].reshape(-1, channels)
    mono = np.rint(frames.mean(axis=1)) if channels > 1 else frames[:, 0]
    out: bytes = np.clip(mono, -32768, 32767).astype("<i2").tobytes()
    return out


# -- sources that are read -----------------------------------------------------------------


class PcmSource(Protocol):
    """16-bit little-endian mono PCM at `rate`, read `frames` at a time (b"" at the end).
    `duration_s`: None when unknown (a pipe). `blocking`: reads may wait for the data to
    be made (a live pipe), so they run in a worker thread (`read_chunk`)."""

    rate: int
    duration_s: float | None
    blocking: bool

    def read(self, frames: int) -> bytes: ...

    def close(self) -> None: ...


class WavSource:
    """A WAV file of integer PCM (8, 16, 24 or 32 bits; several channels are mixed down
    to one), at any rate the recognizer seam takes. `channels` and `width` (bytes a
    sample) say what the file holds, for a reader that wants it as it is."""

    blocking = False

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        convert = f"convert it, e.g. ffmpeg -i {self.path} -ac 1 -ar 16000 -c:a pcm_s16le OUT.wav"
        try:
            # Open across reads, closed by `close` (the caller's ExitStack).
            self._wav = wave.open(str(self.path), "rb")  # noqa: SIM115
        except (wave.Error, EOFError) as exc:
            raise AudioFileError(
                f"{self.path}: not a WAV file of integer PCM ({exc}); {convert}"
            ) from None
        self.channels = self._wav.getnchannels()
        self.width = self._wav.getsampwidth()
        if self.width not in (1, 2, 3, 4):
            self._wav.close()
            raise AudioFileError(f"{self.path}: {8 * self.width}-bit samples; {convert}")
        try:
            self.rate = check_rate(self._wav.getframerate())
        except AudioFormatError as exc:
            self._wav.close()
            raise AudioFileError(f"{self.path}: {exc}") from None
        self.duration_s: float | None = self._wav.getnframes() / self.rate

    def read(self, frames: int) -> bytes:
        raw = self._wav.readframes(frames)
        if not raw:
            return b""
        return to_mono16(raw, self.width, self.channels)

    def close(self) -> None:
        self._wav.close()


class RawSource:
    """Raw 16-bit little-endian mono PCM from a binary stream (stdin, a pipe), at `rate` Hz."""

    blocking = True
    duration_s: float | None = None

    def __init__(self, stream: IO[bytes], rate: int) -> None:
        self.stream = stream
        self.rate = check_rate(rate)

    def read(self, frames: int) -> bytes:
        data: bytes | None = self.stream.read(frames * SAMPLE_BYTES)
        return data or b""

    def close(self) -> None:
        pass


class ResampledSource:
    """Another source's audio at `rate` (a recogniser that takes one rate only, fed a WAV
    at another): read through a `Resampler`, so that every rate `listen` takes is taken
    wherever audio is sent on."""

    def __init__(self, source: PcmSource, rate: int) -> None:
        self.source = source
        self.rate = check_rate(rate)
        self.blocking = source.blocking
        self.duration_s = source.duration_s
        self._resampler = Resampler(source.rate, self.rate)
        self._ended = False

    def read(self, frames: int) -> bytes:
        """About `frames` samples at `rate` (b"" at the end)."""
        wanted = max(1, math.ceil(frames * self.source.rate / self.rate))
        while not self._ended:
            raw = self.source.read(wanted)
            raw = raw[: len(raw) - len(raw) % SAMPLE_BYTES]
            if raw:
                out = self._resampler.process(np.frombuffer(raw, dtype="<i2").astype(np.int16))
            else:
                self._ended = True
                out = self._resampler.flush()
            if len(out):
                return out.astype("<i2").tobytes()
        return b""

    def close(self) -> None:
        self.source.close()


async def read_chunk(source: PcmSource, frames: int, stop: anyio.Event | None = None) -> bytes:
    """The next chunk; a blocking source is read in a thread, given up when `stop` is set
    (b"": the input ends)."""
    if not source.blocking:
        return source.read(frames)
    data = b""
    async with anyio.create_task_group() as group:

        async def read() -> None:
            nonlocal data
            data = await anyio.to_thread.run_sync(source.read, frames, abandon_on_cancel=True)
            group.cancel_scope.cancel()

        async def wait_stop() -> None:
            if stop is not None:
                await stop.wait()
                group.cancel_scope.cancel()

        group.start_soon(read)
        group.start_soon(wait_stop)
    return data


async def paced_chunks(source: PcmSource, frames: int, speed: float = 1.0) -> AsyncIterator[bytes]:
    """The rest of `source` in chunks of `frames` whole samples, each when it is due at
    `speed` times real time (a recognizer shown an hour of audio in a second answers as it
    never would live); the clock starts at the first chunk."""
    began = time.monotonic()
    sent = 0
    while True:
        data = await read_chunk(source, frames)
        chunk = data[: len(data) - len(data) % SAMPLE_BYTES]
        if not chunk:
            return
        delay = began + sent / source.rate / speed - time.monotonic()
        if delay > 0:
            await anyio.sleep(delay)
        sent += len(chunk) // SAMPLE_BYTES
        yield chunk


# -- frames that are pushed ----------------------------------------------------------------


class Backlog:
    """PCM frames waiting for recognition, bounded in seconds of audio: a receiver pushes
    frames as they come (`put` never waits) and the recognizer takes all that waits at
    once (`take`). A frame past the bound is refused, so that a recognizer that falls
    behind drops audio instead of piling up delay."""

    def __init__(self, rate: int, max_s: float) -> None:
        self.rate = rate
        self.max_s = max_s
        self.max_bytes = int(max_s * rate) * SAMPLE_BYTES
        self._frames: deque[bytes] = deque()
        self._bytes = 0

    def __bool__(self) -> bool:
        return bool(self._frames)

    def seconds(self, pcm: bytes) -> float:
        """How much audio `pcm` holds."""
        return len(pcm) / SAMPLE_BYTES / self.rate

    @property
    def queued_s(self) -> float:
        """How much audio waits."""
        return self._bytes / SAMPLE_BYTES / self.rate

    def put(self, pcm: bytes) -> bool:
        """Queue a frame; False when it would pass the bound (it is dropped)."""
        if self._bytes + len(pcm) > self.max_bytes:
            return False
        self._frames.append(pcm)
        self._bytes += len(pcm)
        return True

    def take(self) -> bytes:
        """Everything queued, as one chunk (the queue is then empty)."""
        chunk = b"".join(self._frames)
        self.clear()
        return chunk

    def clear(self) -> None:
        self._frames.clear()
        self._bytes = 0
