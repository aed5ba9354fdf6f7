"""The async incremental translator: many streams, latest partial wins, finals never lost.

One anyio task per stream takes its pending events in order and runs its `StreamSession`
on the event loop, whose encoder and decoder calls go to the model's one decode scheduler
(`engine.decoding.scheduler`), where the streams' decodes share batched decoder steps; the
task awaits their futures (`engine.streaming.awaiting`), so no thread waits per update. When a newer
event arrives while a partial is being decoded, that decode leaves the batch at its next
step and the newest source is decoded instead, so delay never piles up behind a fast
talker; finals are never skipped or cancelled.

Fan-out: with several models (`engine.decoding.targets.Targets`, one per target language) a stream
keeps one lifecycle, one queue and one task, and one session per language. Each admitted
event is translated into every language at once (one task per language, each model's
scheduler batching its own rows) and each language's update is published as soon
as it is ready. So latest-wins, ownership and the count of finals owed stay one decision
per stream; a final counts as answered once every language has answered it (its update,
or an error naming the language). The price: a stream's languages advance event by
event together, so the slower model sets the pace of the stream's next partial.

This module admits events and carries out each stream's lifecycle decisions; translating
the admitted events and publishing their replies is the stream runner's
(`engine.streaming.runner`). Who reads the replies is not decided here either: each is
published to an `UpdateBus` (`engine.streaming.bus`), which records it and hands it to the
stream's writer and viewers through its hub (`engine.streaming.fanout`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from engine.decoding.targets import Targets, glossaries_by_language
from engine.decoding.translator import Translator
from engine.errors import InputTooLongError
from engine.glossary import Glossary
from engine.languages import in_other_script
from engine.streaming import own_glossary
from engine.streaming.awaiting import Slots
from engine.streaming.bus import Claim, InProcessBus, UpdateBus, subscribe
from engine.streaming.lifecycle import (
    Owner,
    StreamLifecycle,
    StreamTable,
    Verdict,
    too_large,
)
from engine.streaming.runner import StreamRunner
from engine.streaming.session import StreamingOptions, StreamSession
from engine.streaming.stream import Admission, Stream
from engine.streaming.subscriptions import Subscription, target_language
from protocol import (
    EngineClosed,
    ErrorCode,
    ErrorMessage,
    GlossarySet,
    InvalidEvent,
    PartialTranscript,
    SetGlossary,
)

log = logging.getLogger(__name__)

# Default number of streams translating at once (see `IncrementalTranslator`).
DECODE_SLOTS = 64

HANDOVER_WAIT = 5.0
"""Seconds a writer that reconnects waits for its stream's old life (its connection gone)
to answer the finals it accepted, before the stream goes on as a new life; past it the
writer is refused (`forbidden`: another connection's) and sends again."""


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
    `glossaries`: terms every stream's translations place, one glossary per target
    language (`engine.glossary`; checked against each language's model at start).
    A server passes each connection's `Owner` to `push`, `close_stream` and `owner_left`;
    an embedding caller passes none. Replies go to `bus` (default: an `InProcessBus` whose
    subscriptions hold up to `queue_size` replies each); `updates` subscribes through it.
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
        bus: UpdateBus | None = None,
        glossaries: Glossary | Sequence[Glossary] = (),
    ) -> None:
        if isinstance(translator, Translator):
            translator = [translator]
        self.targets = translator if isinstance(translator, Targets) else Targets(translator)
        # Every stream's terms, per target language (`glossaries`: one per language).
        self.glossaries = glossaries_by_language(glossaries, self.targets)
        # The default language's model (the only one without fan-out).
        self.translator = self.targets[self.targets.default]
        self.options = options or StreamingOptions()
        self.queue_size = queue_size
        self.stats: Counter[str] = Counter()
        # Streams translating at once. They mostly wait on the model's decode scheduler,
        # which batches them into shared decoder steps, so this bounds the requests
        # queued there and their memory, not compute (that is the scheduler's
        # `max_rows`). At least as many as the rows the models' batches may hold (on a
        # GPU, thousands).
        held = max(t.scheduler.lanes * t.scheduler.options.max_rows for t in self.targets.values())
        self._limiter = Slots(decode_slots or max(DECODE_SLOTS, held))
        self._table: StreamTable[Stream] = StreamTable(
            max_streams=max_streams, max_pending_finals=max_pending_finals
        )
        self._bus = bus if bus is not None else InProcessBus(queue_size)
        self._group: anyio.abc.TaskGroup | None = None
        # One admission at a time per stream id, so two writers opening it cannot both
        # claim a life from the bus (the second one's would fence out the first one's).
        self._admitting: dict[str, anyio.Lock] = {}
        # Writers' glossaries for streams they have not opened yet (`set_glossary`).
        self._waiting = own_glossary.Waiting()
        self._runner = StreamRunner(self._bus, self._table, self.stats, self._limiter)

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
    def ready(self) -> bool:
        """Whether replies can be published (a shared bus: its server is reachable)."""
        return self._bus.ready

    @property
    def bus(self) -> UpdateBus:
        return self._bus

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
        return None if tag is None else target_language(tag, self.languages)

    # -- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> IncrementalTranslator:
        if self._group is not None:
            raise RuntimeError("IncrementalTranslator is already running")
        await self._bus.start(self.languages)
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        """`aclose`, then the task group's exit, which sees the exception if any."""
        try:
            await self.aclose()
        finally:
            group, self._group = self._group, None
            if group is not None:
                group.cancel_scope.cancel()
                await group.__aexit__(*exc_info)

    async def aclose(self) -> None:
        """Take nothing more, finish every stream's accepted finals, end every
        subscription; idempotent."""
        if self._table.closed:
            return
        for stream in self._table.shutdown():
            self.stats["superseded"] += stream.drop_partials()
            stream.supersede()
            stream.wake.set()
        for stream in list(self._table):
            await stream.done.wait()
        self._table.finish_shutdown()
        await self._bus.aclose()  # a shared bus: what is queued reaches Redis and writers
        self._bus.hub.end_all()

    def abort(self, reason: str) -> int:
        """Give up on work not done yet (a shutdown past its deadline): every accepted final
        transcript still waiting or being translated is answered with an `unavailable`
        error (a running translation's late result is then dropped, so each final still
        gets exactly one reply), and every subscription ends. Returns how many finals were
        answered so. The engine takes nothing more afterwards; leaving its `async with`
        stops awaiting the translations still running (the scheduler answers them to no
        one)."""
        answered = 0
        for stream, owed in self._table.abort():
            events = [admission.event for admission, _ in stream.pending]
            if stream.current is not None:
                events.insert(0, stream.current)
            stream.pending.clear()
            stream.abort_decoding()  # its result would be dropped
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
                    self._runner.deliver(error, stream)
        self._bus.hub.end_all()
        self.stats["aborted_finals"] += answered
        return answered

    # -- API ----------------------------------------------------------------------------

    @property
    def streams(self) -> list[str]:
        """Ids of the streams in the engine, closing ones included (their ids are not
        free until their accepted finals are answered)."""
        return self._table.ids

    def epoch_of(self, stream_id: str) -> int | None:
        """The life (`epoch`) of the id now open, or None when the id is free: a consumer
        keeping state per stream life drops it once this no longer names that life."""
        stream = self._table.get(stream_id)
        return stream.life.epoch if stream is not None else None

    def held_by_another(self, stream_id: str, owner: Owner | None) -> ErrorMessage | None:
        """Why `owner` may not write to `stream_id` (another owner holds it), or None;
        the same refusal its events would get."""
        return self._table.held_by_another(stream_id, owner)

    def updates(
        self,
        stream_id: str | None = None,
        *,
        owner: Owner | None = None,
        lang: str | None = None,
        after: str | None = None,
    ) -> Subscription:
        """Subscribe now (before pushing, so nothing is missed) to one stream or all, or
        with `owner` to the replies of every stream that owner holds (a writer's updates,
        and the `error` replies that answer its finals). `lang`: only that target
        language's updates (a tag such as "zh-Hans" names the model of its base
        language; `InvalidEvent` for one no model translates into); None: every
        language's, each update saying which (`lang`). `after`: the `cursor` of the last
        update a viewer had: it gets what came after, not the backlog."""
        lang = self.language(lang)
        if self._table.closed:  # nothing will be published: it ends at once
            sub = Subscription(stream_id, self.queue_size, owner, lang)
            sub.end()
            return sub
        # A viewer's starts from the last lines of each open stream (its recent finals,
        # then the current segment's latest update): one joining mid-talk sees what was
        # just said.
        return subscribe(self._bus, stream_id, owner=owner, lang=lang, after=after)

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop delivering to `sub` and end it."""
        self._bus.hub.unsubscribe(sub)

    async def push(self, event: PartialTranscript, owner: Owner | None = None) -> None:
        """Queue an event and return at once; raises `InvalidEvent` for a refused one
        (the lifecycle's admission rules say which), `EngineClosed` when not running."""
        if self._table.closed or self._group is None:
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
            admitted = self._admit_now(event, owner)
            if admitted is None:  # a new life, a handover, or another admission of the id
                admitted = await self._admit_in_turn(event, owner)
        except InvalidEvent:
            self.stats["rejected"] += 1
            raise
        stream, admission, opened = admitted
        if event.is_final and not stream.warned_script:
            self._check_script(stream, admission.source)
        if opened:
            self._group.start_soon(self._runner.run_stream, stream)
        self.stats["events"] += 1
        # Latest wins: a waiting partial is superseded by any newer event; finals stay.
        self.stats["superseded"] += stream.drop_partials()
        stream.pending.append((admission, received))
        stream.supersede()  # and so is a partial being decoded
        stream.busy = True
        stream.wake.set()

    async def set_glossary(self, message: SetGlossary, owner: Owner | None = None) -> GlossarySet:
        """Give a stream its own glossary for the target language the text's header
        names (`SetGlossary`): merged over the engine's (`glossaries`), the stream's
        entries winning, it applies to every translation that starts after this returns
        (from the writer's next partial), replaces the stream's earlier one for that
        language (one without entries clears it) and is kept with the stream's history,
        so a life that resumes the stream (a writer back after a drop, on any node, or
        restarted) applies it too; closing the stream ends it. Sent before the stream's
        first partial, it waits for that partial (from the same `owner`). Returns the
        acknowledgement; raises `InvalidEvent`: `invalid_message` (field `glossary`)
        naming a bad line or a language the models do not take, `forbidden` for another
        owner's stream, `unavailable` when a shared bus cannot keep it."""
        if self._table.closed or self._group is None:
            raise EngineClosed("IncrementalTranslator is not running (use `async with`)")
        sid = message.stream_id
        lang, glossary = own_glossary.read(message, self.targets)
        refusal = self._table.held_by_another(sid, owner)
        if refusal is not None:
            raise InvalidEvent(refusal)
        stream = self._table.get(sid)
        if stream is None or not stream.taking_events or stream.life.owner != owner:
            self._waiting.hold(owner, sid, lang, message.glossary, glossary)
        else:
            own = own_glossary.update(stream.own_glossaries, lang, message.glossary, glossary)
            await self._bus.keep_glossaries(sid, stream.life.epoch, own_glossary.texts_of(own))
            own_glossary.apply(stream, own, self.glossaries)
        self.stats["glossaries_set"] += 1
        return GlossarySet(sid, lang, len(glossary))

    def stream_terms(self, stream_id: str) -> dict[str, tuple[int, int]]:
        """A stream open here: its glossary terms over its finals so far (its earlier
        lives' included), per target language: (matched, placed); empty when the stream
        is not open here (`terms` asks the bus too)."""
        stream = self._table.get(stream_id)
        return stream.terms() if stream is not None else {}

    async def terms(self, stream_id: str) -> dict[str, tuple[int, int]]:
        """`stream_terms` wherever the stream's writer is: this process's count when the
        stream is open here, else what the bus keeps (`UpdateBus.kept_terms`: the node
        holding it keeps them there, with a shared bus; a stream handed over keeps its
        last ones until it is closed); empty for a stream no process has open. Raises
        `InvalidEvent` (`unavailable`) when the bus cannot be reached."""
        here = self.stream_terms(stream_id)
        return here if here else await self._bus.kept_terms(stream_id)

    def _check_script(self, stream: Stream, source: str) -> None:
        """One warning per stream whose final is mostly in another script than the models'
        source language (e.g. Chinese into an English -> Chinese model): the models
        translate it into nonsense without a word, so the log says it once."""
        lang = self.targets.source_lang
        if in_other_script(source, lang):
            stream.warned_script = True
            self.stats["wrong_script_streams"] += 1
            log.warning(
                "stream %r: its text is mostly in another script than the model's source "
                "language (%s), e.g. %r: is it the right model?",
                stream.stream_id,
                lang,
                source[:60],
            )

    def _admit_now(
        self, event: PartialTranscript, owner: Owner | None
    ) -> tuple[Stream, Admission, bool] | None:
        """An event of an open stream, with no other admission of its id under way, is
        admitted here without waiting (the case of nearly every event); None when it
        must wait its turn (`_admit_in_turn`). Raises `InvalidEvent` for a refused one."""
        if event.stream_id in self._admitting:
            return None
        decision = self._table.admit(event, owner)
        if decision.verdict is not Verdict.ACCEPT:
            return None
        assert decision.stream is not None
        admission = self._prepare(event)
        self._table.accept(decision.stream, event)
        return decision.stream, admission, False

    async def _admit_in_turn(
        self, event: PartialTranscript, owner: Owner | None
    ) -> tuple[Stream, Admission, bool]:
        """`_admit`, one admission at a time per stream id."""
        sid = event.stream_id
        lock = self._admitting.setdefault(sid, anyio.Lock())
        try:
            async with lock:
                return await self._admit(event, owner)
        finally:
            if not lock.statistics().tasks_waiting:
                self._admitting.pop(sid, None)

    async def _admit(
        self, event: PartialTranscript, owner: Owner | None
    ) -> tuple[Stream, Admission, bool]:
        """Carry out the table's decision on `event`: the stream, the admission, and
        whether it opened the stream. A writer that reconnects finds its stream's old
        life closing (its connection gone): it waits for the old life's finals (within
        `HANDOVER_WAIT`), then goes on as a new one. A new life is claimed from the bus
        only once every rule passed, text included."""
        decision = self._table.admit(event, owner)
        if decision.verdict is Verdict.HANDOVER:
            assert decision.stream is not None
            with anyio.move_on_after(HANDOVER_WAIT):
                await decision.stream.done.wait()
            decision = self._table.admit(event, owner, handover=False)
        admission = self._prepare(event)
        if decision.verdict is Verdict.ACCEPT:
            assert decision.stream is not None
            self._table.accept(decision.stream, event)
            return decision.stream, admission, False
        claim = await self._bus.claim(event.stream_id)
        life = StreamLifecycle(event.stream_id, owner, claim.epoch, claim.answered_through)
        try:
            own = await self._own_glossaries(event.stream_id, owner, claim)
            # A resumed life (its writer back, here or on another node, or restarted)
            # counts on from the stream's kept counts, as it keeps its glossaries.
            counts = await self._bus.kept_terms(event.stream_id) if claim.resumed else {}
            stream = self._table.open(self._make_stream(life), event)
        except InvalidEvent:  # the engine stopped or filled up while the bus answered
            self._bus.release(event.stream_id)
            raise
        own_glossary.apply(stream, own, self.glossaries)
        stream.carry_terms(counts)
        return stream, admission, True

    async def _own_glossaries(
        self, stream_id: str, owner: Owner | None, claim: Claim
    ) -> own_glossary.Own:
        """A new life's own glossaries: a resumed life's kept ones, then what its writer
        sent before this first partial; recorded for the new life (a new stream's, even
        when none, so that a closed life's are never resumed)."""
        own: own_glossary.Own = {}
        if claim.resumed:
            kept = await self._bus.kept_glossaries(stream_id)
            own = own_glossary.parse_kept(stream_id, kept, self.targets)
        sent = self._waiting.take(owner, stream_id)
        own.update(sent)
        if sent or (not claim.resumed and self._bus.shared):
            await self._bus.keep_glossaries(stream_id, claim.epoch, own_glossary.texts_of(own))
        return own

    async def wait_idle(self, stream_id: str | None = None) -> None:
        """Wait until a stream (or every stream) has nothing pending or running."""
        ids = [stream_id] if stream_id is not None else self._table.ids
        for sid in ids:
            while (stream := self._table.get(sid)) is not None and (stream.pending or stream.busy):
                await stream.wait_idle()

    def begin_close(self, stream_id: str, owner: Owner | None = None) -> None:
        """Start closing a stream (raises `InvalidEvent` when it is not `owner`'s, not
        open, or closing already): its waiting partials are dropped, its accepted finals
        are still translated and published, then it is released."""
        stream = self._table.close(stream_id, owner)
        self.stats["superseded"] += stream.drop_partials()
        stream.supersede()
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
        self._waiting.forget(owner)
        streams = self._table.owner_left(owner)
        for stream in streams:
            self.stats["superseded"] += stream.drop_partials()
            stream.supersede()
            stream.wake.set()
        return len(streams)

    # -- internals ------------------------------------------------------------------

    def _make_stream(self, life: StreamLifecycle) -> Stream:
        sessions = {
            lang: StreamSession(
                life.stream_id,
                translator,
                self.options,
                lang=lang,
                epoch=life.epoch,
                glossary=self.glossaries.get(lang),
            )
            for lang, translator in self.targets.items()
        }
        return Stream(life, sessions)

    def _prepare(self, event: PartialTranscript) -> Admission:
        """Admission's text step: normalise once (every model shares the source
        language) and tokenise once per model, for decoding to reuse; the text is the
        last rule (`too_large`)."""
        source = self.options.clean(event.text, self.targets.source_lang)
        if not source:
            return Admission(event, source, {})
        partial = not event.is_final
        try:
            ids = {
                lang: translator.source_ids(source, partial=partial)
                for lang, translator in self.targets.items()
            }
        except InputTooLongError as exc:
            raise too_large(event, exc) from None
        return Admission(event, source, ids)
