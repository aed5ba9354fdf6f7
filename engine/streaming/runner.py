"""Running a stream's admitted events: translating them and publishing the replies.

The controller (`engine.streaming.controller`) admits events and decides each stream's
life with its lifecycle; this module carries out the work that follows, apart from
admission: one task per stream takes its pending events in order (`StreamRunner.run_stream`),
answers a final its earlier life answered already from the stream's history (a writer
that reconnected and sent it again), translates the others into every language at once
(latest wins: a partial's decodes are abortable), and publishes each language's update
to the bus as soon as it is ready. A stream is released here once it has drained.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import anyio

from engine.decoding.policy import Priority, new_request_id
from engine.decoding.search import DecodingCancelled
from engine.replies import Reply
from engine.streaming.awaiting import Slots, answer
from engine.streaming.bus import UpdateBus
from engine.streaming.history import Resent, resent_final, seq_reused
from engine.streaming.lifecycle import StreamTable, Trigger
from engine.streaming.session import StreamSession
from engine.streaming.stream import Admission, Stream
from protocol import ErrorCode, ErrorMessage, InvalidEvent, TranslationUpdate

log = logging.getLogger(__name__)

# A stream may have this many consecutive decodes cancelled by newer partials; the next one
# runs to the end, so a talker faster than the hardware still sees updates.
MAX_CANCELLED_IN_A_ROW = 2


class StreamRunner:
    """Runs the engine's streams: translates each admitted event and publishes its replies.

    It shares the controller's `bus`, stream `table`, `stats` and decode `slots` (streams
    translating at once); the controller opens a stream and starts `run_stream` for it.
    """

    def __init__(
        self,
        bus: UpdateBus,
        table: StreamTable[Stream],
        stats: Counter[str],
        slots: Slots,
    ) -> None:
        self.bus = bus
        self.table = table
        self.stats = stats
        self.slots = slots

    def publish(self, stream: Stream, lang: str, update: TranslationUpdate) -> None:
        """Publish `lang`'s update, stamped with the stream's life (`epoch`), which a
        shared bus checks against the stream's current one."""
        if update.epoch != stream.life.epoch or update.lang != lang:  # else made so
            update = dataclasses.replace(update, epoch=stream.life.epoch, lang=lang)
        self.stats["updates"] += 1
        if update.is_final:
            self.stats["finals"] += 1
            session = stream.sessions.get(lang)
            if session is not None:  # a glossary's terms in this final (`/metrics`)
                matched, placed = session.final_terms
                self.stats["terms_matched"] += matched
                self.stats["terms_placed"] += placed
        if update.is_final or stream.kept_terms is None:
            # On the bus for any node's `/terms`: from the life's first update (so that
            # the stream is known open), then whenever a final changed them.
            counts = stream.terms()
            if counts != stream.kept_terms:
                self.bus.keep_terms(stream.stream_id, stream.life.epoch, counts)
                stream.kept_terms = counts
        self.deliver(update, stream)

    def deliver(self, reply: Reply, stream: Stream) -> None:
        """To the stream's owner, its viewers and those of every stream (the bus hands
        each the languages it asked for)."""
        self.bus.publish(reply, stream.life.owner, stream.life.epoch)

    async def run_stream(self, stream: Stream) -> None:
        try:
            while True:
                if not stream.pending:
                    stream.went_idle()
                    if not stream.taking_events:
                        break
                    await stream.wake.wait()
                    continue
                admission, received = stream.pending.popleft()
                await self._translate(stream, admission, received)
        finally:
            if stream.life.finals_pending and not stream.closed:
                # Only when the engine's task group is cancelled without `aclose`.
                log.error(
                    "stream %r ends with %d finals unanswered",
                    stream.stream_id,
                    stream.life.finals_pending,
                )
                stream.life.fire(Trigger.ABORT)
            self.table.release(stream)
            if self.table.get(stream.stream_id) is None:
                self.bus.end_stream(stream.stream_id, closed=stream.life.closed_by_owner)
            stream.done.set()

    async def _answer_from_history(
        self, stream: Stream, admission: Admission
    ) -> dict[str, StreamSession]:
        """An event at or below the seq the stream's earlier life answered through: a
        final sent again by a writer that lost its connection, decided per language by
        the stream's history (`resent_final`), answered to the writer only (viewers had
        it); or an event of a writer that started over (the lifecycle decides,
        `starts_over`), after which the history is marked and every event is new.
        Returns the sessions still to translate it (`stream.unshown`: for the writer)."""
        event = admission.event
        found: dict[str, tuple[Resent, TranslationUpdate | None]] = {}
        try:
            for lang in stream.sessions if event.is_final else ():
                entries = await self.bus.history(event.stream_id, lang)
                trimmed = len(entries) >= self.bus.history_size
                found[lang] = resent_final(
                    entries, event.segment_id, event.seq, admission.source, trimmed
                )
        except InvalidEvent:  # the bus cannot say: translate it (a duplicate, not a loss)
            found = {}
        if stream.closed:
            return {}
        if stream.life.starts_over(event, [verdict for verdict, _ in found.values()]):
            self.stats["started_over"] += 1
            self.bus.start_over(event.stream_id, stream.life.epoch)
            return stream.sessions
        if not event.is_final:
            return stream.sessions
        stream.unshown = {lang for lang, (v, _) in found.items() if v is Resent.UNKNOWN}
        for lang, (verdict, update) in found.items():
            if verdict is Resent.ANSWERED or verdict is Resent.CONFLICT:
                stream.answered.add(lang)
                self.stats[verdict.value] += 1
                self.bus.hub.to_owner(update or seq_reused(event, lang), stream.life.owner)
        return {lang: s for lang, s in stream.sessions.items() if lang not in stream.answered}

    async def _translate(self, stream: Stream, admission: Admission, received: float) -> None:
        """Translate one admitted event into every language at once; publish each
        language's update when it is ready; a final is answered once all have."""
        event = admission.event
        # A partial's decodes get an id of their own, by which a newer event aborts them
        # (`Stream.supersede`), unless the stream's last MAX_CANCELLED_IN_A_ROW were
        # cancelled: this one then runs to its end.
        # A partial that runs to its end is admitted like a final, ahead of abortable ones.
        cancellable = not event.is_final and stream.cancelled_in_row < MAX_CANCELLED_IN_A_ROW
        request_id = new_request_id() if cancellable else None
        priority = Priority.PARTIAL if cancellable else Priority.FINAL
        cancelled = False

        async def one(lang: str, session: StreamSession) -> None:
            nonlocal cancelled
            try:
                update = await answer(
                    session,
                    event,
                    request_id=request_id,
                    priority=priority,
                    received=received,
                    source=admission.source,
                    source_ids=admission.source_ids.get(lang),
                )
            except DecodingCancelled:
                cancelled = True
                if not stream.closed:  # else `abort` gave up on it: its result is dropped
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
                    self.deliver(
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
            if lang in stream.unshown:  # it may have been shown: the writer's only
                self.stats[Resent.UNKNOWN.value] += 1
                session.uncount_final()  # its terms were counted then
                update = dataclasses.replace(update, epoch=stream.life.epoch, lang=lang)
                self.bus.hub.to_owner(update, stream.life.owner)
                return
            self.publish(stream, lang, update)

        stream.current = event
        stream.answered, stream.unshown = set(), set()
        sessions = stream.sessions
        if stream.life.resumes(event):
            sessions = await self._answer_from_history(stream, admission)
            if stream.closed:  # aborted meanwhile: `abort` answered it
                stream.current = None
                return
            if not sessions:  # every language answered it before: nothing to translate
                stream.current = None
                stream.life.fire(Trigger.ANSWERED)
                return
        stream.abortable = request_id
        stream.supersede()  # a newer event may be waiting already
        try:
            async with self.slots:
                # Waiting for a worker can take a while when many streams are busy; a
                # partial of a stream that began closing meanwhile (its writer left) is
                # no longer wanted by anyone: do not spend a worker on it.
                if not stream.taking_events and not event.is_final:
                    self.stats["superseded"] += 1
                    return
                if stream.closed:  # aborted while waiting: answered
                    return
                if len(sessions) == 1:  # no task of its own: the common case
                    ((lang, session),) = sessions.items()
                    await one(lang, session)
                else:
                    async with anyio.create_task_group() as languages:
                        for lang, session in sessions.items():
                            languages.start_soon(one, lang, session)
        finally:
            stream.current = None
            stream.abortable = None
        if stream.closed:  # aborted meanwhile: `abort` answered what was left
            return
        stream.cancelled_in_row = stream.cancelled_in_row + 1 if cancelled else 0
        if event.is_final:
            stream.life.fire(Trigger.ANSWERED)
