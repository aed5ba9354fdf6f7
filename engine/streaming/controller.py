"""The async incremental translator: many streams, latest partial wins, finals never lost.

One anyio task per stream takes its pending events in order and runs `StreamSession` in a
worker thread, whose encoder and decoder calls go to the model's one decode scheduler
(`engine.decoding.scheduler`), where the streams' decodes share batched decoder steps. When a newer
event arrives while a partial is being decoded, that decode leaves the batch at its next
step and the newest source is decoded instead, so delay never piles up behind a fast
talker; finals are never skipped or cancelled.

Fan-out: with several models (`engine.decoding.targets.Targets`, one per target language) a stream
keeps one lifecycle, one queue and one task, and one session per language. Each admitted
event is translated into every language at once (one worker thread per language, each
model's scheduler batching its own rows) and each language's update is published as soon
as it is ready. So latest-wins, ownership and the count of finals owed stay one decision
per stream; a final counts as answered once every language has answered it (its update,
or an error naming the language). The price: a stream's languages advance event by
event together, so the slower model sets the pace of the stream's next partial.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeAlias

import anyio
import anyio.abc

from engine.decoding.search import DecodingCancelled
from engine.decoding.targets import Targets
from engine.decoding.translator import Translator
from engine.streaming.lifecycle import (
    Admission,
    Owner,
    Phase,
    StreamLifecycle,
    StreamTable,
    Trigger,
)
from engine.streaming.session import StreamingOptions, StreamSession
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

# Default number of streams translating at once (see `IncrementalTranslator`).
DECODE_SLOTS = 64


Reply: TypeAlias = TranslationUpdate | ErrorMessage
"""What a subscription yields: updates, and an `error` (code `internal`) in place of the
final update of a final transcript whose translation failed."""


class Subscription(AsyncIterator[Reply]):
    """A bounded queue of replies for one consumer.

    When it is full, the oldest non-final update is dropped (a newer one supersedes it);
    finals and errors (which answer finals) are never dropped, so a slow consumer cannot
    stall translation for others and every final transcript still gets its reply.
    """

    def __init__(
        self,
        stream_id: str | None,
        max_items: int,
        owner: Owner | None = None,
        lang: str | None = None,
    ) -> None:
        self.stream_id = stream_id
        self.owner = owner
        self.lang = lang  # None: every language
        self.max_items = max_items
        self.dropped = 0
        self._items: deque[Reply] = deque()
        self._ready = anyio.Event()
        self._closed = False

    def wants(self, reply: Reply) -> bool:
        """Whether `reply` is for this subscription's language (an error that names no
        language answers every language, so every subscription takes it)."""
        return self.lang is None or reply.lang is None or reply.lang == self.lang

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


class _Stream(StreamLifecycle):
    """A stream's lifecycle (phase, owner, admission record) and the controller's working
    state for it: its queue of admitted events, one session per target language and the
    events its task waits on."""

    def __init__(
        self,
        stream_id: str,
        owner: Owner | None,
        epoch: int,
        sessions: Mapping[str, StreamSession],
    ) -> None:
        super().__init__(stream_id, owner, epoch)
        self.sessions = dict(sessions)
        # Admitted events waiting, each with its arrival time.
        self.pending: deque[tuple[Admission[_Stream], float]] = deque()
        self.wake = anyio.Event()
        self.done = anyio.Event()
        self.idle = anyio.Event()
        self.busy = False
        self.current: PartialTranscript | None = None  # the event being translated
        self.answered: set[str] = set()  # languages that answered `current` already
        self.cancelled_in_row = 0
        self.last_update: dict[str, TranslationUpdate] = {}  # by language
        # The last few final updates per language, replayed to a viewer who joins late.
        self.recent_finals: dict[str, deque[TranslationUpdate]] = {
            lang: deque(maxlen=RECENT_FINALS) for lang in sessions
        }

    def drop_partials(self) -> int:
        """Latest wins: drop waiting partials (finals stay); returns how many."""
        kept = deque(item for item in self.pending if item[0].event.is_final)
        dropped = len(self.pending) - len(kept)
        self.pending = kept
        return dropped


class IncrementalTranslator:
    """`NmtIncremental` over a `Translator`: push partial transcripts, read updates.

    ```python
    async with IncrementalTranslator.from_dir("models/fixture/model") as nmt:
        updates = nmt.updates("mic-1")      # subscribe first, then push
        await nmt.push(PartialTranscript("mic-1", 0, 0, "I will meet", is_final=False))
        ...
    ```

    Given several translators (or a `Targets`), one per target language, every stream is
    translated into all of them (fan-out): each update says its language (`lang`), and
    `updates(..., lang=...)` picks one. The guarantees of `NmtIncremental` hold per
    stream and language; with one translator nothing changes.

    Each stream's life (admission, ownership, closing) is decided by one state machine,
    `engine.streaming.lifecycle`; this class carries out what it decides: it runs the
    translations, publishes their replies and releases a stream when it has drained.
    A server passes each connection's `Owner` to `push`, `close_stream` and `owner_left`;
    an embedding caller passes none.
    """

    def __init__(
        self,
        translator: Translator | Sequence[Translator] | Targets,
        options: StreamingOptions | None = None,
        *,
        max_streams: int = 256,
        max_pending_finals: int = 32,
        queue_size: int = 256,
        decode_slots: int | None = None,
    ) -> None:
        if isinstance(translator, Translator):
            translator = [translator]
        self.targets = translator if isinstance(translator, Targets) else Targets(translator)
        # The default language's model (the only one without fan-out).
        self.translator = self.targets[self.targets.default]
        self.options = options or StreamingOptions()
        self.queue_size = queue_size
        self.stats: Counter[str] = Counter()
        # Streams translating at once. Their worker threads mostly wait on the model's
        # decode scheduler, which batches them into shared decoder steps, so this bounds
        # threads and memory, not compute (that is the scheduler's `max_rows`).
        slots = decode_slots or DECODE_SLOTS
        self._limiter = anyio.CapacityLimiter(slots)
        self._threads = anyio.CapacityLimiter(slots * len(self.targets))
        self._table: StreamTable[_Stream] = StreamTable(
            self._make_stream, max_streams=max_streams, max_pending_finals=max_pending_finals
        )
        self._subscriptions: dict[str | None, list[Subscription]] = {}
        self._owner_subscriptions: dict[Owner, list[Subscription]] = {}
        self._group: anyio.abc.TaskGroup | None = None
        self._closed = False

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path | Sequence[str | Path],
        options: StreamingOptions | None = None,
        **kwargs: Any,
    ) -> IncrementalTranslator:
        """Load a model directory, or several for fan-out (one per target language,
        loaded by `Targets.load`; see `Translator.from_dir` for the keyword options)."""
        dirs = [model_dir] if isinstance(model_dir, (str, Path)) else list(model_dir)
        return cls(Targets.load(dirs, **kwargs), options)

    @property
    def max_streams(self) -> int:
        return self._table.max_streams

    @property
    def languages(self) -> list[str]:
        """The target languages, the default (first) one first."""
        return self.targets.languages

    def language(self, tag: str | None) -> str | None:
        """The language a subscriber's tag names ("zh-Hans" -> "zh"; None stays None:
        every language). Raises `InvalidEvent` (`invalid_message`, field `lang`) for a
        language no model translates into."""
        if tag is None:
            return None
        lang = self.targets.find(tag)
        if lang is None:
            raise InvalidEvent(
                ErrorMessage(
                    ErrorCode.INVALID_MESSAGE,
                    f"no translation into {tag[:40]!r} here; languages: "
                    + ", ".join(self.languages),
                    "lang",
                )
            )
        return lang

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
        """Take nothing more, finish every stream's accepted finals, end every
        subscription; idempotent."""
        if self._closed:
            return
        for stream in self._table.shutdown():
            self.stats["superseded"] += stream.drop_partials()
            stream.wake.set()
        for stream in list(self._table):
            await stream.done.wait()
        self._end_subscriptions()

    def _end_subscriptions(self) -> None:
        self._closed = True
        for subs in [*self._subscriptions.values(), *self._owner_subscriptions.values()]:
            for sub in subs:
                sub.close()
        self._subscriptions.clear()
        self._owner_subscriptions.clear()

    def abort(self, reason: str) -> int:
        """Give up on work not done yet (a shutdown past its deadline): every accepted final
        transcript still waiting or being translated is answered with an `unavailable`
        error (a running translation's late result is then dropped, so each final still
        gets exactly one reply), and every subscription ends. Returns how many finals were
        answered so. The engine takes nothing more afterwards; `aclose` still waits for
        translations already running on worker threads to return."""
        answered = 0
        for stream, owed in self._table.abort():
            events = [admission.event for admission, _ in stream.pending]
            if stream.current is not None:
                events.insert(0, stream.current)
            stream.pending.clear()
            stream.wake.set()
            finals = [event for event in events if event.is_final]
            if len(finals) != owed:  # the lifecycle's count and the queue disagree: a bug
                log.error("%r: %d finals queued, %d owed", stream, len(finals), owed)
            for event in finals:
                answered += 1
                # A final being translated may have been answered in some languages
                # already: the error then answers only the others, naming each.
                done = stream.answered if event is stream.current else set()
                langs: list[str | None] = [None]
                if done:
                    langs = [lang for lang in stream.sessions if lang not in done]
                for lang in langs:
                    error = ErrorMessage(
                        ErrorCode.UNAVAILABLE, reason, None, event.stream_id, event.seq, lang
                    )
                    self._deliver(error, stream)
        self._end_subscriptions()
        self.stats["aborted_finals"] += answered
        return answered

    # -- API ----------------------------------------------------------------------------

    @property
    def streams(self) -> list[str]:
        """Ids of the streams in the engine, closing ones included (their ids are not
        free until their accepted finals are answered)."""
        return self._table.ids

    def owner_of(self, stream_id: str) -> Owner | None:
        stream = self._table.get(stream_id)
        return stream.owner if stream is not None else None

    def phase(self, stream_id: str) -> Phase:
        """Where a stream is in its life (`Phase.CLOSED` when the id is free)."""
        stream = self._table.get(stream_id)
        return stream.phase if stream is not None else Phase.CLOSED

    def epoch_of(self, stream_id: str) -> int | None:
        """The life (`epoch`) of the id now open, or None when the id is free: a consumer
        keeping state per stream life drops it once this no longer names that life."""
        stream = self._table.get(stream_id)
        return stream.epoch if stream is not None else None

    def updates(
        self,
        stream_id: str | None = None,
        *,
        owner: Owner | None = None,
        lang: str | None = None,
    ) -> Subscription:
        """Subscribe now (before pushing, so nothing is missed) to one stream or all, or
        with `owner` to the replies of every stream that owner holds (a writer's updates,
        and the `error` replies that answer its finals). `lang`: only that target
        language's updates (a tag such as "zh-Hans" names the model of its base
        language; `InvalidEvent` for one no model translates into); None: every
        language's, each update saying which (`lang`)."""
        lang = self.language(lang)
        sub = Subscription(stream_id, self.queue_size, owner, lang)
        if self._closed:
            sub.close()
            return sub
        if owner is not None:
            self._owner_subscriptions.setdefault(owner, []).append(sub)
            return sub
        # Start from the last lines of each open stream (its recent finals, then the current
        # segment's latest update), so a viewer joining mid-talk sees what was just said.
        for stream in self._table:
            if stream_id not in (None, stream.stream_id):
                continue
            for language in stream.sessions:
                if lang not in (None, language):
                    continue
                for final in stream.recent_finals[language]:
                    sub.put(final)
                last = stream.last_update.get(language)
                if last is not None and not last.is_final:
                    sub.put(last)
        self._subscriptions.setdefault(stream_id, []).append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub.owner is not None:
            owned = self._owner_subscriptions.get(sub.owner, [])
            if sub in owned:
                owned.remove(sub)
            if not owned:
                self._owner_subscriptions.pop(sub.owner, None)
        else:
            subs = self._subscriptions.get(sub.stream_id, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._subscriptions.pop(sub.stream_id, None)
        sub.close()

    def last_update(self, stream_id: str, lang: str | None = None) -> TranslationUpdate | None:
        """The newest update of an open stream in a language (default: the default
        language; a viewer joining late starts from it)."""
        stream = self._table.get(stream_id)
        if stream is None:
            return None
        return stream.last_update.get(self.language(lang) or self.targets.default)

    async def push(self, event: PartialTranscript, owner: Owner | None = None) -> None:
        """Queue an event and return at once; raises `InvalidEvent` for a refused one
        (the lifecycle's admission rules say which), `EngineClosed` when not running."""
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
        try:
            admission = self._table.admit(event, owner, self._prepare)
        except InvalidEvent:
            self.stats["rejected"] += 1
            raise
        stream = admission.stream
        if admission.opened:
            self._group.start_soon(self._run_stream, stream)
        self.stats["events"] += 1
        # Latest wins: a waiting partial is superseded by any newer event; finals stay.
        self.stats["superseded"] += stream.drop_partials()
        stream.pending.append((admission, received))
        if not stream.busy:
            stream.busy = True
            stream.idle = anyio.Event()
        stream.wake.set()

    async def wait_idle(self, stream_id: str | None = None) -> None:
        """Wait until a stream (or every stream) has nothing pending or running."""
        ids = [stream_id] if stream_id is not None else self._table.ids
        for sid in ids:
            while (stream := self._table.get(sid)) is not None and (stream.pending or stream.busy):
                await stream.idle.wait()

    def begin_close(self, stream_id: str, owner: Owner | None = None) -> None:
        """Start closing a stream (raises `InvalidEvent` when it is not `owner`'s, not
        open, or closing already): its waiting partials are dropped, its accepted finals
        are still translated and published, then it is released."""
        stream = self._table.close(stream_id, owner)
        self.stats["superseded"] += stream.drop_partials()
        stream.wake.set()

    async def close_stream(self, stream_id: str, owner: Owner | None = None) -> None:
        """Deliver the stream's pending finals, then free it and end its subscriptions."""
        self.begin_close(stream_id, owner)
        stream = self._table.get(stream_id)
        if stream is not None:
            await stream.done.wait()

    def owner_left(self, owner: Owner) -> int:
        """The owner is gone (its connection closed): every stream it holds closes as if
        it had sent `close_stream`, so viewers still get its accepted finals and the
        stream then frees its slot. Returns how many streams began closing."""
        streams = self._table.owner_left(owner)
        for stream in streams:
            self.stats["superseded"] += stream.drop_partials()
            stream.wake.set()
        return len(streams)

    # -- internals ------------------------------------------------------------------

    def _make_stream(self, stream_id: str, owner: Owner | None, epoch: int) -> _Stream:
        sessions = {
            lang: StreamSession(stream_id, translator, self.options, lang=lang)
            for lang, translator in self.targets.items()
        }
        return _Stream(stream_id, owner, epoch, sessions)

    def _prepare(self, event: PartialTranscript) -> tuple[str, dict[str, list[int]]]:
        """Admission's text step: normalise once (every model shares the source
        language) and tokenise once per model; decoding reuses both."""
        source = self.options.clean(event.text, self.targets.source_lang)
        if not source:
            return source, {}
        partial = not event.is_final
        return source, {
            lang: translator.source_ids(source, partial=partial)
            for lang, translator in self.targets.items()
        }

    def _publish(self, stream: _Stream, lang: str, update: TranslationUpdate) -> None:
        update = dataclasses.replace(update, epoch=stream.epoch)
        stream.last_update[lang] = update
        self.stats["updates"] += 1
        if update.is_final:
            self.stats["finals"] += 1
            stream.recent_finals[lang].append(update)
        self._deliver(update, stream)

    def _deliver(self, reply: Reply, stream: _Stream) -> None:
        """To the stream's owner, its subscribers and those of every stream (each in
        the language it asked for)."""
        subs = list(self._owner_subscriptions.get(stream.owner, ())) if stream.owner else []
        for key in (reply.stream_id, None):
            subs.extend(self._subscriptions.get(key, ()))
        for sub in subs:
            if sub.wants(reply):
                sub.put(reply)

    async def _run_stream(self, stream: _Stream) -> None:
        try:
            while True:
                if not stream.pending:
                    stream.busy = False
                    stream.idle.set()
                    if not stream.taking_events:
                        break
                    await stream.wake.wait()
                    stream.wake = anyio.Event()
                    continue
                admission, received = stream.pending.popleft()
                await self._translate(stream, admission, received)
        finally:
            if stream.finals_pending and not stream.closed:
                # Only when the engine's task group is cancelled without `aclose`.
                log.error(
                    "stream %r ends with %d finals unanswered",
                    stream.stream_id,
                    stream.finals_pending,
                )
                stream.fire(Trigger.ABORT)
            self._table.release(stream)
            if self._table.get(stream.stream_id) is None:
                for sub in self._subscriptions.pop(stream.stream_id, []):
                    sub.close()
            stream.done.set()

    async def _translate(
        self, stream: _Stream, admission: Admission[_Stream], received: float
    ) -> None:
        """Translate one admitted event into every language at once; publish each
        language's update when it is ready; a final is answered once all have."""
        event = admission.event
        cancellable = not event.is_final and stream.cancelled_in_row < MAX_CANCELLED_IN_A_ROW

        def newer_waiting() -> bool:
            return bool(stream.pending)

        cancelled = False

        async def one(lang: str, session: StreamSession) -> None:
            nonlocal cancelled
            work = functools.partial(
                session.answer,
                event,
                newer_waiting if cancellable else None,
                received=received,
                source=admission.source,
                source_ids=admission.source_ids.get(lang),
            )
            try:
                update = await anyio.to_thread.run_sync(work, limiter=self._threads)
            except DecodingCancelled:
                cancelled = True
                self.stats["cancelled"] += 1
                return
            except Exception:  # a bug must not take the stream (or others) down with it
                self.stats["errors"] += 1
                log.exception(
                    "translation into %s failed for stream %r seq %d",
                    lang,
                    event.stream_id,
                    event.seq,
                )
                if event.is_final and not stream.closed:
                    # Every final gets exactly one reply per language: this one.
                    stream.answered.add(lang)
                    self._deliver(
                        ErrorMessage(
                            ErrorCode.INTERNAL,
                            "translating this final transcript failed (logged on the server); "
                            "the stream goes on",
                            stream_id=event.stream_id,
                            seq=event.seq,
                            lang=lang,
                        ),
                        stream,
                    )
                return
            if stream.closed:  # aborted meanwhile: `abort` answered it
                return
            if event.is_final:
                stream.answered.add(lang)
            if update is None:
                self.stats["unchanged"] += 1
                return
            self._publish(stream, lang, update)

        stream.current = event
        stream.answered = set()
        try:
            async with self._limiter:
                # Waiting for a worker can take a while when many streams are busy; a
                # partial of a stream that began closing meanwhile (its writer left) is
                # no longer wanted by anyone: do not spend a worker on it.
                if not stream.taking_events and not event.is_final:
                    self.stats["superseded"] += 1
                    return
                if stream.closed:  # aborted while waiting: answered
                    return
                async with anyio.create_task_group() as languages:
                    for lang, session in stream.sessions.items():
                        languages.start_soon(one, lang, session)
        finally:
            stream.current = None
        if stream.closed:  # aborted meanwhile: `abort` answered what was left
            return
        stream.cancelled_in_row = stream.cancelled_in_row + 1 if cancelled else 0
        if event.is_final:
            stream.fire(Trigger.ANSWERED)
