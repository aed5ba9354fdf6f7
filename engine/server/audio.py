"""Audio over the WebSocket: a writer's `start_audio` and binary PCM frames, recognized off
the event loop and pushed into the engine as that connection's transcripts.

The connection's rules (who may stream audio, how fast, one stream at a time) are the
sans-I/O `ConnectionCore`'s; the speech layer (`engine.asr`) queues, checks, resamples and
numbers the audio. What is here is the I/O between them:

- `AudioInput`: what a server needs to take audio (a recognizer factory and the limits),
  `pocketsphinx_input` makes one for `serve --asr pocketsphinx`;
- `AudioFeed`: one audio stream. Its chunks wait in a `Backlog` bounded in seconds of audio
  (`AudioInput.max_backlog_s`): the receive loop never waits for recognition, and a
  recognizer that falls behind by more than that drops audio with a `rate_limited` error
  (once per run of drops) instead of piling up delay. One task per stream takes all that
  is queued at once and has it recognized from a worker thread of its own (a
  `CapacityLimiter` of one per stream, so audio never takes the threads the engine's
  decoding uses), then hands the events over in order;
- `AudioService`: the server's feeds, their counters (`/metrics`: `nmt_audio_*`) and,
  with `AudioInput.workers`, the recognition processes (`RecognizerPool`), started with
  the server and stopped when it shuts down.

Where recognition runs: with `workers` (what `serve --asr` does), in that many worker
processes (`engine.asr.pool`), each stream pinned to one of them; the feed's thread only
waits for the answer. pocketsphinx holds the GIL while it decodes, so in threads of the
server process all recognition shares one core with the event loop and the engine's
Python; in processes it does not, and the decode scheduler counts their cores
(`engine.cli.args.translation_cores`). Without `workers` (0: tests with scripted recognizers,
which need not pickle, and embedding callers) it runs in the feed's thread.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.asr.audio import Backlog
from engine.asr.errors import RecognizerFailed, WorkerDied
from engine.asr.pool import PooledStream, RecognizerPool
from engine.asr.recognizer import Numbering, RecognizerFactory, RecognizerStream, SpeechStream
from engine.asr.sphinx import Decoders, SphinxOptions, SphinxRecognizer
from engine.server.limits import AudioLimits, AudioSlot
from protocol import ErrorCode, ErrorMessage, PartialTranscript

log = logging.getLogger(__name__)

Deliver = Callable[[list[PartialTranscript]], Awaitable[None]]
"""Takes a batch of a feed's events, in order (the connection pushes and echoes them)."""

ASR_KINDS = ("pocketsphinx",)
"""The recognizers `serve --asr` knows."""

T = TypeVar("T")


@dataclass(frozen=True)
class AudioInput:
    """Audio input of a server: `recognizer` makes one recognizer per audio stream;
    `limits` are the connection's rules (speed, streams at once, language heard);
    `max_backlog_s`: audio waiting for recognition past which new audio is dropped (the
    server is overloaded); `description` names the recognizer in logs; `workers`:
    recognition processes (0: threads of the server process; see the module docstring),
    whose cores the models' scheduler should be told of (`engine.cli.args.translation_cores`)."""

    recognizer: RecognizerFactory  # one per audio stream; pickles when `workers`
    limits: AudioLimits = field(default_factory=AudioLimits)
    max_backlog_s: float = 10.0
    description: str = "a recognizer"
    workers: int = 0

    def __post_init__(self) -> None:
        if not self.max_backlog_s > 0:
            raise ValueError("max_backlog_s must be positive")
        if self.workers < 0:
            raise ValueError("workers must be >= 0")


def pocketsphinx_input(
    options: SphinxOptions, *, workers: int = 0, limits: AudioLimits | None = None
) -> AudioInput:
    """Audio input recognized by pocketsphinx with `options`, in `workers` processes (0:
    in threads), held to `limits` (default: what `workers` serve,
    `AudioLimits.for_workers`). One recognizer is made here, so that a missing extra or a
    bad model file stops the server at start (`RecognizerUnavailable`), not at its first
    speaker. The package's acoustic model hears English; with another one the spoken
    language is not checked."""
    SphinxRecognizer(options, Decoders())  # its own: this process keeps none of it
    language = "en" if options.acoustic_model is None else None
    model = options.language_model or options.grammar
    what = f"pocketsphinx ({model.name if model is not None else 'general en-US model'})"
    limits = limits or AudioLimits.for_workers(workers)
    return AudioInput(
        functools.partial(SphinxRecognizer, options),  # pickles, for the worker processes
        dataclasses.replace(limits, language=language),
        description=what,
        workers=workers,
    )


# -- counters ------------------------------------------------------------------------------


@dataclass
class AudioStats:
    """What the server's audio streams did, summed (for `/metrics` and benchmarks)."""

    active: int = 0
    streams: int = 0
    heard_s: float = 0.0
    recognizing_s: float = 0.0  # wall time in the recognizer's calls (and resampling)
    recognizing_cpu_s: float = 0.0  # CPU time of those calls, where they ran
    partials: int = 0
    finals: int = 0
    failures: int = 0
    idle_timeouts: int = 0  # streams ended for sending no audio
    workers_lost: int = 0  # recognition processes that died (each replaced)
    dropped_fast_s: float = 0.0  # audio faster than the speed limit
    dropped_backlog_s: float = 0.0  # audio past the backlog (recognition behind)

    def seconds(self) -> dict[str, float]:
        return {
            "heard": self.heard_s,
            "recognizing": self.recognizing_s,
            "recognizing_cpu": self.recognizing_cpu_s,
            "dropped_too_fast": self.dropped_fast_s,
            "dropped_backlog": self.dropped_backlog_s,
        }

    def counts(self) -> dict[str, int]:
        return {
            "streams": self.streams,
            "partials": self.partials,
            "finals": self.finals,
            "recognizer_failures": self.failures,
            "idle_timeouts": self.idle_timeouts,
            "recognizer_processes_lost": self.workers_lost,
        }


class AudioCollector(Collector):
    """`nmt_audio_streams` (open now), `nmt_audio_recognizer_processes` (live recognition
    processes), `nmt_audio_seconds_total{kind}` (heard, recognizing, recognizing_cpu,
    dropped_too_fast, dropped_backlog) and `nmt_audio_events_total{kind}` (streams,
    partials, finals, recognizer_failures, idle_timeouts, recognizer_processes_lost), read
    at scrape time."""

    def __init__(self, stats: AudioStats, pool: RecognizerPool | None = None) -> None:
        self.stats = stats
        self.pool = pool

    def collect(self) -> Iterable[Metric]:
        if self.pool is not None:
            self.stats.workers_lost = self.pool.lost
        active = GaugeMetricFamily("nmt_audio_streams", "Audio streams being recognized now.")
        active.add_metric([], float(self.stats.active))
        yield active
        processes = GaugeMetricFamily(
            "nmt_audio_recognizer_processes",
            "Recognition worker processes alive now (0: recognition runs in threads).",
        )
        processes.add_metric([], float(self.pool.alive if self.pool is not None else 0))
        yield processes
        seconds = CounterMetricFamily(
            "nmt_audio_seconds",
            "Audio over the WebSocket, in seconds: heard, time spent recognizing it "
            "(recognizer and resampling calls: wall time, and their CPU time, in the "
            "recognition processes or threads), "
            "dropped for arriving too fast, dropped because recognition was too far behind.",
            labels=["kind"],
        )
        for kind, value in self.stats.seconds().items():
            seconds.add_metric([kind], value)
        yield seconds
        events = CounterMetricFamily(
            "nmt_audio_events",
            "Audio streams started, the partials, finals and recognizer failures of their "
            "recognition, streams ended for sending no audio, and recognition processes "
            "that died (each was replaced).",
            labels=["kind"],
        )
        for kind, count in self.stats.counts().items():
            events.add_metric([kind], count)
        yield events


# -- one audio stream ----------------------------------------------------------------------


@dataclass(frozen=True)
class Clock:
    """Where a stream's next recognized event starts: its segment id, `seq` and the audio
    time (ms), so that a second audio stream into the same stream goes on numbering."""

    segment_id: int = 0
    seq: int = 0
    offset_ms: float = 0.0


class AudioFeed:
    """One audio stream, from `start_audio` to its last final (see the module docstring).

    `put` queues a chunk (never waits); `finish` says no more audio comes (the last
    utterance is then flushed). `run` is the stream's task: it makes the recognizer,
    recognizes what is queued and hands events to `deliver` in order, and returns after the
    flush, or after a failure or the idle timeout (`error`: the reply naming the stream;
    what the stream had heard was made final and delivered first). `clock` afterwards
    says where a next audio stream into the same stream goes on. `done` is set when `run`
    has returned. With `pool` the stream's recognizer lives in one of its processes (a
    worker that dies fails the stream as a raising recognizer does), else in this
    process. `slot`: the stream's place among the server's audio streams, marked started
    once the recognizer is made; whoever runs the feed `release`s it after `run`.

    `cut` ends the stream without waiting for its recognizer (a stopping server whose
    budget is running out, a writer gone too long): the call in flight is abandoned,
    queued audio dropped, and the utterance in progress ends at once with the words shown
    last, so that every segment a speaker saw still gets its final; `error` then says how
    much audio went unrecognized. The feed follows the events it delivered (a `Numbering`
    of its own) to make that final without asking the recognizer.
    """

    def __init__(
        self,
        audio: AudioInput,
        stats: AudioStats,
        stream_id: str,
        sample_rate: int,
        deliver: Deliver,
        pool: RecognizerPool | None = None,
        slot: AudioSlot | None = None,
    ) -> None:
        self.audio = audio
        self.pool = pool
        self.slot = slot
        self.stats = stats
        self.stream_id = stream_id
        self.sample_rate = sample_rate
        self.deliver = deliver
        self.error: ErrorMessage | None = None
        self.finishing = False
        self.close_after = False  # close the stream once the last final is pushed
        self.clock = Clock()
        self.done = anyio.Event()
        self.stream: SpeechStream | None = None
        self._backlog = Backlog(sample_rate, audio.max_backlog_s)
        self._behind = False  # dropping for the backlog (its error was sent)
        self._wake = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)  # this stream's worker thread
        self._stopped = False
        self._delivered = Numbering(stream_id)  # follows what `deliver` was given
        self._cut = False
        self._scope: anyio.CancelScope | None = None  # cancelled by `cut`
        self._in_flight_s = 0.0  # audio in the recognizer call under way
        self._calling = False  # a call is in the stream's thread (or was abandoned there)
        # `stream` is set by the thread that makes it, which `cut` may abandon: under this
        # lock, so that a stream made after `run` ended is closed by that thread.
        self._made_lock = threading.Lock()

    # -- from the receive loop ----------------------------------------------------------

    def put(self, pcm: bytes) -> ErrorMessage | None:
        """Queue a chunk; the error to send when the backlog is full (the first chunk
        dropped of a run: the rest of the run is dropped without a word)."""
        if self.finishing or self._stopped:
            return None
        if not self._backlog.put(pcm):
            self.stats.dropped_backlog_s += self._backlog.seconds(pcm)
            if self._behind:
                return None
            self._behind = True
            return ErrorMessage(
                ErrorCode.RATE_LIMITED,
                f"stream {self.stream_id!r}: recognition is more than "
                f"{self.audio.max_backlog_s:g} s of audio behind (the server is overloaded): "
                "audio dropped until it catches up",
                stream_id=self.stream_id,
            )
        self._behind = False
        self._wake.set()
        return None

    def finish(self, *, close: bool = False) -> None:
        """No more audio: recognize what is queued, then flush the last utterance; with
        `close`, the stream is to be closed after that."""
        self.finishing = True
        self.close_after = self.close_after or close
        self._wake.set()

    def cut(self) -> None:
        """End the stream now (see the class docstring): `run` abandons the recognizer
        call under way, delivers the utterance in progress as a final made of the words
        shown last, and returns. Idempotent; a feed not running yet ends as it starts."""
        self.finishing = True
        with self._made_lock:
            self._cut = True
        if self._scope is not None:
            self._scope.cancel()

    # -- the stream's task --------------------------------------------------------------

    async def run(self, clock: Clock) -> None:
        """Recognize the stream from `clock` (where the stream's numbering goes on) until
        it is finished or fails."""
        self.clock = clock
        self._delivered = Numbering(self.stream_id, clock.segment_id, clock.seq)
        self.stats.active += 1
        self.stats.streams += 1
        started = time.perf_counter()
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self._cut:
                    scope.cancel()
                await self._run(clock)
            if scope.cancelled_caught:
                await self._cut_short()
        finally:
            self.stats.active -= 1
            self._backlog.clear()
            with self._made_lock:
                self._stopped = True
                stream = self.stream
            # Its recognizer is freed or goes to the next stream. A call abandoned by `cut`
            # may still run in this process's thread: that recognizer is left to it (a
            # pooled stream's close is a message its worker answers after that call).
            if stream is not None and (isinstance(stream, PooledStream) or not self._calling):
                stream.close()
            if stream is not None:
                numbering = self._delivered
                self.clock = Clock(numbering.segment, numbering.seq, stream.heard_ms)
                heard = stream.heard_ms - clock.offset_ms
                log.debug(
                    "audio stream %r: %.1f s heard, %.2f s recognizing, %.1f s wall%s",
                    self.stream_id,
                    heard / 1000,
                    stream.busy_s,
                    time.perf_counter() - started,
                    " (ended short)" if self.error is not None else "",
                )

    def release(self) -> None:
        """Free the stream's slot: its recognizer is gone (`run` returned) or was never
        made (`run` never started). Idempotent."""
        if self.slot is not None:
            self.slot.release()

    async def _run(self, clock: Clock) -> None:
        try:
            stream = await self._in_thread(lambda: self._made_by_thread(clock))
        except Exception as exc:
            if isinstance(exc, WorkerDied):  # the pool logged the death: one line each
                log.error("stream %r: the recognizer could not start: %s", self.stream_id, exc)
            else:
                log.exception("stream %r: the recognizer could not start", self.stream_id)
            self.error = ErrorMessage(
                ErrorCode.INTERNAL,
                f"stream {self.stream_id!r}: the recognizer could not start ({exc}); "
                "this audio stream ended",
                stream_id=self.stream_id,
            )
            self.stats.failures += 1
            return
        finally:
            if self.slot is not None:
                self.slot.started()
        work: Callable[[], list[PartialTranscript]]
        while True:
            if not await self._audio_or_end():
                self._idle()  # its last utterance is flushed, the error said after it
            if self._backlog:
                chunk = self._backlog.take()
                self._in_flight_s = self._backlog.seconds(chunk)
                last = False
                work = functools.partial(stream.accept, chunk)
            else:
                last = True
                work = stream.flush
            busy, cpu, heard = stream.busy_s, stream.cpu_s, stream.heard_ms
            try:
                events = await self._in_thread(work)
            except RecognizerFailed as exc:
                self._count(stream, busy, cpu, heard, exc.events)
                await self._deliver(exc.events)
                self._failed(exc.at_ms, exc.__cause__ or exc)
                return
            except Exception as exc:  # a bug in the seam itself: the same for the client
                log.exception("stream %r: recognition failed", self.stream_id)
                self._failed(stream.heard_ms, exc)
                return
            self._in_flight_s = 0.0
            self._count(stream, busy, cpu, heard, events)
            await self._deliver(events)
            if last:
                return

    async def _deliver(self, events: list[PartialTranscript]) -> None:
        """Hand events over whole: a `cut` meanwhile waits until they are (a batch cut
        in half would leave a final unpushed, or the feed's numbering behind)."""
        with anyio.CancelScope(shield=True):
            self._delivered.follow(events)
            await self.deliver(events)

    async def _cut_short(self) -> None:
        """What `cut` leaves to do: the utterance in progress ends with the words shown
        last, and the speaker is told of the audio that went unrecognized."""
        unheard_s = self._in_flight_s + self._backlog.queued_s
        self._backlog.clear()
        events = self._delivered.finalize()  # numbered after the last event delivered
        self.stats.finals += len(events)
        await self._deliver(events)
        if unheard_s > 0 and self.error is None:
            log.debug(
                "stream %r: cut short, %.1f s of audio unrecognized", self.stream_id, unheard_s
            )
            self.error = ErrorMessage(
                ErrorCode.UNAVAILABLE,
                f"stream {self.stream_id!r}: the server is shutting down: the last "
                f"{unheard_s:.1f} s of audio were not recognized, and the utterance in "
                "progress was ended with the words shown so far",
                stream_id=self.stream_id,
            )

    def _made_by_thread(self, clock: Clock) -> SpeechStream:
        stream = self._make(clock)
        with self._made_lock:
            if not self._stopped:
                self.stream = stream
            abandoned = self._cut
        if abandoned:
            stream.close()  # `run` may have ended already: it would not see this one
        return stream

    async def _audio_or_end(self) -> bool:
        """Wait until audio is queued or the stream is finishing; False when no audio came
        for the idle timeout."""
        with anyio.move_on_after(self.audio.limits.idle_timeout_s or math.inf):
            while not self._backlog and not self.finishing:
                self._wake = anyio.Event()
                await self._wake.wait()
            return True
        return False

    def _idle(self) -> None:
        timeout = self.audio.limits.idle_timeout_s
        self.stats.idle_timeouts += 1
        log.info("stream %r: no audio for %g s, its audio stream ended", self.stream_id, timeout)
        self.error = ErrorMessage(
            ErrorCode.LIMIT_EXCEEDED,
            f"stream {self.stream_id!r}: no audio for {timeout:g} s, so this audio stream "
            "ended (what it had heard was finished) and its slot went to others: send "
            "start_audio to go on",
            stream_id=self.stream_id,
        )

    def _make(self, clock: Clock) -> SpeechStream:
        if self.pool is not None:
            return self.pool.open(
                self.stream_id,
                sample_rate=self.sample_rate,
                first_segment=clock.segment_id,
                first_seq=clock.seq,
                offset_ms=clock.offset_ms,
            )
        return RecognizerStream(
            self.audio.recognizer(),
            self.stream_id,
            sample_rate=self.sample_rate,
            first_segment=clock.segment_id,
            first_seq=clock.seq,
            offset_ms=clock.offset_ms,
        )

    async def _in_thread(self, work: Callable[[], T]) -> T:
        """Run `work` in this stream's worker thread: the recognizer itself, or the wait
        for its process's answer. A `cut` abandons the call (its answer is dropped)."""
        self._calling = True
        try:
            result = await anyio.to_thread.run_sync(
                work, limiter=self._limiter, abandon_on_cancel=True
            )
        except anyio.get_cancelled_exc_class():
            raise  # abandoned: the call may still be running in the thread
        except BaseException:
            self._calling = False
            raise
        self._calling = False
        return result

    def _count(
        self,
        stream: SpeechStream,
        busy_before: float,
        cpu_before: float,
        heard_before: float,
        events: list[PartialTranscript],
    ) -> None:
        self.stats.recognizing_s += stream.busy_s - busy_before
        self.stats.recognizing_cpu_s += stream.cpu_s - cpu_before
        self.stats.heard_s += (stream.heard_ms - heard_before) / 1000
        finals = sum(1 for event in events if event.is_final)
        self.stats.finals += finals
        self.stats.partials += len(events) - finals

    def _failed(self, at_ms: float, cause: BaseException) -> None:
        self.stats.failures += 1
        log.error("stream %r: the recognizer failed: %r", self.stream_id, cause)
        self.error = ErrorMessage(
            ErrorCode.INTERNAL,
            f"stream {self.stream_id!r}: the recognizer failed at {at_ms / 1000:.2f} s of "
            f"audio ({type(cause).__name__}: {str(cause)[:200]}); this audio stream ended "
            "and what it had heard was finished: send start_audio to go on",
            stream_id=self.stream_id,
        )


class AudioService:
    """A server's audio input: makes the feeds, keeps their counters, and owns the
    recognition processes (`input.workers`): `start` starts them with the server,
    `aclose` stops them once its audio streams have ended (a feed still waiting on one
    then fails like a recognizer that raised)."""

    def __init__(self, audio: AudioInput) -> None:
        self.input = audio
        self.stats = AudioStats()
        self.pool = RecognizerPool(audio.recognizer, audio.workers) if audio.workers else None
        self.collector = AudioCollector(self.stats, self.pool)

    @property
    def limits(self) -> AudioLimits:
        return self.input.limits

    async def start(self) -> None:
        """Start the recognition processes (they load while the server starts; a stream
        opened before its worker is ready waits for it)."""
        if self.pool is not None:
            await anyio.to_thread.run_sync(self.pool.start)

    async def aclose(self) -> None:
        """Stop the recognition processes and reap them (idempotent)."""
        if self.pool is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.pool.close)

    def feed(
        self, stream_id: str, sample_rate: int, deliver: Deliver, slot: AudioSlot | None = None
    ) -> AudioFeed:
        return AudioFeed(self.input, self.stats, stream_id, sample_rate, deliver, self.pool, slot)
