"""One state machine per stream: admission, ownership, segments, closing and release.

Written after h11's `_state.py`: a stream's phases and what moves it between them are one
table (`TRANSITIONS`), and every rule about what a stream takes is decided in one place
(`StreamTable.admit`, `StreamTable.open`, `StreamTable.close`, `StreamTable.owner_left`,
`StreamTable.shutdown`, `StreamTable.release`). Nothing here does I/O, starts a task, calls
out or knows about sockets: the table returns decisions (`Decision`, the streams to act
on) and the controller (`engine.streaming.controller`) carries them out; the server and
replay only talk to the controller. A stream's life number (`epoch`) is not counted here:
the update bus hands it out with the stream's claim (with several server processes they
share it), and the table records the life it is given.

Phases (`Phase`):

    OPEN ──partial──> LIVE ──final──> OPEN          (a new segment may start at once)
      │                 │
      └──close / owner left / shutdown──> CLOSING ──drained──> CLOSED  (id free again)
                                    (abort: any phase ──> CLOSED)

"Final pending" is a count (`finals_pending`), not a phase: a talker may start the next
segment before the last final's reply arrives, and a closing stream still owes the replies
of the finals it accepted. The count makes the reply contract checkable: a stream may only
be released (`DRAINED`) when it is zero, and `ABORT` is the one way to drop it, which the
caller does only after answering each of those finals with an `unavailable` error.

The engine as a whole has a phase too (`EnginePhase`, kept by the table): running, then
draining (a shutdown: nothing new is taken), then closed. It is the engine's one record of
whether it takes work; the server keeps its own (`engine.server.connection.ServerState`),
since it stops before its engine does and may have none yet.

A stream holds its lifecycle (`life`), as h11's `Connection` holds its state object: the
controller's stream adds its queue and sessions around it, and only the table moves it.

Words for ending things, each with one meaning in the engine and the server:

- **close**: a stream's owner ends the stream (`close_stream` waits until the stream is
  released, `begin_close` returns at once; `StreamTable.close`, `Trigger.CLOSE`).
- **owner left**: the owner's connection is gone; its streams close as if it had closed
  them (`owner_left`, `Trigger.OWNER_LEFT`).
- **shutdown**: the engine or the server takes nothing new and finishes what it accepted
  (`StreamTable.shutdown`, `Trigger.SHUTDOWN`, `SubtitleServer.shutdown`);
  `IncrementalTranslator.aclose` is the engine's shutdown, awaited to the end, under the
  name Python gives an async resource's close.
- **abort**: work not finished is given up at once: the engine's, past a shutdown's
  deadline, every final still owed then answered `unavailable` (`abort`,
  `Trigger.ABORT`); or a decode's, in its scheduler (`abort(ids)`: a superseded partial's
  row leaves the batch).
- **drained / release**: a closing stream with nothing waiting or running leaves the
  table and its id is free (`Trigger.DRAINED`, `StreamTable.release`).
- **end**: a reader's queue takes nothing more and stops once emptied (`Subscription.end`,
  `UpdateBus.end_stream`, `Hub.end_all`, `Outbox.end`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Generic, Protocol, TypeVar

from engine.errors import InputTooLongError
from engine.streaming.history import Resent
from protocol import ErrorCode, ErrorMessage, InvalidEvent, PartialTranscript


class Phase(Enum):
    """Where a stream is in its life."""

    OPEN = "open"  # takes events; no segment has partials without their final
    LIVE = "segment_live"  # a segment has had partials and no final yet
    CLOSING = "closing"  # takes nothing; accepted finals are still translated
    CLOSED = "closed"  # released: the id is free, a new stream with it is a new epoch


class EnginePhase(Enum):
    """Where the engine (its table of streams) is in its life."""

    RUNNING = "running"  # takes events
    DRAINING = "draining"  # shutdown: takes nothing; accepted finals are still translated
    CLOSED = "closed"  # drained or aborted: nothing more is published


class Trigger(Enum):
    """What happens to a stream."""

    PARTIAL = "partial"  # a non-final transcript was admitted
    FINAL = "final"  # a final transcript was admitted
    ANSWERED = "answered"  # an admitted final got its one reply (update or error)
    CLOSE = "close"  # close_stream by its owner
    OWNER_LEFT = "owner_left"  # the owner (a connection) is gone
    SHUTDOWN = "shutdown"  # the engine stops taking work
    DRAINED = "drained"  # closing, and nothing is waiting or running any more
    ABORT = "abort"  # past a shutdown deadline: pending finals answered `unavailable`


_ENDING = {Trigger.CLOSE: Phase.CLOSING, Trigger.OWNER_LEFT: Phase.CLOSING}
_ENDING |= {Trigger.SHUTDOWN: Phase.CLOSING, Trigger.ABORT: Phase.CLOSED}

TRANSITIONS: Mapping[Phase, Mapping[Trigger, Phase]] = {
    Phase.OPEN: {
        Trigger.PARTIAL: Phase.LIVE,
        Trigger.FINAL: Phase.OPEN,
        Trigger.ANSWERED: Phase.OPEN,
        **_ENDING,
    },
    Phase.LIVE: {
        Trigger.PARTIAL: Phase.LIVE,
        Trigger.FINAL: Phase.OPEN,
        Trigger.ANSWERED: Phase.LIVE,
        **_ENDING,
    },
    Phase.CLOSING: {
        Trigger.ANSWERED: Phase.CLOSING,
        # Closing already: a second reason to close changes nothing.
        Trigger.OWNER_LEFT: Phase.CLOSING,
        Trigger.SHUTDOWN: Phase.CLOSING,
        Trigger.DRAINED: Phase.CLOSED,
        Trigger.ABORT: Phase.CLOSED,
    },
    Phase.CLOSED: {},
}
"""Every allowed move: phase -> trigger -> next phase. Anything else is a bug
(`LifecycleError`), never a silent no-op."""


class LifecycleError(RuntimeError):
    """A trigger the table does not allow in the stream's phase (a bug in the caller)."""


@dataclass(frozen=True)
class Owner:
    """Who may push to and close a stream: one per server connection, or none for an
    embedding caller (then any caller of that engine may). `max_streams`: how many streams
    it may hold open at once (`None`: only the engine's limit)."""

    name: str
    max_streams: int | None = None


# --- one stream ----------------------------------------------------------------------------


class StreamLifecycle:
    """One stream's phase, owner and admission record.

    `epoch`: which life of the id this is, a number never reused by the table, carried on
    every update so that viewers can tell a stream taken over by a new writer.
    """

    def __init__(
        self,
        stream_id: str,
        owner: Owner | None,
        epoch: int,
        answered_through: int | None = None,
    ) -> None:
        self.stream_id = stream_id
        self.owner = owner
        self.epoch = epoch
        self.phase = Phase.OPEN
        self.first_seq: int | None = None  # the seq of the event that opened this life
        self.last_seq: int | None = None
        self.segment_id: int | None = None
        self.segment_final = False  # the current segment has had its final
        self.finals_pending = 0
        # Why it began closing (close, owner left, shutdown), None while it takes events:
        # a stream its writer closed ends its history; one handed over does not.
        self.ending: Trigger | None = None
        # The highest seq an earlier life (whose writer left) answered, when the bus says
        # so: a final resent at or below it may be answered already. None once the
        # writer started over (`starts_over`): nothing earlier is judged against.
        self.answered_through = answered_through

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.stream_id!r} epoch={self.epoch} "
            f"{self.phase.value} finals_pending={self.finals_pending}>"
        )

    @property
    def taking_events(self) -> bool:
        return self.phase in (Phase.OPEN, Phase.LIVE)

    @property
    def closed(self) -> bool:
        """Released or aborted: nothing it does is published any more."""
        return self.phase is Phase.CLOSED

    @property
    def closed_by_owner(self) -> bool:
        """Its writer closed it (`close_stream`), rather than leaving or a shutdown."""
        return self.ending is Trigger.CLOSE

    @property
    def handed_over(self) -> bool:
        """Closing because its writer left or the engine stops: the writer may go on with
        the stream elsewhere (another connection, another server node)."""
        return self.ending in (Trigger.OWNER_LEFT, Trigger.SHUTDOWN)

    def fire(self, trigger: Trigger) -> Phase:
        """Move by the table; raise `LifecycleError` for a move it does not allow."""
        target = TRANSITIONS[self.phase].get(trigger)
        if target is None:
            raise LifecycleError(f"{self!r}: {trigger.value} is not allowed")
        if trigger is Trigger.DRAINED and self.finals_pending:
            raise LifecycleError(f"{self!r}: released with finals unanswered")
        if trigger is Trigger.FINAL:
            self.finals_pending += 1
        elif trigger is Trigger.ANSWERED:
            if not self.finals_pending:
                raise LifecycleError(f"{self!r}: answered a final it does not owe")
            self.finals_pending -= 1
        elif trigger is Trigger.ABORT:
            self.finals_pending = 0
        if target is Phase.CLOSING and self.ending is None:
            self.ending = trigger
        self.phase = target
        return target

    def refusal(self, event: PartialTranscript, max_pending_finals: int) -> ErrorMessage | None:
        """The error for an event this stream does not take now, or None (the text is
        checked by the table, once every other rule passed)."""

        def error(code: ErrorCode, message: str, field: str | None) -> ErrorMessage:
            return ErrorMessage(code, message, field, event.stream_id, event.seq)

        if not self.taking_events:
            return error(
                ErrorCode.UNKNOWN_STREAM,
                f"stream {event.stream_id!r} is closing: wait for its final update, "
                "or use another id",
                "stream_id",
            )
        if self.last_seq is not None and event.seq <= self.last_seq:
            return error(
                ErrorCode.OUT_OF_ORDER,
                f"seq {event.seq} is not above the last accepted seq {self.last_seq} (seq "
                "grows within a stream; close_stream and open it again to restart from 0)",
                "seq",
            )
        if self.segment_id is not None and (
            event.segment_id < self.segment_id
            or (event.segment_id == self.segment_id and self.segment_final)
        ):
            state = "already final" if event.segment_id == self.segment_id else "over"
            return error(
                ErrorCode.OUT_OF_ORDER, f"segment {event.segment_id} is {state}", "segment_id"
            )
        if event.is_final and self.finals_pending >= max_pending_finals:
            return error(
                ErrorCode.RATE_LIMITED,
                f"{self.finals_pending} finals are already waiting on this stream",
                None,
            )
        return None

    def resumes(self, event: PartialTranscript) -> bool:
        """Whether `event` may repeat what an earlier life of the stream (whose writer
        left without closing it) answered: its seq is at or below the highest one that
        life answered. Such a final is judged by the history (`resent_final`), and such
        an event may show that the writer started over (`starts_over`)."""
        through = self.answered_through
        return through is not None and event.seq <= through

    def starts_over(self, event: PartialTranscript, found: Collection[Resent]) -> bool:
        """Whether `event` (one that `resumes`) comes from a writer that started over,
        numbering from 0 again (a restarted process that lost its count), rather than
        from one that sends again the finals it had no reply for; `found`: what the
        history says of it in each language (nothing for a partial, which is never
        sent again). Such a writer opens this life at seq 0, and:

        - seq 0 starts over, unless it is the earlier life's seq-0 final sent again
          unchanged (some language found it `ANSWERED`), which is answered from the
          history;
        - after such a seq 0, the first event that the writer of the earlier life could
          not have sent again (a partial, or a final whose seq was answered with other
          words: `CONFLICT`) starts over: a restarted writer whose first final was the
          earlier one's words.

        A writer that sends again never does either (partials are not sent again, and a
        seq names one event), so its resends are still answered once. When it starts
        over, the stream no longer resumes the earlier life (`answered_through` None):
        every later seq of this life is new, and the caller marks the history there so
        that a later life, too, judges seqs only against this one's
        (`UpdateBus.start_over`)."""
        if not self.resumes(event) or self.first_seq != 0:
            return False
        if event.seq == 0:
            restart = Resent.ANSWERED not in found
        else:
            restart = not event.is_final or Resent.CONFLICT in found
        if restart:
            self.answered_through = None
        return restart

    def accept(self, event: PartialTranscript) -> None:
        """Record an admitted event and move by it."""
        if self.last_seq is None:
            self.first_seq = event.seq
        self.last_seq = event.seq
        if event.segment_id != self.segment_id:
            self.segment_id = event.segment_id
            self.segment_final = False
        if event.is_final:
            self.segment_final = True
        self.fire(Trigger.FINAL if event.is_final else Trigger.PARTIAL)


class HoldsLifecycle(Protocol):
    """A stream as the table keeps it: anything that holds a `StreamLifecycle`."""

    @property
    def life(self) -> StreamLifecycle: ...


S = TypeVar("S", bound=HoldsLifecycle)


class Verdict(Enum):
    """What the caller does with an event the table takes."""

    ACCEPT = "accept"  # the stream is open: record it (`accept`) and queue it
    OPEN = "open"  # the id is free: claim a life from the bus, then `open` the stream
    HANDOVER = "handover"  # the id's last life is closing, its writer gone: wait, then ask again


@dataclass(frozen=True)
class Decision(Generic[S]):
    """The table's answer to an event it does not refuse. `stream`: the stream holding
    the id (`ACCEPT`: the one to record the event in; `HANDOVER`: the one to wait for)."""

    verdict: Verdict
    stream: S | None = None


def too_large(event: PartialTranscript, exc: InputTooLongError) -> InvalidEvent:
    """The refusal of an event whose text a model cannot take: the last rule, checked by
    the caller (which tokenises) once every rule of the table passed."""
    return InvalidEvent(
        ErrorMessage(ErrorCode.TOO_LARGE, str(exc), "text", event.stream_id, event.seq)
    )


class StreamTable(Generic[S]):
    """Every open stream of an engine, by id: the one record of who owns what.

    The caller makes each stream around its `StreamLifecycle` (the controller's adds a
    queue and sessions) and hands it to `open`. A stream stays in the table from the
    event that opens it until `release`, closing included, so its id cannot be reopened
    behind the back of the finals it still owes.
    """

    def __init__(self, *, max_streams: int = 256, max_pending_finals: int = 32) -> None:
        if max_streams < 1 or max_pending_finals < 1:
            raise ValueError("max_streams and max_pending_finals must be >= 1")
        self.max_streams = max_streams
        self.max_pending_finals = max_pending_finals
        self.phase = EnginePhase.RUNNING
        self._streams: dict[str, S] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[S]:
        return iter(list(self._streams.values()))

    def get(self, stream_id: str) -> S | None:
        return self._streams.get(stream_id)

    @property
    def ids(self) -> list[str]:
        return list(self._streams)

    @property
    def accepting(self) -> bool:
        """Whether the engine takes events (not shut down)."""
        return self.phase is EnginePhase.RUNNING

    @property
    def closed(self) -> bool:
        """Drained or aborted: nothing more is published."""
        return self.phase is EnginePhase.CLOSED

    def owned_by(self, owner: Owner) -> list[S]:
        return [s for s in self._streams.values() if s.life.owner == owner]

    # -- decisions -----------------------------------------------------------------------

    def _stopped(self, stream_id: str, event: PartialTranscript | None) -> InvalidEvent | None:
        """The engine's shutdown refusal, decided here only: of `event`, or (None) of a
        request to close the stream."""
        if self.accepting:
            return None
        if event is not None:
            message = "shutting down: no new transcripts are taken"
            return InvalidEvent(
                ErrorMessage(ErrorCode.UNAVAILABLE, message, None, stream_id, event.seq)
            )
        message = "shutting down: every stream is closing"
        return InvalidEvent(ErrorMessage(ErrorCode.UNAVAILABLE, message, "stream_id", stream_id))

    def admit(
        self, event: PartialTranscript, owner: Owner | None, *, handover: bool = True
    ) -> Decision[S]:
        """Decide on `event` for its stream, or raise `InvalidEvent`; records nothing (an
        accepted event is recorded by `accept`, a new stream by `open`).

        The order of the rules is the order a client fixes them in: shutdown,
        ownership, the stream's phase and order, limits; the text is the caller's last
        check (`too_large`). `handover`: whether a writer may wait for the id's last
        life, closing because its writer left, to drain (`Verdict.HANDOVER`); asked
        again after that wait, it is refused as another's."""
        stopped = self._stopped(event.stream_id, event)
        if stopped is not None:
            raise stopped
        stream = self._streams.get(event.stream_id)
        if stream is None:
            self._check_room(event, owner)
            return Decision(Verdict.OPEN)
        if stream.life.owner != owner:
            if handover and stream.life.handed_over:
                return Decision(Verdict.HANDOVER, stream)
            raise InvalidEvent(_not_yours(event.stream_id, event.seq))
        error = stream.life.refusal(event, self.max_pending_finals)
        if error is not None:
            raise InvalidEvent(error)
        return Decision(Verdict.ACCEPT, stream)

    def held_by_another(self, stream_id: str, owner: Owner | None) -> ErrorMessage | None:
        """The refusal `admit` would give `owner`'s events for a stream another owner
        holds (and did not hand over), or None: asked before work that would only feed
        events to be refused (a recognizer for audio into that stream)."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.life.owner == owner or stream.life.handed_over:
            return None
        return _not_yours(stream_id, None)

    def _check_room(self, event: PartialTranscript, owner: Owner | None) -> None:
        """Refuse a new stream past the engine's or the owner's limit."""

        def refuse(message: str, field: str | None) -> InvalidEvent:
            return InvalidEvent(
                ErrorMessage(ErrorCode.LIMIT_EXCEEDED, message, field, event.stream_id, event.seq)
            )

        if len(self._streams) >= self.max_streams:
            raise refuse(f"too many open streams (limit {self.max_streams})", None)
        limit = owner.max_streams if owner is not None else None
        if owner is not None and limit is not None and len(self.owned_by(owner)) >= limit:
            raise refuse(
                f"too many open streams on this connection (limit {limit}); close one first",
                "stream_id",
            )

    def accept(self, stream: S, event: PartialTranscript) -> None:
        """Record an event `admit` accepted (`Verdict.ACCEPT`) for `stream`."""
        stream.life.accept(event)

    def open(self, stream: S, event: PartialTranscript) -> S:
        """Take a new stream (made around the life the bus handed out) with the event
        that opens it, once `admit` said `Verdict.OPEN`. The rules are checked again, as
        the claim was waited for: a refusal (`InvalidEvent`) opens nothing, and the
        caller lets its claim go."""
        stopped = self._stopped(event.stream_id, event)
        if stopped is not None:
            raise stopped
        if event.stream_id in self._streams:
            raise LifecycleError(f"{stream!r}: its id is open already")
        self._check_room(event, stream.life.owner)
        self._streams[event.stream_id] = stream
        stream.life.accept(event)
        return stream

    def close(self, stream_id: str, owner: Owner | None) -> S:
        """Begin closing a stream at its owner's request (or raise `InvalidEvent`); the
        caller finishes its accepted finals, then `release`s it."""

        def refuse(code: ErrorCode, message: str) -> InvalidEvent:
            return InvalidEvent(ErrorMessage(code, message, "stream_id", stream_id))

        stopped = self._stopped(stream_id, None)
        if stopped is not None:
            raise stopped
        stream = self._streams.get(stream_id)
        if stream is None:
            raise refuse(ErrorCode.UNKNOWN_STREAM, f"no open stream {stream_id!r}")
        if stream.life.owner != owner:
            raise InvalidEvent(_not_yours(stream_id, None))
        if not stream.life.taking_events:
            raise refuse(ErrorCode.UNKNOWN_STREAM, f"stream {stream_id!r} is already closing")
        stream.life.fire(Trigger.CLOSE)
        return stream

    def owner_left(self, owner: Owner) -> list[S]:
        """The owner is gone: each of its streams starts closing (viewers still get the
        finals it accepted). Returns those that began closing now. A stream closed
        already (aborted past a shutdown's deadline, its task not yet returned) has
        nothing left to close: it is skipped, never fired at."""
        started = []
        for stream in self.owned_by(owner):
            if stream.life.closed:
                continue
            was_taking = stream.life.taking_events
            stream.life.fire(Trigger.OWNER_LEFT)
            if was_taking:
                started.append(stream)
        return started

    def shutdown(self) -> list[S]:
        """Take nothing more; every stream starts closing. Returns every stream."""
        if self.phase is EnginePhase.RUNNING:
            self.phase = EnginePhase.DRAINING
        streams = list(self._streams.values())
        for stream in streams:
            stream.life.fire(Trigger.SHUTDOWN)
        return streams

    def finish_shutdown(self) -> None:
        """Every stream has drained: the engine is closed."""
        self.phase = EnginePhase.CLOSED

    def abort(self) -> list[tuple[S, int]]:
        """Past a shutdown deadline: every stream is closed on the spot, and the engine.
        Returns each stream with the number of finals it still owed, which the caller
        answers `unavailable`."""
        self.phase = EnginePhase.CLOSED
        owed = []
        for stream in self._streams.values():
            if stream.life.phase is not Phase.CLOSED:
                owed.append((stream, stream.life.finals_pending))
                stream.life.fire(Trigger.ABORT)
        return owed

    def release(self, stream: S) -> None:
        """A closing stream has nothing waiting or running: it is closed, its id free."""
        if stream.life.phase is not Phase.CLOSED:
            stream.life.fire(Trigger.DRAINED)
        if self._streams.get(stream.life.stream_id) is stream:
            del self._streams[stream.life.stream_id]


def _not_yours(stream_id: str, seq: int | None) -> ErrorMessage:
    """The refusal of a stream that another owner holds."""
    return ErrorMessage(
        ErrorCode.FORBIDDEN,
        f"stream {stream_id!r} belongs to another connection",
        "stream_id",
        stream_id,
        seq,
    )
