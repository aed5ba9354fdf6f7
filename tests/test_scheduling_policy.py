"""The decode scheduler's policy on its own: fake requests and fake outcomes, no model
and no threads (the engine that runs its plans: tests/test_scheduler.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from engine.decoding.policy import (
    ABORTS_REMEMBERED,
    HOLD_CHANCE,
    PREFILL_PADDING,
    Answer,
    Plan,
    Priority,
    RequestId,
    SchedulingPolicy,
    new_request_id,
)
from engine.decoding.search import DecodingCancelled


@dataclass(eq=False)
class Job:
    claimed: bool = False


@dataclass(eq=False)
class Fake:
    """A request of `width` rows feeding `length` prefill positions per row."""

    name: str
    priority: Priority = Priority.FINAL
    request_id: RequestId | None = None
    width: int = 1
    length: int = 1
    nearly_done: bool = False
    encoding: Job | None = None
    submitted: float = 0.0

    @property
    def rows(self) -> int:
        return self.width

    @property
    def positions(self) -> int:
        return self.width * self.length

    def __repr__(self) -> str:
        return self.name


Policy = SchedulingPolicy[Fake, Job]


def policy(lanes: int = 1, *, max_rows: int = 32, **options: int | bool) -> Policy:
    return SchedulingPolicy(lanes, max_rows=max_rows, **options)  # type: ignore[arg-type]


def names(requests: list[Fake]) -> list[str]:
    return [r.name for r in requests]


def partial(name: str, request_id: RequestId | None = None, **kw: int | bool) -> Fake:
    return Fake(name, Priority.PARTIAL, request_id, **kw)  # type: ignore[arg-type]


def take_turn(p: Policy, lane: int) -> Plan[Fake, Job]:
    """A lane's turn as the engine runs it: the plan, then its prefill (`joined`)."""
    plan = p.schedule(lane)
    p.joined(lane)
    return plan


# -- priorities -----------------------------------------------------------------------


def test_finals_join_before_partials_and_arrival_orders_each_priority() -> None:
    p = policy()
    p.add([partial("p1"), partial("p2")])
    p.add([Fake("f1")])
    p.add([partial("p3")])
    p.add([Fake("f2")])
    assert names(take_turn(p, 0).joining) == ["f1", "f2", "p1", "p2", "p3"]


def test_a_final_queued_behind_partials_takes_the_only_room() -> None:
    """With room for two rows and one held by a running decode, the final queued after
    eight partials joins before every one of them."""
    p = policy(max_rows=2)
    p.add([Fake("blocker")])
    assert names(take_turn(p, 0).joining) == ["blocker"]
    p.add([partial(f"p{i}") for i in range(8)])
    p.add([Fake("final")])
    assert names(take_turn(p, 0).joining) == ["final"]
    assert p.waiting == 8
    p.update(0, ended=p.running(0))
    assert names(take_turn(p, 0).joining) == ["p0", "p1"]


# -- aborts: latest wins ----------------------------------------------------------------


def test_an_abort_answers_waiting_requests_at_once() -> None:
    p = policy()
    stale, other = new_request_id(), new_request_id()
    p.add([partial("a", stale), partial("b", stale)])
    p.add([partial("c", other)])
    answers = p.abort([stale])
    assert names([a.request for a in answers]) == ["a", "b"]
    assert all(isinstance(a.error, DecodingCancelled) for a in answers)
    assert p.waiting == 1 and p.counts["rows_cancelled"] == 2
    assert names(take_turn(p, 0).joining) == ["c"]


def test_an_aborted_running_request_leaves_at_its_lanes_next_turn() -> None:
    p = policy(2)
    stale = new_request_id()
    p.add([partial("stale", stale), Fake("kept")])
    first = take_turn(p, 0)
    assert names(first.joining) == ["kept", "stale"] and not first.leaving
    assert p.abort([stale]) == []  # running: not answered by the abort
    assert not take_turn(p, 1).leaving  # only its own lane takes it out
    turn = take_turn(p, 0)
    assert names(turn.leaving) == ["stale"] and names(p.running(0)) == ["kept"]
    assert p.counts["rows_cancelled"] == 1
    assert p.update(0, ended=turn.leaving) == []  # left already: not answered twice


def test_a_running_request_nearly_done_finishes_despite_an_abort() -> None:
    p = policy()
    stale = new_request_id()
    request = partial("done-soon", stale, nearly_done=True)
    p.add([request])
    take_turn(p, 0)
    p.abort([stale])
    assert not take_turn(p, 0).leaving
    assert p.counts["rows_finished_on_abort"] == 1
    assert p.update(0, ended=[request]) == [Answer(request)]


def test_an_id_aborted_before_its_request_arrives_refuses_it() -> None:
    p = policy()
    late = new_request_id()
    assert p.abort([late]) == []
    with pytest.raises(DecodingCancelled):
        p.add([partial("a", late), partial("b", late)])
    assert p.waiting == 0 and p.counts["rows_cancelled"] == 2
    p.add([partial("never aborted")])  # no id: never refused
    assert p.waiting == 1


def test_aborted_ids_are_remembered_up_to_a_bound() -> None:
    p = policy()
    first = new_request_id()
    p.abort([first])
    p.abort(new_request_id() for _ in range(ABORTS_REMEMBERED))
    p.add([partial("old id", first)])  # forgotten: accepted
    assert p.waiting == 1


def test_aborting_an_answered_request_changes_nothing() -> None:
    p = policy()
    rid = new_request_id()
    request = partial("a", rid)
    p.add([request])
    take_turn(p, 0)
    assert p.update(0, ended=[request]) == [Answer(request)]
    assert p.abort([rid]) == [] and not take_turn(p, 0).leaving
    assert p.counts["rows_cancelled"] == 0


# -- prefill budget and padding groups --------------------------------------------------


def test_a_prefill_takes_at_most_its_position_budget() -> None:
    """Each request feeds 7 positions: one fits a budget of 8, so each gets a turn of
    its own; one longer than the budget still joins alone."""
    p = policy(prefill_positions=8)
    p.add([Fake(f"r{i}", length=7) for i in range(3)])
    p.add([Fake("long", length=20)])
    turns = [names(take_turn(p, 0).joining) for _ in range(5)]
    assert turns == [["r0"], ["r1"], ["r2"], ["long"], []]


def test_a_prefill_takes_newcomers_of_about_its_length() -> None:
    """A newcomer that would add more than `PREFILL_PADDING` padding positions waits for
    a call of its own, even when one that came after it joins."""
    p = policy()
    assert 1 <= PREFILL_PADDING < 31 - 2
    p.add([Fake("short", length=2), Fake("long", length=31), Fake("close", length=3)])
    assert names(take_turn(p, 0).joining) == ["short", "close"]
    assert names(take_turn(p, 0).joining) == ["long"]


def test_padding_counts_every_row_it_pads() -> None:
    """Padding is per row: a newcomer longer by 9 positions pads two rows already chosen
    (18 > 16) and waits, while one longer by 8 (16) joins."""
    p = policy()
    p.add([Fake("a", length=1), Fake("b", length=1), Fake("far", length=10)])
    p.add([Fake("near", length=9)])
    assert names(take_turn(p, 0).joining) == ["a", "b", "near"]


# -- rows and lanes ---------------------------------------------------------------------


def test_a_lane_takes_no_more_rows_than_max_rows() -> None:
    p = policy(max_rows=4)
    p.add([Fake(f"r{i}") for i in range(6)])
    assert names(take_turn(p, 0).joining) == ["r0", "r1", "r2", "r3"]
    assert p.rows(0) == 4 and names(take_turn(p, 0).joining) == []
    p.update(0, ended=p.running(0)[:1])
    assert names(take_turn(p, 0).joining) == ["r4"]


def test_an_empty_lane_takes_a_request_wider_than_max_rows() -> None:
    p = policy(max_rows=2)
    p.add([Fake("beam", width=4), Fake("next")])
    assert names(take_turn(p, 0).joining) == ["beam"]
    assert names(take_turn(p, 0).joining) == []  # full


def test_a_lane_with_more_rows_leaves_the_waiting_to_the_other() -> None:
    p = policy(2)
    p.add([Fake("a"), Fake("b")])
    take_turn(p, 0)  # lane 0: two rows, lane 1: none
    p.add([Fake("c")])
    assert names(take_turn(p, 0).joining) == []
    assert names(take_turn(p, 1).joining) == ["c"]
    p.add([Fake("d")])
    assert names(take_turn(p, 0).joining) == ["d"]  # 2 rows against 1: even enough


def test_lockstep_joins_only_an_empty_lane() -> None:
    p = policy(lockstep=True)
    stale = new_request_id()
    p.add([partial("first", stale)])
    take_turn(p, 0)
    p.add([Fake("second")])
    assert names(take_turn(p, 0).joining) == []
    p.abort([stale])
    turn = take_turn(p, 0)  # the aborted row leaves first: the lane is empty again
    assert names(turn.leaving) == ["first"] and names(turn.joining) == ["second"]


# -- encoder jobs and outcomes ----------------------------------------------------------


def test_encoder_jobs_go_to_the_next_plan_and_a_shared_source_is_encoded_once() -> None:
    p = policy(2)
    queued, shared = Job(), Job()
    p.add_encode(queued)
    assert p.has_work(0) and p.has_work(1)
    p.add([Fake("a", encoding=shared)])
    first = take_turn(p, 0)
    assert first.encodes == [queued, shared] and shared.claimed
    p.add([Fake("b", encoding=shared)])  # the same submission's other row, other lane
    second = take_turn(p, 1)
    assert names(second.joining) == ["b"] and second.encodes == []


def test_update_answers_what_ended_and_what_failed() -> None:
    p = policy()
    ok, broken = Fake("ok", request_id=new_request_id()), Fake("broken")
    p.add([ok, broken])
    take_turn(p, 0)
    error = RuntimeError("encoder failed")
    answers = p.update(0, ended=[ok], failed=[(broken, error)])
    assert answers == [Answer(ok), Answer(broken, error)]
    assert p.running(0) == [] and not p.has_work(0)
    assert p.abort([ok.request_id]) == []  # answered: forgotten


def test_a_failed_lane_and_a_drain_answer_everything_with_the_error() -> None:
    p = policy(2)
    p.add([Fake("a"), Fake("b")])
    take_turn(p, 0)
    p.add([Fake("c")])
    p.add_encode(job := Job())
    error = RuntimeError("closed")
    assert [(a.request.name, a.error) for a in p.fail_lane(0, error)] == [
        ("a", error),
        ("b", error),
    ]
    waiting, encodes = p.drain(error)
    assert names([a.request for a in waiting]) == ["c"] and encodes == [job]
    assert not any(p.has_work(lane) for lane in range(2))


def test_rows_still_joining_do_not_count_until_their_prefill_ran() -> None:
    """A lane's newcomers count as its rows once its prefill ran, as its batch counts
    them: while it runs, the other lane judges the balance by what is stepping now and
    does not grow its batch past the prefilling lane's (bigger steps for its rows,
    while the newcomers are about to be spread anyway)."""
    p = policy(2)
    p.add([Fake("a"), Fake("b")])
    take_turn(p, 0)  # lane 0 steps a and b
    p.add([Fake("c"), Fake("d"), Fake("e")])
    assert names(p.schedule(1).joining) == ["c", "d", "e"]  # lane 1's prefill runs...
    assert p.rows(1) == 0
    p.add([Fake("f")])
    assert names(p.schedule(0).joining) == []  # ...so 2 rows against 0: left to lane 1
    p.joined(0)
    p.joined(1)
    assert (p.rows(0), p.rows(1)) == (2, 3)
    assert names(take_turn(p, 1).joining) == ["f"]  # 3 against 2: even enough


# -- the batch delay (`hold`) -----------------------------------------------------------

MS = 0.001


def arriving(p: Policy, gaps_ms: list[float], *, final_at: int = -1) -> list[Fake]:
    """Partials submitted one at a time, `gaps_ms` apart from the first at 0 (the one
    at index `final_at` a final); returns them."""
    requests: list[Fake] = []
    at = 0.0
    for i, gap in enumerate([0.0, *gaps_ms]):
        at += gap * MS
        priority = Priority.FINAL if i == final_at else Priority.PARTIAL
        request = Fake(f"r{i}", priority, length=4, submitted=at)
        p.add([request])
        requests.append(request)
    return requests


def test_an_idle_lane_holds_dense_partials_but_never_past_the_delay() -> None:
    """Partials a millisecond apart: another is likely soon, so the idle lane waits, from
    the oldest newcomer's arrival, no longer than the delay; past it, it goes at once."""
    p = SchedulingPolicy[Fake, Job](2, max_rows=32, batch_delay=10 * MS)
    arriving(p, [1.0, 1.0])  # at 0, 1 and 2 ms
    now = 2 * MS
    wait = p.hold(0, now)
    assert 0 < wait <= 10 * MS - now  # never past the oldest's arrival plus the delay
    # It stops when another arrival is no longer likely within what is left: at a mean gap
    # of one millisecond, that is the delay less the gap's share for `HOLD_CHANCE`.
    assert wait == pytest.approx(10 * MS - now + 1 * MS * math.log(1 - HOLD_CHANCE))
    assert p.hold(0, 9.5 * MS) == 0  # too little left for another to be likely
    assert p.hold(0, 11 * MS) == 0  # past the delay
    assert p.hold(1, now) == wait  # every idle lane alike
    assert names(take_turn(p, 0).joining) == ["r0", "r1", "r2"]  # all in one call


def test_a_lone_stream_or_a_silence_is_never_held() -> None:
    """A partial every 300 ms (one stream): the next is not expected within the delay.
    Dense arrivals followed by a silence: the time since the newest counts as a gap."""
    p = SchedulingPolicy[Fake, Job](1, max_rows=32, batch_delay=10 * MS)
    for i in range(5):
        at = i * 300 * MS
        p.add([Fake(f"r{i}", Priority.PARTIAL, submitted=at)])
        assert p.hold(0, at) == 0
        assert names(take_turn(p, 0).joining) == [f"r{i}"]
        assert len(p.update(0, p.running(0))) == 1  # answered in its prefill
    dense = SchedulingPolicy[Fake, Job](1, max_rows=32, batch_delay=10 * MS)
    arriving(dense, [1.0, 1.0])
    assert dense.hold(0, 2 * MS) > 0
    assert dense.hold(0, 8 * MS) == 0  # 6 ms of silence: another is unlikely now


def test_one_caller_waiting_on_each_answer_is_never_held() -> None:
    """Partials a millisecond apart, each submitted once the one before was answered (a
    fast replay): dense, but none found another in flight, so no one else would come
    during a wait. Two callers whose submissions overlap are held."""
    p = SchedulingPolicy[Fake, Job](1, max_rows=32, batch_delay=10 * MS)
    for i in range(10):
        p.add([Fake(f"r{i}", Priority.PARTIAL, submitted=i * MS)])
        assert p.hold(0, i * MS) == 0
        take_turn(p, 0)
        assert len(p.update(0, p.running(0))) == 1
    p.add([Fake("other", Priority.PARTIAL, submitted=10 * MS)])  # overlaps r10
    p.add([Fake("r10", Priority.PARTIAL, submitted=10 * MS)])
    assert p.hold(0, 10 * MS) > 0


def test_the_first_arrival_and_a_zero_delay_are_never_held() -> None:
    p = SchedulingPolicy[Fake, Job](1, max_rows=32, batch_delay=10 * MS)
    arriving(p, [])
    assert p.hold(0, 0.0) == 0  # no rate known yet
    off = SchedulingPolicy[Fake, Job](1, max_rows=32)
    arriving(off, [1.0, 1.0])
    assert off.hold(0, 2 * MS) == 0
    with pytest.raises(ValueError):
        SchedulingPolicy[Fake, Job](1, max_rows=32, batch_delay=-1.0)


def test_running_rows_finals_encoder_jobs_and_full_calls_are_never_held() -> None:
    """A lane with rows steps at once (its newcomers join it); a waiting final or encoder
    job goes at once, taking the partials with it; so does a call already full."""

    def dense(max_rows: int = 32, prefill_positions: int = 96) -> Policy:
        p = SchedulingPolicy[Fake, Job](
            2, max_rows=max_rows, prefill_positions=prefill_positions, batch_delay=10 * MS
        )
        arriving(p, [1.0, 1.0])
        return p

    p = dense()
    p.add([Fake("running", Priority.PARTIAL, submitted=0.0)])
    assert names(take_turn(p, 0).joining)[-1] == "running"
    arriving(p, [1.0])
    assert p.hold(0, 2 * MS) == 0  # lane 0 holds rows
    assert p.hold(1, 2 * MS) > 0  # lane 1 is idle
    final = SchedulingPolicy[Fake, Job](1, max_rows=32, batch_delay=10 * MS)
    arriving(final, [1.0, 1.0], final_at=1)
    assert final.hold(0, 2 * MS) == 0
    encodes = dense()
    encodes.add_encode(Job())
    assert encodes.hold(0, 2 * MS) == 0
    assert dense(max_rows=3).hold(0, 2 * MS) == 0  # three rows fill a lane of three
    assert dense(prefill_positions=12).hold(0, 2 * MS) == 0  # 3 x 4 positions: full
    assert dense(max_rows=4).hold(0, 2 * MS) > 0
