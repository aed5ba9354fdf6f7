"""One WebSocket connection's I/O: receive frames, carry out the core's actions, forward
subscriptions into the outbox, send.

The rules are the sans-I/O `ConnectionCore`'s; this module only awaits. Per connection,
one task receives and one task sends, and the engine's replies go into a bounded `Outbox`,
so the engine never waits on a socket: a writer's own replies and a viewer's are handed
over as they are published (`ReplyQueue.attach`), in the publishing task. When
the sender is idle and the socket takes a frame at once, an update is written on the spot
instead (`eager.send_now`), sparing the sender's wake-up; anything else waits its turn in
the outbox, so the order holds. A writer
streaming audio has one more task, its `AudioFeed` (recognition off the event loop), whose
events are pushed as the connection's own and echoed back to it as `partial_transcript`
messages (kept apart from the outbox, in `echoes`, and sent first).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import anyio
import anyio.abc
import anyio.lowlevel
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

import protocol
from engine.replies import Wake
from engine.server.audio import AudioFeed, AudioService, Clock
from engine.server.connection import (
    Close,
    ConnectionCore,
    FeedAudio,
    FinishAudio,
    Ignore,
    OpenAudio,
    Push,
    Reply,
    SetOwnGlossary,
    Watch,
)
from engine.server.eager import Unfinished, idle_and_open, send_now
from engine.server.metrics import ServerMetrics
from engine.server.outbox import Outbox
from engine.server.state import ServerState
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.subscriptions import Subscription
from protocol import (
    EngineClosed,
    ErrorMessage,
    GlossarySet,
    InvalidEvent,
    PartialTranscript,
    TranslationUpdate,
)

log = logging.getLogger(__name__)

# An update goes to its writer and to every viewer of the stream: encode it once. Updates
# are frozen (hashable) and the cache holds the last few thousand, far more than are ever
# in flight at once.
_encoded = functools.lru_cache(maxsize=4096)(protocol.serialize)

YIELD_EVERY = 16
"""Messages a connection's receive loop takes in a row before it lets other tasks run."""

MAX_ECHOES = 64
"""Echoes of heard partials waiting to be sent; past it the oldest non-final one goes (a
newer partial of its segment says more)."""

AUDIO_LEAVE_GRACE = 5.0
"""Seconds a writer that left mid-audio gets for its last utterance to be recognized and
pushed (so viewers get its final) before its streams close; past it the utterance ends
with the words shown last (`AudioFeed.cut`)."""


@dataclass(eq=False)
class Client:
    """One connection: its rules (`core`), its outbox and the tasks that serve it.

    `pumps` counts its subscriptions being forwarded: a stopping server ends the outbox
    only once the last one has delivered its final replies (the writer's own is handed
    its replies as they are published, and counts until it ends). `audio`: the server's audio
    input (None: it takes none); `feed`: this connection's audio stream, if any (the one
    binary frames go to); `feeds`: every one of its audio streams still running (one that
    ended still flushing, and the next one waiting for it).
    """

    ws: ServerConnection
    core: ConnectionCore
    outbox: Outbox
    engine: IncrementalTranslator
    state: ServerState
    metrics: ServerMetrics
    io: anyio.abc.TaskGroup | None = None
    subscriptions: set[Subscription] = field(default_factory=set)
    writes: Subscription | None = None  # the replies of the streams it writes
    pumps: int = 0
    gone: bool = False
    sent: anyio.Event = field(default_factory=anyio.Event)
    # A stopping server: replies about finals read after the outbox ended, sent before
    # the close frame; `closing` once that frame is out (nothing can be sent after it);
    # `unanswerable` counts the finals read after it, which the client is to send again.
    late: deque[ErrorMessage] = field(default_factory=deque)
    closing: bool = False
    unanswerable: int = 0
    audio: AudioService | None = None
    feed: AudioFeed | None = None
    feeds: set[AudioFeed] = field(default_factory=set)
    # What is sent ahead of the outbox: echoes of what was heard, and `glossary_set`s.
    echoes: deque[PartialTranscript | GlossarySet] = field(default_factory=deque)
    # Where the numbering of each stream this connection wrote goes on (a second audio
    # stream into it, or audio after text).
    clocks: dict[str, Clock] = field(default_factory=dict)
    _dropped_audio_ms: float = 0.0
    # The sender waits for the outbox with nothing else to send: an update may be
    # written at once (`_put_update`). `_unfinished`: such a write that had to wait,
    # which the sender finishes before anything else.
    _idle: bool = False
    _unfinished: tuple[Unfinished, str] | None = None

    async def serve(self) -> None:
        """Serve the connection until it closes."""
        self.metrics.connections.labels(self.core.role.value).inc()
        try:
            async with anyio.create_task_group() as io:
                self.io = io
                io.start_soon(self._send_loop)
                try:
                    await self._receive_loop()
                finally:
                    # Gone mid-stream: its streams close (viewers still get the finals
                    # it sent) and free their slots; stop sending to it.
                    self.gone = True
                    try:
                        await self._leave_audio()
                    finally:
                        self.engine.owner_left(self.core.owner)
                        for sub in list(self.subscriptions):
                            self.engine.unsubscribe(sub)
                        io.cancel_scope.cancel()
        finally:
            self.sent.set()
            self.metrics.connections.labels(self.core.role.value).dec()
            if self.unanswerable:
                log.info(
                    "connection %d: %d final(s) arrived after the server's close frame, "
                    "unanswered (the client is to send them again)",
                    self.core.connection_id,
                    self.unanswerable,
                )

    def end_when_forwarded(self) -> None:
        """A stopping server's last word: the outbox ends now if nothing is forwarded any
        more, else when the last subscription has ended and delivered what it held (a
        viewer's subscription or the writer's own ends)."""
        if self.pumps == 0:
            self.outbox.end()

    async def wait_sent(self) -> None:
        """Until the outbox has ended, everything in it is sent and the close frame is out
        (or the socket closed)."""
        await self.sent.wait()

    # -- receiving ----------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        core = self.core
        taken = 0
        try:
            async for data in self.ws:
                # Frames already received are taken without yielding, and pushing an
                # event does not yield either: let other connections in every few.
                taken += 1
                if taken % YIELD_EVERY == 0:
                    await anyio.lowlevel.checkpoint()
                role = core.role
                action = core.receive(data, time.monotonic())
                self.metrics.received(core.message_type)
                if core.role is not role:
                    self.metrics.connections.labels(role.value).dec()
                    self.metrics.connections.labels(core.role.value).inc()
                if core.dropped_audio_ms != self._dropped_audio_ms and self.audio is not None:
                    self.audio.stats.dropped_fast_s += (
                        core.dropped_audio_ms - self._dropped_audio_ms
                    ) / 1000
                    self._dropped_audio_ms = core.dropped_audio_ms
                if isinstance(action, FeedAudio):  # the most frequent, first
                    self._feed_audio(action)
                elif isinstance(action, Reply):
                    self._reply(action.error, action.about_final)
                elif isinstance(action, Push):
                    await self._push(action)
                elif isinstance(action, OpenAudio):
                    self._open_audio(action)
                elif isinstance(action, FinishAudio):
                    self._finish_audio(action)
                elif isinstance(action, Close):
                    try:
                        self.engine.begin_close(action.stream_id, core.owner)
                    except InvalidEvent as exc:
                        self._reply(exc.error)
                elif isinstance(action, SetOwnGlossary):
                    await self._set_glossary(action)
                elif isinstance(action, Watch):
                    assert self.io is not None
                    self.io.start_soon(self._view, action.stream_id, action.lang, action.after)
                else:
                    assert isinstance(action, Ignore)
        except ConnectionClosed:
            pass

    async def _push(self, action: Push) -> None:
        event = action.event
        await self._push_event(event)
        # Audio into this stream later goes on after it, in a new segment.
        before = self.clocks.get(event.stream_id)  # no default Clock made per event
        offset = before.offset_ms if before is not None else Clock.offset_ms
        self.clocks[event.stream_id] = Clock(event.segment_id + 1, event.seq + 1, offset)

    def _subscribe_writes(self) -> None:
        if self.writes is None:  # subscribe before the first push: nothing is missed
            writes = self.writes = self.engine.updates(owner=self.core.owner)
            self._adopt(writes)
            writes.attach(self._own_reply, lambda: self._forwarded(writes))

    async def _push_event(self, event: PartialTranscript) -> None:
        self._subscribe_writes()
        try:
            await self.engine.push(event, self.core.owner)
        except InvalidEvent as exc:
            self._reply(exc.error, event.is_final)
        except EngineClosed:
            self._reply(self.state.shutting_down(event), event.is_final)

    # -- audio ----------------------------------------------------------------------------

    def _open_audio(self, action: OpenAudio) -> None:
        assert self.audio is not None and self.io is not None  # the core takes no audio else
        refused = self.engine.held_by_another(action.stream_id, self.core.owner)
        if refused is not None:  # its events would all be refused: no recognizer for them
            self.core.audio_ended(action.stream_id)
            if action.slot is not None:
                action.slot.release()
            self._reply(refused)
            return
        feed = self.audio.feed(action.stream_id, action.sample_rate, self._heard, action.slot)
        previous, self.feed = self.feed, feed
        self.feeds.add(feed)
        self._subscribe_writes()
        self.io.start_soon(self._run_feed, feed, previous)

    async def _run_feed(self, feed: AudioFeed, previous: AudioFeed | None) -> None:
        """One audio stream's task: after the connection's previous audio stream has
        pushed its last final (the numbering goes on from it), recognize until finished
        or failed; then close the stream if asked to."""
        sid = feed.stream_id
        try:
            if previous is not None:
                await previous.done.wait()
            await feed.run(self.clocks.get(sid, Clock()))
        finally:
            if not feed.finishing:  # it ended on its own: binary frames are stray now
                self.core.audio_ended(sid)
            if feed.stream is not None:
                self.clocks[sid] = feed.clock
            if self.feed is feed:
                self.feed = None
            self.feeds.discard(feed)
            feed.release()  # its recognizer is gone (or was never made)
            feed.done.set()
        if feed.error is not None:
            self._reply(feed.error)
        if feed.close_after:
            self.clocks.pop(sid, None)  # a new life of the stream starts afresh
            try:
                self.engine.begin_close(sid, self.core.owner)
            except InvalidEvent as exc:
                self._reply(exc.error)

    def _feed_audio(self, action: FeedAudio) -> None:
        feed = self.feed
        if feed is None or feed.stream_id != action.stream_id:
            return  # the core only feeds the stream it opened
        error = feed.put(action.pcm)
        if error is not None:
            self._reply(error)

    def _finish_audio(self, action: FinishAudio) -> None:
        feed = self.feed
        if feed is not None and feed.stream_id == action.stream_id and not feed.finishing:
            feed.finish(close=action.close)
            return
        if action.close:  # its feed has ended already (it failed): close as usual
            try:
                self.engine.begin_close(action.stream_id, self.core.owner)
            except InvalidEvent as exc:
                self._reply(exc.error)

    async def _heard(self, events: list[PartialTranscript]) -> None:
        """A feed's events: echoed to this writer (what was heard), pushed as its own."""
        for event in events:
            self._echo(event)
            await self._push_event(event)

    async def _set_glossary(self, action: SetOwnGlossary) -> None:
        """The writer's stream gets its own glossary; `glossary_set` or the refusal."""
        try:
            ack = await self.engine.set_glossary(action.message, self.core.owner)
        except InvalidEvent as exc:
            self._reply(exc.error)
        except EngineClosed:
            self._reply(self.state.shutting_down(action.message))
        else:
            self._echo(ack)

    def _echo(self, event: PartialTranscript | GlossarySet) -> None:
        if self.gone or self.outbox.ended:
            return
        if len(self.echoes) >= MAX_ECHOES:
            stale = next(
                (e for e in self.echoes if isinstance(e, PartialTranscript) and not e.is_final),
                self.echoes[0],
            )
            self.echoes.remove(stale)
        self.echoes.append(event)
        self.outbox.poke()  # the sender may wait on the outbox: send this first

    async def _leave_audio(self) -> None:
        """The connection is gone: its audio stream's last utterance still gets its
        final (recognized within `AUDIO_LEAVE_GRACE`, else the words shown last), then
        the server's audio slot is free."""
        await self.finish_audio(cut_after=AUDIO_LEAVE_GRACE)

    async def finish_audio(self, cut_after: float) -> int:
        """End this connection's audio streams, if any, as `end_audio` would, and return
        once their last finals are pushed (a stopping server calls it before closing the
        engine, so that what was heard is still translated). Those still recognizing
        after `cut_after` seconds are cut (`AudioFeed.cut`): their utterances end with
        the words shown last, and the speaker hears of the audio left unrecognized.
        Returns how many were cut."""
        feeds = list(self.feeds)
        for feed in feeds:
            self.core.audio_ended(feed.stream_id)
            feed.finish()
        with anyio.move_on_after(cut_after):
            for feed in feeds:
                await feed.done.wait()
            return 0
        running = [feed for feed in feeds if not feed.done.is_set()]
        for feed in running:
            feed.cut()
        for feed in running:
            await feed.done.wait()
        return len(running)

    # -- forwarding subscriptions ---------------------------------------------------------

    async def _view(self, stream_id: str, lang: str | None, after: str | None = None) -> None:
        """Follow a stream in one language for a viewer, across restarts of the stream: a
        subtitle screen outlives the pipeline connection that feeds it. Each follow-up
        subscription resumes after the last update forwarded, so a stream handed over to
        a new writer repeats nothing and skips nothing."""
        while not (self.state.stopping or self.gone):
            sub = self.engine.updates(stream_id, lang=lang, after=after)
            self._adopt(sub)
            got = await self._forward(sub)
            after = sub.cursor or after
            if not got and stream_id not in self.engine.streams:
                await anyio.sleep(0.1)  # never spin on a subscription that ends at once

    def _adopt(self, sub: Subscription) -> None:
        # Counted from the moment it exists, so a shutdown never ends the outbox while a
        # viewer's subscription is still to be attached.
        self.pumps += 1
        self.subscriptions.add(sub)

    async def _forward(self, sub: Subscription) -> int:
        """Hand a viewer's adopted subscription's replies to the outbox as they are
        published (`ReplyQueue.attach`: no task wakes per update, however many viewers a
        stream has), until it ends; returns how many."""
        count = 0
        ended = Wake()

        def deliver(reply: TranslationUpdate | ErrorMessage) -> None:
            nonlocal count
            count += 1
            if isinstance(reply, TranslationUpdate):  # not an error about a final
                self._put_update(reply)

        try:
            sub.attach(deliver, ended.set)
            await ended.wait()
        finally:
            self._forwarded(sub)
        return count

    def _own_reply(self, reply: TranslationUpdate | ErrorMessage) -> None:
        """A reply of a stream this connection writes, as the engine publishes it. This
        is the one place each update passes exactly once, so it records the engine
        latency."""
        if isinstance(reply, ErrorMessage):  # in place of a final's update
            self._reply(reply, about_final=True)
            return
        self.metrics.latency(reply.lang or "", reply.latency_ms / 1000.0)
        self._put_update(reply)

    def _forwarded(self, sub: Subscription) -> None:
        """`sub` has ended and all it took is in the outbox (or sent)."""
        self.subscriptions.discard(sub)
        self.engine.unsubscribe(sub)  # a no-op unless its viewer's task was cancelled
        if sub.dropped:
            self.metrics.dropped_updates.inc(sub.dropped)
        self.pumps -= 1
        if self.state.stopping and self.pumps == 0:
            self.outbox.end()

    def _put_update(self, update: TranslationUpdate) -> None:
        """Send `update` now if the sender is idle and the socket takes it at once, else
        queue it in the outbox (behind what waits there)."""
        if (
            self._idle
            and self._unfinished is None
            and not self.echoes
            and not self.outbox
            and not self.outbox.ended
            and not self.gone
            and idle_and_open(self.ws)
        ):
            try:
                unfinished = send_now(self.ws, _encoded(update))
            except ConnectionClosed:
                return  # the receive loop ends the connection
            if unfinished is None:
                self.metrics.sent("translation_update")
            else:  # the sender finishes it before sending anything else
                self._unfinished = (unfinished, "translation_update")
                self.outbox.poke()
            return
        before = self.outbox.dropped_updates
        self.outbox.put_update(update)
        if self.outbox.dropped_updates > before:
            self.metrics.dropped_updates.inc()

    # -- sending ------------------------------------------------------------------------

    def _reply(self, error: ErrorMessage, about_final: bool = False) -> None:
        self.metrics.errors.labels(error.code).inc()
        if self.outbox.put_error(error, keep=about_final):
            return
        if about_final and self.outbox.ended:
            # A stopping server: a final read before the close frame is still answered
            # (`_close_going_away` sends these); one read after it cannot be.
            if not self.closing and len(self.late) < self.outbox.max_kept_errors:
                self.late.append(error)
                return
            if self.closing:
                self.unanswerable += 1
        self.metrics.dropped_errors.inc()
        if about_final and not self.outbox.ended:
            # Finals it cannot be told about: a client that sends and never reads.
            cid = self.core.connection_id
            log.warning("closing connection %d: it does not read its replies", cid)
            assert self.io is not None
            self.io.start_soon(self.ws.close, 1008, "not reading replies")

    async def _send_loop(self) -> None:
        """The only task that awaits this connection's socket. Once the outbox has ended
        (the server is stopping), it answers what was read meanwhile and closes (1001;
        1012 when other nodes serve the same streams, so the client reconnects there)."""
        try:
            while (item := await self._next()) is not None:
                await self._send(item)
            while self.echoes:
                await self._send(self.echoes.popleft())
            await self._close_going_away()
        except ConnectionClosed:
            pass
        finally:
            if self._unfinished is not None:  # the connection is gone: never to be sent
                self._unfinished[0].close()
                self._unfinished = None
            self.sent.set()

    async def _next(
        self,
    ) -> TranslationUpdate | ErrorMessage | PartialTranscript | GlossarySet | None:
        """The next message to send: an echo if one waits, else the outbox's next (None:
        the outbox has ended), once an update written at once that had to wait is sent.
        An echo arriving meanwhile wakes the wait (`Outbox.poke`), which takes nothing
        from the outbox."""
        while True:
            if self._unfinished is not None:
                (unfinished, kind), self._unfinished = self._unfinished, None
                await unfinished
                self.metrics.sent(kind)
                continue
            if self.echoes:
                return self.echoes.popleft()
            item = self.outbox.take()
            if item is not None:
                return item
            if self.outbox.ended:
                return None
            self._idle = True
            try:
                await self.outbox.ready()
            finally:
                self._idle = False

    async def _send(
        self, item: TranslationUpdate | ErrorMessage | PartialTranscript | GlossarySet
    ) -> None:
        if isinstance(item, PartialTranscript):  # an echo: sent once, not worth caching
            await self.ws.send(protocol.serialize(item))
            self.metrics.sent("partial_transcript")
            return
        if isinstance(item, GlossarySet):
            await self.ws.send(protocol.serialize(item))
            self.metrics.sent("glossary_set")
            return
        await self.ws.send(_encoded(item))
        kind = "translation_update" if isinstance(item, TranslationUpdate) else "error"
        self.metrics.sent(kind)

    async def _close_going_away(self) -> None:
        """Send the close frame (1001 or 1012) once every message that reached the server before it
        is answered: until two rounds of the event loop in a row read nothing new (one to
        take what the socket holds, one for the receive loop to answer it; within
        `LAST_WORDS_SECONDS`, so that a client sending without pause cannot hold the
        close). The last check and the frame are one step: nothing runs in between."""
        quiet = 0
        give_up = anyio.current_time() + LAST_WORDS_SECONDS
        while quiet < 2 and anyio.current_time() < give_up:
            await anyio.sleep(0)
            if self.late:
                quiet = 0
                while self.late:
                    await self._send(self.late.popleft())
            elif _unread(self.ws):
                quiet = 0
            else:
                quiet += 1
        self.closing = True
        self.sent.set()
        # websockets writes the frame before its first await, then waits for the answer.
        code = self.state.close_code
        await self.ws.close(code, "server restarting" if code == 1012 else "server shutting down")


LAST_WORDS_SECONDS = 1.0
"""How long a stopping connection goes on answering what it reads before its close frame."""


def _unread(ws: ServerConnection) -> int:
    """Messages `websockets` has received on `ws` that its reader has not taken yet: its
    assembler's queue (no public API says so; 0 if that ever changes)."""
    try:
        return len(ws.recv_messages.frames)
    except (AttributeError, TypeError):
        return 0
