"""The recognizer seam: audio in, `PartialTranscript` events out, pushed into the translator.

A speech recognizer is a sans-I/O object here (`Recognizer`): `accept(pcm)` takes 16-bit
mono PCM at its own `sample_rate` and returns what it heard as `SpeechHypothesis`es (the
utterance's whole text so far, then one final per utterance, times in ms of the audio it was
given); `flush()` ends the audio. An adapter (`engine.asr`) wraps one library that way and
does nothing else. What every recognizer needs, and none should do on its own, is here:

- `RecognizerStream` (sans I/O, one per audio stream) checks and converts the audio: any
  rate from `MIN_RATE` to `MAX_RATE` is resampled to the recognizer's (`Resampler`); a byte
  count that ends inside a sample carries its dangling byte over to the next chunk (pipes
  and sockets cut audio anywhere, so refusing odd counts would make every reader count
  bytes); audio after `flush` is refused. It numbers hypotheses into `PartialTranscript`s
  (segment ids, `seq`, times on the stream's audio clock, repeats dropped, one final per
  segment that was shown), and keeps the stream going when the recognizer raises
  (`RecognizerFailed`).
- `Transcriber` (async) runs one stream's `RecognizerStream` in a worker thread, one call
  at a time, under a limiter shared with other streams, and pushes its events into an
  `IncrementalTranslator`: a recognizer is CPU-bound C code that would otherwise stall the
  event loop, and with it every other stream's updates. `listen` uses it: one stream,
  whose recognition (about 4% of a core) fits beside the event loop in one process.
- `engine.streaming.recognizer_pool.RecognizerPool` runs `RecognizerStream`s in worker
  processes instead, for a server with many speakers: a recognizer that holds the GIL
  (pocketsphinx does) keeps all threads of a process to one core.

```python
async with IncrementalTranslator.from_dir("models/fixture/model") as nmt:
    sub = nmt.updates("mic")                        # subscribe first, then feed
    listener = Transcriber(nmt, SphinxRecognizer(options), "mic", sample_rate=44100)
    async for chunk in microphone():                 # bytes of 16-bit mono PCM
        await listener.feed(chunk)
    await listener.finish()                         # last final, then the stream closes
```
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

import anyio
import numpy as np
import numpy.typing as npt

from engine.errors import EngineError
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.lifecycle import Owner
from protocol import ErrorMessage, InvalidEvent, InvalidMessage, PartialTranscript

log = logging.getLogger(__name__)

MIN_RATE = 8000
"""Lowest input rate taken: telephone audio. Below it speech loses the band (to 4 kHz) that
recognizers need, so a lower rate is a wrong `--rate` rather than audio to resample."""
MAX_RATE = 192_000
"""Highest input rate taken (studio audio); past it a rate is a mistake (bytes per second,
or a stereo rate counted twice), and resampling it would only hide that."""

SAMPLE_BYTES = 2  # 16-bit PCM


class AudioFormatError(EngineError, ValueError):
    """Audio the seam cannot take: a rate out of range, or data that is not bytes."""


class StreamFinished(EngineError, RuntimeError):
    """Audio (or a second flush) after `flush`: the stream's audio has ended."""


def accepted_chunk(stream_id: str, finished: bool, pcm: object) -> bytes:
    """A chunk a stream may take, as bytes: one check for the stream in this thread and
    its worker-process twin (`recognizer_pool.PooledStream`), so both refuse alike."""
    if finished:
        raise StreamFinished(
            f"stream {stream_id!r}: audio after flush (the stream's audio has ended)"
        )
    if not isinstance(pcm, (bytes, bytearray, memoryview)):
        raise AudioFormatError(f"audio must be bytes of 16-bit mono PCM, got {type(pcm).__name__}")
    return bytes(pcm)


class RecognizerFailed(EngineError, RuntimeError):
    """The recognizer raised. The stream goes on (the next chunk is recognized as usual);
    `events` are what was already shown made final (the segment in progress, kept as its
    last partial said, so viewers do not keep a line that never ends) and must still be
    pushed. The recognizer's own exception is the `__cause__`."""

    def __init__(self, stream_id: str, at_ms: float, events: list[PartialTranscript]) -> None:
        super().__init__(
            f"stream {stream_id!r}: the recognizer failed at {at_ms / 1000:.2f} s of audio; "
            "the stream goes on"
        )
        self.stream_id = stream_id
        self.at_ms = at_ms
        self.events = events


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


# -- what a recognizer returns, and the protocol it implements ----------------------------


@dataclass(frozen=True)
class SpeechHypothesis:
    """What a recognizer heard in its current utterance.

    `text`: the whole utterance so far (not a delta), so that a stale hypothesis may be
    skipped without losing words; `is_final`: the utterance ended (the recognizer will not
    change it again). `start_ms`/`end_ms`: the speech it covers, in ms of the audio the
    recognizer was given. `stable_chars`: the recognizer's own stability hint, the leading
    characters of `text` it will not change (None: it has none)."""

    text: str
    is_final: bool
    start_ms: float
    end_ms: float
    stable_chars: int | None = None


class Recognizer(Protocol):
    """A streaming speech recognizer, sans I/O.

    `accept` takes 16-bit little-endian mono PCM at `sample_rate`, always a whole number
    of samples, in chunks of any length, and returns the hypotheses it made meanwhile
    (partials as they change, a final when an utterance ends; nothing is also an answer).
    `flush` ends the audio: the utterance in progress gets its final. Calls come one at a
    time (from a worker thread); after `flush` the object is not called again. A
    recognizer that raises is called again with the next chunk: it should recover on its
    own (end the utterance it was in)."""

    @property
    def sample_rate(self) -> int: ...

    def accept(self, pcm: bytes) -> list[SpeechHypothesis]: ...

    def flush(self) -> list[SpeechHypothesis]: ...


# -- resampling ----------------------------------------------------------------------------

_ZEROS = 16  # sinc zero crossings on each side of an output sample (at the lower rate)
_CUTOFF = 0.9  # pass band edge, as a share of the lower rate's Nyquist frequency
_MAX_TABLE = 2_000_000  # kernel taps kept in a table (16 MB); past it, made per chunk


class Resampler:
    """Streaming resampling of 16-bit mono PCM, in numpy: polyphase windowed-sinc
    (band-limited) interpolation at the exact ratio of the two rates.

    Output sample m lies at input position m * rate_in / rate_out, whose fraction takes
    one of rate_out / gcd(rate_in, rate_out) values (the phases: 160 from 44.1 kHz to
    16 kHz, 1 from 48 kHz, 2 from 8 kHz); each phase has one kernel, a sinc cut at 90% of
    the lower rate's Nyquist frequency under a Blackman window, 16 zero crossings a side,
    normalised to unit gain, kept in a table (about 1% of a core for 44.1 kHz audio).
    So: one code path down and up; every output sample computed from the same input
    samples whatever the chunking (a stream cut anywhere gives the same bytes as the
    whole); a state of a few dozen samples; within one step of 16-bit rounding on tones
    up to 3 kHz.

    Why not linear interpolation, which is simpler: from 48 kHz it folds everything
    between 8 and 24 kHz (fricatives, hiss) into the speech band, and from 8 kHz it
    takes 7% off a 1 kHz tone and more off higher ones; recognizers hear both. Why not
    scipy's `resample_poly`: it is not streaming, and scipy is not a dependency.
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


# -- one stream's recognition, sans I/O ---------------------------------------------------


class RecognizerStream:
    """One audio stream through one recognizer: bytes in, `PartialTranscript`s out.

    `sample_rate` is the input's (None: the recognizer's); other rates are resampled.
    Events get the stream's id, segment ids from `first_segment`, `seq` from `first_seq`
    and times on the stream's audio clock (`offset_ms` plus the audio accepted before).
    A partial whose text repeats the last one is dropped (it would cost a decode for
    nothing); a segment starts with its first non-empty partial. Every segment that was
    shown ends with exactly one final: an utterance the recognizer ends with no words
    after showing some keeps the words it showed last, since a final cannot be empty and a
    segment without one would hang on viewers' screens; the same happens when the
    recognizer raises (`RecognizerFailed`). Not thread-safe: one call at a time.
    """

    def __init__(
        self,
        recognizer: Recognizer,
        stream_id: str,
        *,
        sample_rate: int | None = None,
        first_segment: int = 0,
        first_seq: int = 0,
        offset_ms: float = 0.0,
    ) -> None:
        self.recognizer = recognizer
        self.stream_id = stream_id
        self.rate_out = check_rate(recognizer.sample_rate)
        self.rate_in = self.rate_out if sample_rate is None else check_rate(sample_rate)
        self._resampler = (
            Resampler(self.rate_in, self.rate_out) if self.rate_in != self.rate_out else None
        )
        self.offset_ms = offset_ms
        self._carry = b""  # a dangling byte: the first half of a sample
        self._samples_in = 0
        self._segment = first_segment
        self._seq = first_seq
        self._shown = ""  # the current segment's last text shown ("": none yet)
        self._last_start = 0.0
        self._last_end = 0.0
        self.finished = False
        self.busy_s = 0.0  # time spent in the recognizer and resampling (for its RTF)
        self.cpu_s = 0.0  # CPU time of those calls, on the thread that made them
        self.dropped_bytes = 0  # a dangling byte left at `flush`

    @property
    def heard_ms(self) -> float:
        """Audio accepted so far, in ms on the stream's clock (the time a live stream's
        events are made at: what the recognizer could have heard)."""
        return self.offset_ms + self._samples_in * 1000.0 / self.rate_in

    @property
    def segment_id(self) -> int:
        """The segment the next event belongs to."""
        return self._segment

    @property
    def seq(self) -> int:
        """The `seq` of the next event."""
        return self._seq

    def accept(self, pcm: bytes | bytearray | memoryview) -> list[PartialTranscript]:
        """Recognize the next chunk of audio; the events it completes."""
        data = self._carry + accepted_chunk(self.stream_id, self.finished, pcm)
        whole = len(data) - len(data) % SAMPLE_BYTES
        self._carry = data[whole:]
        if not whole:
            return []
        self._samples_in += whole // SAMPLE_BYTES
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._call(lambda: self.recognizer.accept(self._convert(data[:whole])))
        finally:
            self.busy_s += time.perf_counter() - started
            self.cpu_s += time.thread_time() - cpu

    def flush(self) -> list[PartialTranscript]:
        """End of the audio: the last utterance's final. A dangling byte left over is half
        a sample and is dropped (`dropped_bytes`, with a warning)."""
        if self.finished:
            raise StreamFinished(f"stream {self.stream_id!r}: flushed already")
        self.finished = True
        if self._carry:
            self.dropped_bytes = len(self._carry)
            log.warning(
                "stream %r: the audio ended inside a sample; its last byte was dropped",
                self.stream_id,
            )
            self._carry = b""
        started, cpu = time.perf_counter(), time.thread_time()
        try:

            def last() -> list[SpeechHypothesis]:
                if self._resampler is not None:
                    tail = self._resampler.flush().astype("<i2").tobytes()
                    heard = self.recognizer.accept(tail) if tail else []
                    return [*heard, *self.recognizer.flush()]
                return self.recognizer.flush()

            events = self._call(last)
        finally:
            self.busy_s += time.perf_counter() - started
            self.cpu_s += time.thread_time() - cpu
        if self._shown:  # the recognizer ended without the final it owed
            events += self._finalize()
        return events

    def _convert(self, data: bytes) -> bytes:
        if self._resampler is None:
            return data
        samples = np.frombuffer(data, dtype="<i2").astype(np.int16)
        return self._resampler.process(samples).astype("<i2").tobytes()

    def _call(self, work: _Work) -> list[PartialTranscript]:
        """Run the recognizer and number what it heard; when it raises (or hands back a
        hypothesis no event can carry), the events made so far and the segment in
        progress, made final, go with `RecognizerFailed`."""
        events: list[PartialTranscript] = []
        try:
            for heard in work():
                events += self._events(heard)
        except Exception as exc:
            events += self._finalize()
            raise RecognizerFailed(self.stream_id, self.heard_ms, events) from exc
        return events

    def _finalize(self) -> list[PartialTranscript]:
        """Close the segment in progress with what it showed last (nothing if none)."""
        if not self._shown:
            return []
        return [self._event(self._shown, True, self._last_start, self._last_end, None)]

    def _events(self, heard: SpeechHypothesis) -> list[PartialTranscript]:
        text = " ".join(heard.text.split())
        # Times to the microsecond: a recognizer's sums of frame lengths in float seconds
        # (2100.000000000001) say nothing more, and logs stay readable.
        start = round(self.offset_ms + max(0.0, float(heard.start_ms)), 3)
        end = max(start, round(self.offset_ms + float(heard.end_ms), 3))
        if heard.is_final:
            if not text:  # no words: the words shown last stay (see the class docstring)
                return self._finalize()
            return [self._event(text, True, start, end, None)]
        if not text or text == self._shown:
            return []
        return [self._event(text, False, start, end, heard.stable_chars)]

    def _event(
        self, text: str, final: bool, start: float, end: float, stable: int | None
    ) -> PartialTranscript:
        try:
            event = PartialTranscript(
                self.stream_id, self._segment, self._seq, text, final, start, end, stable
            )
        except InvalidMessage as exc:
            raise ValueError(f"the recognizer's hypothesis is not a valid event: {exc}") from exc
        self._seq += 1
        if final:
            self._segment += 1
            self._shown = ""
        else:
            self._shown, self._last_start, self._last_end = text, start, end
        return event


class _Work(Protocol):
    def __call__(self) -> list[SpeechHypothesis]: ...


# -- the async pipeline: recognition off the event loop, into the translator ------------


@dataclass(frozen=True)
class Refused:
    """An event the translator would not take (`error` says why); the stream goes on."""

    event: PartialTranscript
    error: ErrorMessage


class Transcriber:
    """Feed one audio stream to a recognizer and its events to an `IncrementalTranslator`.

    Recognition runs in a worker thread (`anyio.to_thread`), one call at a time for this
    stream (a recognizer is not thread-safe), with at most `limiter`'s tokens of threads
    across the streams sharing it (None: anyio's default thread limiter), so a slow
    recognizer never stalls the event loop or other streams. Events are pushed as the
    stream's `owner` (None: an embedding caller). A refused event (e.g. too many finals
    waiting) is logged and kept in `refused`; a failing recognizer raises
    `RecognizerFailed` from `feed` after its events are pushed, and the stream goes on.
    Subscribe to the stream's updates before the first `feed`.
    """

    def __init__(
        self,
        nmt: IncrementalTranslator,
        recognizer: Recognizer | RecognizerStream,
        stream_id: str | None = None,
        *,
        sample_rate: int | None = None,
        owner: Owner | None = None,
        limiter: anyio.CapacityLimiter | None = None,
    ) -> None:
        if isinstance(recognizer, RecognizerStream):
            if stream_id is not None and stream_id != recognizer.stream_id:
                raise ValueError("stream_id differs from the RecognizerStream's")
            self.stream = recognizer
        else:
            if stream_id is None:
                raise ValueError("a stream_id is needed")
            self.stream = RecognizerStream(recognizer, stream_id, sample_rate=sample_rate)
        self.nmt = nmt
        self.owner = owner
        self._limiter = limiter
        self._lock = anyio.Lock()
        self.pushed = 0  # events the translator took
        self.refused: list[Refused] = []
        self.failures = 0  # times the recognizer raised

    @property
    def stream_id(self) -> str:
        return self.stream.stream_id

    @property
    def opened(self) -> bool:
        """Whether the translator took an event of this stream (else it has no stream to
        close, and its subscribers never see it end)."""
        return self.pushed > 0

    async def feed(self, pcm: bytes | bytearray | memoryview) -> list[PartialTranscript]:
        """Recognize the next chunk of audio in a worker thread and push its events;
        returns them. `AudioFormatError`/`StreamFinished` for audio it cannot take (nothing
        changed), `RecognizerFailed` when the recognizer raised (its events pushed)."""
        chunk = bytes(pcm)  # the caller may reuse its buffer while the thread reads
        async with self._lock:
            return await self._run(lambda: self.stream.accept(chunk))

    async def finish(self, *, close: bool = True) -> list[PartialTranscript]:
        """End the audio: push the last utterance's final, then (`close`) close the
        translator's stream, which returns once its finals are translated and published."""
        try:
            async with self._lock:
                return await self._run(self.stream.flush)
        finally:
            if close and self.opened:
                await self.nmt.close_stream(self.stream_id, self.owner)

    async def _run(self, work: _Events) -> list[PartialTranscript]:
        try:
            events = await anyio.to_thread.run_sync(work, limiter=self._limiter)
        except RecognizerFailed as exc:
            self.failures += 1
            await self._push(exc.events)
            raise
        await self._push(events)
        return events

    async def _push(self, events: list[PartialTranscript]) -> None:
        for event in events:
            try:
                await self.nmt.push(event, self.owner)
            except InvalidEvent as exc:
                self.refused.append(Refused(event, exc.error))
                log.warning(
                    "stream %r: the translator refused seq %d: %s",
                    event.stream_id,
                    event.seq,
                    exc.error.message,
                )
            else:
                self.pushed += 1


class _Events(Protocol):
    def __call__(self) -> list[PartialTranscript]: ...
