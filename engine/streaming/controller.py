"""The async incremental translator: many streams, latest partial wins, finals never lost.

One anyio task per stream takes its pending events in order and runs `StreamSession` in a
worker thread (onnxruntime releases the GIL). When a newer event arrives while a partial is
being decoded, that decode stops at its next step and the newest source is decoded instead,
so delay never piles up behind a fast talker; finals are never skipped or cancelled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeAlias

import anyio
import anyio.abc

from engine.decoding import DecodingCancelled
from engine.streaming.session import EventGate, StreamingOptions, StreamSession
from engine.translator import Translator
from protocol import (
    EngineClosed,
    ErrorCode,
    ErrorMessage,
    InvalidEvent,
    PartialTranscript,
    TranslationUpdate,
)

log = logging.getLogger(__name__)

# A stream may have this many consecutive decodes cancelled by newer partials; the next one
# runs to the end, so a talker faster than the hardware still sees updates.
MAX_CANCELLED_IN_A_ROW = 2

# Final updates of a stream kept for viewers who join late (the page shows a few lines).
RECENT_FINALS = 8


Reply: TypeAlias = TranslationUpdate | ErrorMessage
"""What a subscription yields: updates, and an `error` (code `internal`) in place of the
final update of a final transcript whose translation failed."""


class Subscription(AsyncIterator[Reply]):
    """A bounded queue of replies for one consumer.

    When it is full, the oldest non-final update is dropped (a newer one supersedes it);
    finals and errors (which answer finals) are never dropped, so a slow consumer cannot
    stall translation for others and every final transcript still gets its reply.
    """

    def __init__(self, stream_id: str | None, max_items: int) -> None:
        self.stream_id = stream_id
        self.max_items = max_items
        self.dropped = 0
        self._items: deque[Reply] = deque()
        self._ready = anyio.Event()
        self._closed = False

    def put(self, update: Reply) -> None:
        if self._closed:
            return
        if len(self._items) >= self.max_items:
            for i, old in enumerate(self._items):
                if isinstance(old, TranslationUpdate) and not old.is_final:
                    del self._items[i]
                    self.dropped += 1
                    break
        self._items.append(update)
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    def __len__(self) -> int:
        return len(self._items)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Reply:
        while not self._items:
            if self._closed:
                raise StopAsyncIteration
            self._ready = anyio.Event()
            await self._ready.wait()
        return self._items.popleft()


@dataclass
class _Stream:
    session: StreamSession
    gate: EventGate
    # Accepted events waiting: (event, arrival time, its source ids from admission).
    pending: deque[tuple[PartialTranscript, float, list[int] | None]] = field(
        default_factory=deque
    )
    wake: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    idle: anyio.Event = field(default_factory=anyio.Event)
    busy: bool = False
    closing: bool = False
    aborted: bool = False  # past a shutdown deadline: publish nothing more
    epoch: int = 0  # which life of the stream id this is (`TranslationUpdate.epoch`)
    current: PartialTranscript | None = None  # the event being translated
    cancelled_in_row: int = 0
    last_update: TranslationUpdate | None = None
    # The last few final updates, replayed to a viewer who joins late.
    recent_finals: deque[TranslationUpdate] = field(
        default_factory=lambda: deque(maxlen=RECENT_FINALS)
    )


class IncrementalTranslator:
    """`NmtIncremental` over a `Translator`: push partial transcripts, read updates.

    ```python
    async with IncrementalTranslator.from_dir("models/fixture/model") as nmt:
        updates = nmt.updates("mic-1")      # subscribe first, then push
        await nmt.push(PartialTranscript("mic-1", 0, 0, "I will meet", is_final=False))
        ...
    ```
    """

    def __init__(
        self,
        translator: Translator,
        options: StreamingOptions | None = None,
        *,
        max_streams: int = 256,
        max_pending_finals: int = 32,
        queue_size: int = 256,
        decode_slots: int | None = None,
    ) -> None:
        self.translator = translator
        self.options = options or StreamingOptions()
        self.max_streams = max_streams
        self.max_pending_finals = max_pending_finals
        self.queue_size = queue_size
        self.stats: Counter[str] = Counter()
        self._limiter = anyio.CapacityLimiter(decode_slots or os.cpu_count() or 1)
        self._streams: dict[str, _Stream] = {}
        self._subscriptions: dict[str | None, list[Subscription]] = {}
        self._group: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._epochs = itertools.count(1)  # one number per stream opened, never reused

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, options: StreamingOptions | None = None, **kwargs: Any
    ) -> IncrementalTranslator:
        """Load a model directory (see `Translator.from_dir` for the keyword options)."""
        return cls(Translator.from_dir(model_dir, **kwargs), options)

    # -- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> IncrementalTranslator:
        if self._group is not None:
            raise RuntimeError("IncrementalTranslator is already running")
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            await self.aclose()
        finally:
            group, self._group = self._group, None
            if group is not None:
                group.cancel_scope.cancel()
                await group.__aexit__(exc_type, exc, traceback)

    async def aclose(self) -> None:
        """Finish pending finals of every stream, end every subscription; idempotent."""
        if self._closed:
            return
        for stream_id in list(self._streams):
            with contextlib.suppress(InvalidEvent):  # it finished closing meanwhile
                await self.close_stream(stream_id)
        self._end_subscriptions()

    def _end_subscriptions(self) -> None:
        self._closed = True
        for subs in self._subscriptions.values():
            for sub in subs:
                sub.close()
        self._subscriptions.clear()

    def abort(self, reason: str) -> int:
        """Give up on work not done yet (a shutdown past its deadline): every accepted final
        transcript still waiting or being translated is answered with an `unavailable`
        error (a running translation's late result is then dropped, so each final still
        gets exactly one reply), and every subscription ends. Returns how many finals were
        answered so. The engine takes nothing more afterwards; `aclose` still waits for
        translations already running on worker threads to return."""
        answered = 0
        for stream in list(self._streams.values()):
            events = [e for e, _, _ in stream.pending]
            if stream.current is not None:
                events.insert(0, stream.current)
            stream.pending.clear()
            stream.closing = stream.aborted = True
            stream.wake.set()
            for event in events:
                if event.is_final:
                    answered += 1
                    error = ErrorCode.UNAVAILABLE
                    self._deliver(ErrorMessage(error, reason, None, event.stream_id, event.seq))
        self._end_subscriptions()
        self.stats["aborted_finals"] += answered
        return answered

    # -- API ----------------------------------------------------------------------------

    @property
    def streams(self) -> list[str]:
        return list(self._streams)

    def updates(self, stream_id: str | None = None) -> Subscription:
        """Subscribe now (before pushing, so nothing is missed) to one stream or all."""
        sub = Subscription(stream_id, self.queue_size)
        if self._closed:
            sub.close()
            return sub
        # Start from the last lines of each open stream (its recent finals, then the current
        # segment's latest update), so a viewer joining mid-talk sees what was just said.
        for sid, stream in self._streams.items():
            if stream_id not in (None, sid):
                continue
            for final in stream.recent_finals:
                sub.put(final)
            last = stream.last_update
            if last is not None and not last.is_final:
                sub.put(last)
        self._subscriptions.setdefault(stream_id, []).append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subscriptions.get(sub.stream_id, [])
        if sub in subs:
            subs.remove(sub)
        if not subs:
            self._subscriptions.pop(sub.stream_id, None)
        sub.close()

    def last_update(self, stream_id: str) -> TranslationUpdate | None:
        """The newest update of an open stream (a viewer joining late starts from it)."""
        stream = self._streams.get(stream_id)
        return stream.last_update if stream else None

    async def push(self, event: PartialTranscript) -> None:
        """Queue an event and return at once; raises `InvalidEvent` for a refused one."""
        if self._closed or self._group is None:
            raise EngineClosed("IncrementalTranslator is not running (use `async with`)")
        if not isinstance(event, PartialTranscript):
            raise InvalidEvent(
                ErrorMessage(
                    ErrorCode.INVALID_MESSAGE,
                    f"expected a PartialTranscript, got {type(event).__name__}",
                )
            )
        received = time.perf_counter()
        stream = self._streams.get(event.stream_id)
        if stream is None:
            if len(self._streams) >= self.max_streams:
                raise InvalidEvent(
                    ErrorMessage(
                        ErrorCode.LIMIT_EXCEEDED,
                        f"too many open streams (limit {self.max_streams})",
                        stream_id=event.stream_id,
                        seq=event.seq,
                    )
                )
            stream = self._open(event.stream_id)
        if stream.closing:
            raise InvalidEvent(
                ErrorMessage(
                    ErrorCode.UNKNOWN_STREAM,
                    f"stream {event.stream_id!r} is closing",
                    stream_id=event.stream_id,
                    seq=event.seq,
                )
            )
        error = stream.gate.check(event)
        if error is None and event.is_final:
            finals = sum(1 for e, _, _ in stream.pending if e.is_final)
            if finals >= self.max_pending_finals:
                error = ErrorMessage(
                    ErrorCode.RATE_LIMITED,
                    f"{finals} finals are already waiting on this stream",
                    stream_id=event.stream_id,
                    seq=event.seq,
                )
        if error is not None:
            self.stats["rejected"] += 1
            raise InvalidEvent(error)
        stream.gate.accept(event)
        self.stats["events"] += 1
        # Latest wins: a waiting partial is superseded by any newer event; finals stay.
        kept = deque(item for item in stream.pending if item[0].is_final)
        self.stats["superseded"] += len(stream.pending) - len(kept)
        kept.append((event, received, stream.gate.admitted))
        stream.pending = kept
        if not stream.busy:
            stream.busy = True
            stream.idle = anyio.Event()
        stream.wake.set()

    async def wait_idle(self, stream_id: str | None = None) -> None:
        """Wait until a stream (or every stream) has nothing pending or running."""
        ids = [stream_id] if stream_id is not None else list(self._streams)
        for sid in ids:
            while (stream := self._streams.get(sid)) is not None and (
                stream.pending or stream.busy
            ):
                await stream.idle.wait()

    async def close_stream(self, stream_id: str) -> None:
        """Deliver the stream's pending finals, then free it and end its subscriptions."""
        stream = self._streams.get(stream_id)
        if stream is None:
            raise InvalidEvent(
                ErrorMessage(
                    ErrorCode.UNKNOWN_STREAM, f"no open stream {stream_id!r}", stream_id=stream_id
                )
            )
        if not stream.closing:
            stream.closing = True
            kept = deque(item for item in stream.pending if item[0].is_final)
            self.stats["superseded"] += len(stream.pending) - len(kept)
            stream.pending = kept
            stream.wake.set()
        await stream.done.wait()

    # -- internals ------------------------------------------------------------------

    def _open(self, stream_id: str) -> _Stream:
        assert self._group is not None
        stream = _Stream(
            StreamSession(stream_id, self.translator, self.options),
            EventGate(stream_id, self.translator, self.options),
        )
        stream.epoch = next(self._epochs)
        self._streams[stream_id] = stream
        self._group.start_soon(self._run_stream, stream_id, stream)
        return stream

    def _publish(self, stream: _Stream, update: TranslationUpdate) -> None:
        update = dataclasses.replace(update, epoch=stream.epoch)
        stream.last_update = update
        self.stats["updates"] += 1
        if update.is_final:
            self.stats["finals"] += 1
            stream.recent_finals.append(update)
        self._deliver(update)

    def _deliver(self, reply: Reply) -> None:
        """To the stream's subscribers and those of every stream."""
        for key in (reply.stream_id, None):
            for sub in self._subscriptions.get(key, ()):
                sub.put(reply)

    async def _run_stream(self, stream_id: str, stream: _Stream) -> None:
        try:
            while True:
                if not stream.pending:
                    stream.busy = False
                    stream.idle.set()
                    if stream.closing:
                        break
                    await stream.wake.wait()
                    stream.wake = anyio.Event()
                    continue
                event, received, source_ids = stream.pending.popleft()
                await self._translate(stream, event, received, source_ids)
        finally:
            self._streams.pop(stream_id, None)
            for sub in self._subscriptions.pop(stream_id, []):
                sub.close()
            stream.done.set()

    async def _translate(
        self,
        stream: _Stream,
        event: PartialTranscript,
        received: float,
        source_ids: list[int] | None,
    ) -> None:
        cancellable = not event.is_final and stream.cancelled_in_row < MAX_CANCELLED_IN_A_ROW

        def newer_waiting() -> bool:
            return bool(stream.pending)

        work = functools.partial(
            stream.session.translate,
            event,
            newer_waiting if cancellable else None,
            received=received,
            source_ids=source_ids,
        )
        stream.current = event
        try:
            async with self._limiter:
                # Waiting for a worker can take a while when many streams are busy; a
                # partial of a stream that began closing meanwhile (its writer left) is
                # no longer wanted by anyone: do not spend a worker on it.
                if stream.closing and not event.is_final:
                    self.stats["superseded"] += 1
                    return
                update = await anyio.to_thread.run_sync(work)
        except DecodingCancelled:
            stream.cancelled_in_row += 1
            self.stats["cancelled"] += 1
            return
        except Exception:  # a bug must not take the stream (or others) down with it
            self.stats["errors"] += 1
            log.exception("translation failed for stream %r seq %d", event.stream_id, event.seq)
            if event.is_final:  # every final gets exactly one reply: this one
                self._deliver(
                    ErrorMessage(
                        ErrorCode.INTERNAL,
                        "translating this final transcript failed (logged on the server); "
                        "the stream goes on",
                        stream_id=event.stream_id,
                        seq=event.seq,
                    )
                )
            return
        finally:
            stream.current = None
        if stream.aborted:  # answered by `abort` already
            return
        stream.cancelled_in_row = 0
        if update is None:
            self.stats["unchanged"] += 1
            return
        self._publish(stream, update)
