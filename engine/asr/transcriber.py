"""Speech into a translator, off the event loop: `Transcriber` runs one stream's
recognition in a worker thread and pushes its events; `feed_audio` feeds it a `PcmSource`.

A recognizer is CPU-bound C code that would otherwise stall the event loop, and with it
every other stream's updates. `listen` recognizes this way (one stream fits beside the
event loop in one process); a server with many speakers uses `engine.asr.pool` instead.

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import anyio
import anyio.to_thread

from engine.asr.audio import PcmSource, read_chunk
from engine.asr.errors import RecognizerFailed
from engine.asr.recognizer import Recognizer, RecognizerStream
from protocol import ErrorMessage, InvalidEvent, PartialTranscript

log = logging.getLogger(__name__)

CHUNK_MS = 100  # audio per recognizer call: a live microphone's usual buffer

OwnerT = TypeVar("OwnerT")
OwnerT_contra = TypeVar("OwnerT_contra", contravariant=True)


class TranscriptSink(Protocol[OwnerT_contra]):
    """Where a stream's events go (`IncrementalTranslator` is one): `push` raises
    `InvalidEvent` for an event it refuses; `close_stream` returns once the stream's
    finals are done. `owner` is who pushes (None: an embedding caller)."""

    async def push(self, event: PartialTranscript, owner: OwnerT_contra | None = None) -> None: ...

    async def close_stream(self, stream_id: str, owner: OwnerT_contra | None = None) -> None: ...


@dataclass(frozen=True)
class Refused:
    """An event the translator would not take (`error` says why); the stream goes on."""

    event: PartialTranscript
    error: ErrorMessage


class Transcriber(Generic[OwnerT]):
    """Feed one audio stream to a recognizer and its events to a `TranscriptSink`.

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
        nmt: TranscriptSink[OwnerT],
        recognizer: Recognizer | RecognizerStream,
        stream_id: str | None = None,
        *,
        sample_rate: int | None = None,
        owner: OwnerT | None = None,
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

    async def _run(self, work: Callable[[], list[PartialTranscript]]) -> list[PartialTranscript]:
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


# -- a source into a transcriber ----------------------------------------------------------


@dataclass
class Fed:
    """What `feed_audio` did: the audio it fed, the recognizer's failures, and each
    batch of events with the audio heard when they were made (their `emit_ms`)."""

    heard_ms: float = 0.0
    failures: list[RecognizerFailed] = field(default_factory=list)
    events: list[tuple[PartialTranscript, float]] = field(default_factory=list)
    started: float = 0.0  # `time.perf_counter()` when the first chunk was read
    wall_s: float = 0.0


async def feed_audio(
    transcriber: Transcriber[OwnerT],
    source: PcmSource,
    *,
    realtime: bool = False,
    stop: anyio.Event | None = None,
    close: bool = True,
    chunk_ms: int = CHUNK_MS,
    on_events: Callable[[list[PartialTranscript], float], None] | None = None,
    on_audio: Callable[[float], None] | None = None,
) -> Fed:
    """Feed `source` to `transcriber` chunk by chunk, then finish it (`close`: close the
    translator's stream too, which returns once its finals are published).

    `realtime`: a chunk is fed once its audio would have been captured (a file played as
    a live microphone); else as fast as recognition goes. `stop`: when set, the input
    ends there (what was heard is still finished). A failing recognizer is logged and
    the audio goes on (`Fed.failures`). `on_events` sees each batch of events with the
    audio heard; `on_audio` the audio heard after each chunk.
    """
    fed = Fed()
    frames = max(1, source.rate * chunk_ms // 1000)
    fed.started = started = time.perf_counter()

    def report(events: list[PartialTranscript]) -> None:
        heard = transcriber.stream.heard_ms
        fed.events += [(event, heard) for event in events]
        if on_events is not None and events:
            on_events(events, heard)

    def failed(exc: RecognizerFailed) -> list[PartialTranscript]:
        log.error("%s: %s", exc, exc.__cause__)
        fed.failures.append(exc)
        return exc.events

    while stop is None or not stop.is_set():
        data = await read_chunk(source, frames, stop)
        if not data:
            break
        if realtime:
            due = started + (transcriber.stream.heard_ms + len(data) * 500 / source.rate) / 1000
            await anyio.sleep(max(0.0, due - time.perf_counter()))
        try:
            events = await transcriber.feed(data)
        except RecognizerFailed as exc:
            events = failed(exc)
        report(events)
        fed.heard_ms = transcriber.stream.heard_ms
        if on_audio is not None:
            on_audio(fed.heard_ms)
    try:
        events = await transcriber.finish(close=close)
    except RecognizerFailed as exc:
        events = failed(exc)
    report(events)
    fed.heard_ms = transcriber.stream.heard_ms
    fed.wall_s = time.perf_counter() - started
    return fed
