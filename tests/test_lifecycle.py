"""The per-stream state machine (`engine.streaming.lifecycle`): no model, no network.

These are the rules the server, the controller and replay all go through; the server tests
check the same rules end to end over WebSocket. `admit` below carries out the table's
decisions as the controller does, with a counter standing in for the bus's epochs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pytest

from engine.errors import InputTooLongError
from engine.streaming.lifecycle import (
    TRANSITIONS,
    EnginePhase,
    LifecycleError,
    Owner,
    Phase,
    StreamLifecycle,
    StreamTable,
    Trigger,
    Verdict,
    too_large,
)
from protocol import InvalidEvent, PartialTranscript

A = Owner("connection 1", max_streams=2)
B = Owner("connection 2")


def prepare(event: PartialTranscript) -> tuple[str, dict[str, list[int]]]:
    if len(event.text) > 20:
        raise InputTooLongError(len(event.text), 20)
    source = " ".join(event.text.split())
    ids = [len(word) for word in source.split()]
    return source, {"xx": ids} if ids else {}


@dataclass(eq=False)
class Stream:
    """A stream with nothing but its lifecycle (the controller's adds a queue and sessions)."""

    life: StreamLifecycle


_EPOCHS: dict[int, Iterator[int]] = {}


def table(**kwargs: int) -> StreamTable[Stream]:
    t: StreamTable[Stream] = StreamTable(**kwargs)
    _EPOCHS[id(t)] = itertools.count(1)
    return t


@dataclass(frozen=True)
class Admitted:
    stream: Stream
    source: str
    source_ids: Mapping[str, list[int]]
    opened: bool


def admit(t: StreamTable[Stream], event: PartialTranscript, owner: Owner | None) -> Admitted:
    """The controller's steps: the table decides, the text is checked, then the event is
    recorded in its stream or opens one with a new life."""
    decision = t.admit(event, owner)
    try:
        source, ids = prepare(event)
    except InputTooLongError as exc:
        raise too_large(event, exc) from None
    if decision.verdict is Verdict.ACCEPT:
        assert decision.stream is not None
        t.accept(decision.stream, event)
        return Admitted(decision.stream, source, ids, False)
    assert decision.verdict is Verdict.OPEN
    life = StreamLifecycle(event.stream_id, owner, next(_EPOCHS[id(t)]))
    return Admitted(t.open(Stream(life), event), source, ids, True)


def ev(
    sid: str, seq: int, text: str = "I will", final: bool = False, seg: int = 0
) -> PartialTranscript:
    return PartialTranscript(sid, seg, seq, text, final)


def refused(t: StreamTable[Stream], event: PartialTranscript, owner: Owner | None) -> str:
    with pytest.raises(InvalidEvent) as info:
        admit(t, event, owner)
    assert info.value.error.seq == event.seq and info.value.error.stream_id == event.stream_id
    return str(info.value.error.code)


def test_the_table_is_complete_and_closed_is_final() -> None:
    assert set(TRANSITIONS) == set(Phase)
    assert TRANSITIONS[Phase.CLOSED] == {}
    for phase in (Phase.OPEN, Phase.LIVE, Phase.CLOSING):  # abort ends anything
        assert TRANSITIONS[phase][Trigger.ABORT] is Phase.CLOSED
    # Only a closing stream is released, and only by draining.
    assert [p for p, moves in TRANSITIONS.items() if Trigger.DRAINED in moves] == [Phase.CLOSING]


def test_segments_move_the_phase_and_finals_are_counted() -> None:
    t = table()
    adm = admit(t, ev("s", 0, "  I   will "), A)
    s = adm.stream.life
    assert adm.opened and (adm.source, adm.source_ids) == ("I will", {"xx": [1, 4]})
    assert s.phase is Phase.LIVE and s.owner == A and s.epoch == 1
    assert not admit(t, ev("s", 1, "I will go", final=True), A).opened
    assert (s.phase, s.finals_pending) == (Phase.OPEN, 1)
    admit(t, ev("s", 2, "we", seg=1), A)  # the next segment before the reply
    assert (s.phase, s.finals_pending) == (Phase.LIVE, 1)
    s.fire(Trigger.ANSWERED)
    assert (s.phase, s.finals_pending) == (Phase.LIVE, 0)
    with pytest.raises(LifecycleError):
        s.fire(Trigger.ANSWERED)  # no final is owed


def test_admission_rules() -> None:
    t = table(max_pending_finals=1)
    admit(t, ev("s", 5), A)
    assert refused(t, ev("s", 5), A) == "out_of_order"  # seq must grow
    assert refused(t, ev("s", 6), B) == "forbidden"  # not its stream
    assert refused(t, ev("s", 6, "x" * 30), A) == "too_large"
    admit(t, ev("s", 6, final=True), A)
    assert refused(t, ev("s", 7), A) == "out_of_order"  # segment 0 had its final
    assert refused(t, ev("s", 7, final=True, seg=1), A) == "rate_limited"  # one owed already
    admit(t, ev("s", 8, seg=1), A)  # a partial is still taken
    assert t.get("s") is not None and t.get("s").life.last_seq == 8  # type: ignore[union-attr]


def test_a_refused_event_opens_nothing_and_changes_nothing() -> None:
    t = table()
    assert refused(t, ev("s", 0, "x" * 30), A) == "too_large"
    assert t.ids == []
    admit(t, ev("s", 0), A)
    assert refused(t, ev("s", 1, "x" * 30), A) == "too_large"
    stream = t.get("s")
    assert stream is not None and stream.life.last_seq == 0  # the refused seq was not taken


def test_limits_per_owner_and_in_total() -> None:
    t = table(max_streams=3)
    admit(t, ev("a1", 0), A)
    admit(t, ev("a2", 0), A)
    assert refused(t, ev("a3", 0), A) == "limit_exceeded"  # A holds 2
    admit(t, ev("b1", 0), B)
    assert refused(t, ev("b2", 0), B) == "limit_exceeded"  # 3 in the engine
    stream = t.close("a1", A)
    assert refused(t, ev("a3", 0), A) == "limit_exceeded"  # a closing stream still counts
    t.release(stream)
    admit(t, ev("a3", 0), A)
    assert sorted(t.ids) == ["a2", "a3", "b1"]


def test_closing_refuses_events_and_frees_the_id_only_when_released() -> None:
    """Partials after a close are refused, so they cannot reopen the stream with no owner."""
    t = table()
    admit(t, ev("s", 0, "Tom", final=True), A)
    with pytest.raises(InvalidEvent) as info:
        t.close("s", B)
    assert info.value.error.code == "forbidden"
    stream = t.close("s", A)
    assert stream.life.phase is Phase.CLOSING
    assert refused(t, ev("s", 1, "Tom reads"), A) == "unknown_stream"
    assert refused(t, ev("s", 1, "Tom reads"), B) == "forbidden"
    with pytest.raises(InvalidEvent) as info:
        t.close("s", A)
    assert info.value.error.code == "unknown_stream"
    with pytest.raises(LifecycleError):
        t.release(stream)  # its final is not answered yet
    stream.life.fire(Trigger.ANSWERED)
    t.release(stream)
    assert stream.life.phase is Phase.CLOSED and t.ids == []
    again = admit(t, ev("s", 0, "Tom reads"), B)  # anyone may take the free id
    assert again.opened and again.stream.life.epoch == 2 and again.stream.life.owner == B


def test_owner_left_closes_only_its_streams() -> None:
    t = table()
    admit(t, ev("a", 0), A)
    admit(t, ev("b", 0), B)
    admit(t, ev("c", 0), None)  # an embedding caller's: no owner
    assert [s.life.stream_id for s in t.owner_left(A)] == ["a"]
    assert t.owner_left(A) == []  # already closing
    phases = {s.life.stream_id: s.life.phase for s in t}
    assert phases == {"a": Phase.CLOSING, "b": Phase.LIVE, "c": Phase.LIVE}
    assert refused(t, ev("c", 1), A) == "forbidden"  # an owned caller cannot write it
    admit(t, ev("c", 1), None)


def test_whether_another_owner_holds_a_stream_is_asked_as_admit_would_refuse() -> None:
    t = table()
    admit(t, ev("a", 0), A)
    assert t.held_by_another("a", A) is None and t.held_by_another("free", B) is None
    error = t.held_by_another("a", B)
    assert error is not None and (error.code, error.field) == ("forbidden", "stream_id")
    assert error.message == "stream 'a' belongs to another connection"
    t.owner_left(A)  # handed over: its next writer may wait for it
    assert t.held_by_another("a", B) is None


def test_shutdown_and_abort() -> None:
    t = table()
    admit(t, ev("a", 0, final=True), A)
    admit(t, ev("b", 0), B)
    assert {s.life.stream_id for s in t.shutdown()} == {"a", "b"}
    assert t.phase is EnginePhase.DRAINING and not t.accepting
    assert refused(t, ev("new", 0), A) == "unavailable"
    assert refused(t, ev("b", 1), B) == "unavailable"
    owed = {s.life.stream_id: n for s, n in t.abort()}
    assert owed == {"a": 1, "b": 0}  # the caller answers a's final `unavailable`
    assert all(s.life.phase is Phase.CLOSED for s in t) and t.closed
    for stream in t:
        t.release(stream)
    assert len(t) == 0


def test_a_writer_may_wait_for_a_handed_over_life_and_a_claim_is_checked_again() -> None:
    t = table()
    admit(t, ev("s", 0, final=True), A)
    t.owner_left(A)
    waiting = t.admit(ev("s", 1), B)  # A left: B may wait for its finals, then go on
    assert waiting.verdict is Verdict.HANDOVER and waiting.stream is t.get("s")
    with pytest.raises(InvalidEvent) as info:
        t.admit(ev("s", 1), B, handover=False)  # waited, and it is still closing
    assert info.value.error.code == "forbidden"
    assert t.admit(ev("n", 0), B).verdict is Verdict.OPEN
    t.shutdown()  # while the claim of "n" was awaited
    with pytest.raises(InvalidEvent) as info:
        t.open(Stream(StreamLifecycle("n", B, 7)), ev("n", 0))
    assert info.value.error.code == "unavailable" and t.get("n") is None
