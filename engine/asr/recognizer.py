"""The recognizer seam: audio in, `PartialTranscript` events out.

A speech recognizer is a sans-I/O object here (`Recognizer`): `accept(pcm)` takes 16-bit
mono PCM at its own `sample_rate` and returns what it heard as `SpeechHypothesis`es (the
utterance's whole text so far, then one final per utterance, times in ms of the audio it was
given); `flush()` ends the audio. An adapter (`engine.asr.sphinx`) wraps one library that
way and does nothing else. What every recognizer needs, and none should do on its own, is
`RecognizerStream` (sans I/O, one per audio stream):

- it checks and converts the audio: any rate the audio module takes is resampled to the
  recognizer's; a byte count that ends inside a sample carries its dangling byte over to
  the next chunk (pipes and sockets cut audio anywhere, so refusing odd counts would make
  every reader count bytes); audio after `flush` is refused;
- it numbers hypotheses into `PartialTranscript`s (segment ids, `seq`, times on the
  stream's audio clock, repeats dropped, one final per segment that was shown), and keeps
  the stream going when the recognizer raises (`RecognizerFailed`).

`SpeechStream` is what a caller holds: a `RecognizerStream` in this process, or an
`engine.asr.pool.PooledStream` whose `RecognizerStream` lives in a worker process.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from engine.asr.audio import SAMPLE_BYTES, Resampler, check_rate
from engine.asr.errors import AudioFormatError, RecognizerFailed, StreamFinished
from protocol import InvalidMessage, PartialTranscript

log = logging.getLogger(__name__)


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


@runtime_checkable
class Closable(Protocol):
    """A recognizer that holds what another stream could use (a loaded model): `close`,
    once its stream is done (flushed or dropped), hands it back. Called once, last."""

    def close(self) -> None: ...


RecognizerFactory = Callable[[], Recognizer]
"""Makes one recognizer per audio stream (recognizers are not thread-safe and keep the
state of their utterance). Run in worker processes it must pickle: a module-level function
or class, or a `functools.partial` of one (not a lambda)."""


class Numbering:
    """A stream's event numbering: the segment and `seq` of the next event, and the
    current segment's last partial (what a final must keep when the recognizer ends the
    segment with no words, or fails). Kept by the stream that makes the events, and
    followed by a stream that receives them from elsewhere (`follow`), so both agree."""

    def __init__(self, stream_id: str, first_segment: int = 0, first_seq: int = 0) -> None:
        self.stream_id = stream_id
        self.segment = first_segment
        self.seq = first_seq
        self.shown: PartialTranscript | None = None  # the segment's last partial

    def event(
        self, text: str, final: bool, start: float, end: float, stable: int | None
    ) -> PartialTranscript:
        """The next event, numbered."""
        try:
            event = PartialTranscript(
                self.stream_id, self.segment, self.seq, text, final, start, end, stable
            )
        except InvalidMessage as exc:
            raise ValueError(f"the recognizer's hypothesis is not a valid event: {exc}") from exc
        self.follow([event])
        return event

    def follow(self, events: list[PartialTranscript]) -> None:
        """Take note of events numbered as `event` numbers them."""
        for event in events:
            self.seq = event.seq + 1
            if event.is_final:
                self.segment = event.segment_id + 1
                self.shown = None
            else:
                self.shown = event

    def finalize(self) -> list[PartialTranscript]:
        """Close the segment in progress with what it showed last (nothing if none)."""
        shown = self.shown
        if shown is None:
            return []
        return [self.event(shown.text, True, shown.start_ms or 0.0, shown.end_ms or 0.0, None)]


class SpeechStream(ABC):
    """One audio stream's recognition, wherever it runs: bytes in, events out.

    `accept` recognizes the next chunk, `flush` ends the audio (both may raise
    `AudioFormatError`, `StreamFinished`, or `RecognizerFailed` with the events to push
    anyway). What does not depend on where the recognizer runs is kept here, so that a
    stream in this process and one in a worker process refuse, count and number alike:
    the checks on what a stream may take, the audio clock (`heard_ms`), the numbering
    (`segment_id`, `seq`), and the wall and CPU time recognition took (`busy_s`,
    `cpu_s`). One call at a time."""

    def __init__(
        self,
        stream_id: str,
        rate_in: int,
        *,
        first_segment: int = 0,
        first_seq: int = 0,
        offset_ms: float = 0.0,
    ) -> None:
        self.stream_id = stream_id
        self.rate_in = rate_in
        self.offset_ms = offset_ms
        self.finished = False
        self.busy_s = 0.0  # time spent in the recognizer and resampling (for its RTF)
        self.cpu_s = 0.0  # CPU time of those calls, on the thread that made them
        self._bytes_in = 0
        self._numbering = Numbering(stream_id, first_segment, first_seq)

    @property
    def heard_ms(self) -> float:
        """Audio taken so far (every whole sample), in ms on the stream's clock: the time
        a live stream's events are made at, what the recognizer could have heard."""
        return self.offset_ms + (self._bytes_in // SAMPLE_BYTES) * 1000.0 / self.rate_in

    @property
    def segment_id(self) -> int:
        """The segment the next event belongs to."""
        return self._numbering.segment

    @property
    def seq(self) -> int:
        """The `seq` of the next event."""
        return self._numbering.seq

    @abstractmethod
    def accept(self, pcm: bytes | bytearray | memoryview) -> list[PartialTranscript]:
        """Recognize the next chunk of audio; the events it completes."""

    @abstractmethod
    def flush(self) -> list[PartialTranscript]:
        """End of the audio: the last utterance's final."""

    @abstractmethod
    def close(self) -> None:
        """Done with the stream (flushed or not): what its recognizer holds is freed or
        goes to the next stream. Never blocks for long; idempotent."""

    def _take(self, pcm: object) -> bytes:
        """A chunk this stream may take, as bytes, counted on its clock."""
        if self.finished:
            raise StreamFinished(
                f"stream {self.stream_id!r}: audio after flush (the stream's audio has ended)"
            )
        if not isinstance(pcm, (bytes, bytearray, memoryview)):
            raise AudioFormatError(
                f"audio must be bytes of 16-bit mono PCM, got {type(pcm).__name__}"
            )
        data = bytes(pcm)
        self._bytes_in += len(data)
        return data

    def _finish(self) -> None:
        """The audio ends here (once)."""
        if self.finished:
            raise StreamFinished(f"stream {self.stream_id!r}: flushed already")
        self.finished = True


class RecognizerStream(SpeechStream):
    """One audio stream through one recognizer, in this process.

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
        self.rate_out = check_rate(recognizer.sample_rate)
        super().__init__(
            stream_id,
            self.rate_out if sample_rate is None else check_rate(sample_rate),
            first_segment=first_segment,
            first_seq=first_seq,
            offset_ms=offset_ms,
        )
        self._resampler = (
            Resampler(self.rate_in, self.rate_out) if self.rate_in != self.rate_out else None
        )
        self._carry = b""  # a dangling byte: the first half of a sample
        self.dropped_bytes = 0  # a dangling byte left at `flush`
        self._closed = False

    def accept(self, pcm: bytes | bytearray | memoryview) -> list[PartialTranscript]:
        """Recognize the next chunk of audio; the events it completes."""
        data = self._carry + self._take(pcm)
        whole = len(data) - len(data) % SAMPLE_BYTES
        self._carry = data[whole:]
        if not whole:
            return []
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._call(lambda: self.recognizer.accept(self._convert(data[:whole])))
        finally:
            self.busy_s += time.perf_counter() - started
            self.cpu_s += time.thread_time() - cpu

    def flush(self) -> list[PartialTranscript]:
        """End of the audio: the last utterance's final. A dangling byte left over is half
        a sample and is dropped (`dropped_bytes`, with a warning)."""
        self._finish()
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
        # The recognizer ended without the final it owed: the words shown last stay.
        return events + self._numbering.finalize()

    def close(self) -> None:
        """Done with the stream: the recognizer is closed if it can be (`Closable`)."""
        recognizer = self.recognizer
        if self._closed or not isinstance(recognizer, Closable):
            self._closed = True
            return
        self._closed = True
        try:
            recognizer.close()
        except Exception:
            log.exception("stream %r: the recognizer did not close", self.stream_id)

    def _convert(self, data: bytes) -> bytes:
        if self._resampler is None:
            return data
        samples = np.frombuffer(data, dtype="<i2").astype(np.int16)
        return self._resampler.process(samples).astype("<i2").tobytes()

    def _call(self, work: Callable[[], list[SpeechHypothesis]]) -> list[PartialTranscript]:
        """Run the recognizer and number what it heard; when it raises (or hands back a
        hypothesis no event can carry), the events made so far and the segment in
        progress, made final, go with `RecognizerFailed`."""
        events: list[PartialTranscript] = []
        try:
            for heard in work():
                events += self._events(heard)
        except Exception as exc:
            events += self._numbering.finalize()
            raise RecognizerFailed(self.stream_id, self.heard_ms, events) from exc
        return events

    def _events(self, heard: SpeechHypothesis) -> list[PartialTranscript]:
        text = " ".join(heard.text.split())
        # Times to the microsecond: a recognizer's sums of frame lengths in float seconds
        # say nothing more, and logs stay readable.
        start = round(self.offset_ms + max(0.0, float(heard.start_ms)), 3)
        end = max(start, round(self.offset_ms + float(heard.end_ms), 3))
        numbering = self._numbering
        if heard.is_final:
            if not text:  # no words: the words shown last stay (see the class docstring)
                return numbering.finalize()
            return [numbering.event(text, True, start, end, None)]
        if not text or (numbering.shown is not None and text == numbering.shown.text):
            return []
        return [numbering.event(text, False, start, end, heard.stable_chars)]
