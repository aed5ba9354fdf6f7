"""Where a decode scheduler's wall time goes, step by step (off unless asked for).

Each lane records one `Step` per loop turn: how long it waited for work, how long it ran
encoder calls, and the three parts of a decoder step (`update`: searches read the last
logits, Python; `schedule`: rows leave and join, with the prefill call of those joining;
`execute`: the decoder call over every row), with the rows it carried. Under load this
says what keeps a core idle (waiting with requests queued elsewhere, Python between
calls) and what keeps rows apart (lanes splitting them, prefills and encodes run on
their own), which a profile of one stream alone cannot.

Each answered request is kept too (`Answered`: time queued, time in its lane, tokens it
decoded past its confirmed draft), which says which requests make the latency tail.

A `Timeline` is a bounded buffer shared by a scheduler's lanes; `summary` condenses it.
Recording costs two clock reads and a small object per step.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Step:
    """One turn of a lane's loop; times in seconds (`at`: `time.perf_counter()` when it
    began its work, after `waited`)."""

    lane: int
    at: float
    waited: float  # blocked on the scheduler's condition: no work for this lane
    encode: float  # encoder calls run on this turn (0 when none)
    encode_rows: int
    update: float
    schedule: float  # includes the prefill call of the joining rows
    execute: float  # the decoder call
    rows: int  # rows of the decoder call (0: no call)
    joined: int
    left: int
    waiting: int  # requests still queued after this turn's admission

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Answered:
    """One request a lane answered; times in seconds. `past_draft`: the tokens it decoded
    past its forced prefix and the draft its prefill confirmed, each a decoder step of its
    lane (or a lookahead slot), so the turns it waited for: under load the requests
    that need many are the latency tail, while most end in the turn that admits them."""

    lane: int
    partial: bool  # a partial's request (False: a final's, or an offline call)
    queued: float  # submitted -> taken by a lane
    compute: float  # taken -> answered: encoder, prefill and steps, with the lane's turns
    past_draft: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Timeline:
    """The last `limit` steps of every lane of one scheduler, and the last `limit`
    requests they answered."""

    def __init__(self, limit: int = 200_000) -> None:
        self._steps: deque[Step] = deque(maxlen=limit)
        self._answered: deque[Answered] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def add(self, step: Step) -> None:
        with self._lock:
            self._steps.append(step)

    def answer(self, request: Answered) -> None:
        with self._lock:
            self._answered.append(request)

    def steps(self) -> list[Step]:
        with self._lock:
            return list(self._steps)

    def answered(self) -> list[Answered]:
        with self._lock:
            return list(self._answered)

    def clear(self) -> None:
        with self._lock:
            self._steps.clear()
            self._answered.clear()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(steps: Iterable[Step], answered: Iterable[Answered] = ()) -> dict[str, Any]:
    """Per lane and overall: the share of wall time waiting, encoding, in update,
    schedule and execute; rows per decoder call (p50/p95/max); how often a lane waited
    while requests were queued (work it could have taken); steps per second. With the
    `answered` requests, partials' requests by tokens past their draft (`by_past_draft`)."""
    steps = list(steps)
    if not steps:
        return {"steps": 0}
    out: dict[str, Any] = {"steps": len(steps), "lanes": {}}
    out["partials_by_past_draft"] = by_past_draft(answered)
    for lane in sorted({s.lane for s in steps}):
        mine = [s for s in steps if s.lane == lane]
        parts = {
            "waited": sum(s.waited for s in mine),
            "encode": sum(s.encode for s in mine),
            "update": sum(s.update for s in mine),
            "schedule": sum(s.schedule for s in mine),
            "execute": sum(s.execute for s in mine),
        }
        total = sum(parts.values()) or 1.0
        calls = [s.rows for s in mine if s.rows]
        out["lanes"][lane] = {
            "wall_s": round(total, 3),
            **{f"{name}_share": round(value / total, 3) for name, value in parts.items()},
            "rows_p50": statistics.median(calls) if calls else 0,
            "rows_p95": _pct([float(c) for c in calls], 0.95),
            "rows_max": max(calls, default=0),
            "decoder_calls": len(calls),
            "prefills": sum(1 for s in mine if s.joined),
            "encodes": sum(1 for s in mine if s.encode_rows),
            "encode_rows_mean": round(
                statistics.fmean([s.encode_rows for s in mine if s.encode_rows] or [0]), 2
            ),
            "execute_ms_p50": round(_pct([s.execute * 1000 for s in mine if s.rows], 0.5), 2),
            "python_ms_p50": round(_pct([s.update * 1000 for s in mine if s.rows], 0.5), 2),
        }
    calls = [s.rows for s in steps if s.rows]
    out["rows_p50"] = statistics.median(calls) if calls else 0
    out["rows_p95"] = _pct([float(c) for c in calls], 0.95)
    return out


PAST_DRAFT_BANDS = ((0, 1), (2, 3), (4, 7), (8, 15), (16, None))
"""How `by_past_draft` groups requests: tokens decoded past prefix and draft (inclusive)."""


def by_past_draft(answered: Iterable[Answered], *, partial: bool = True) -> list[dict[str, Any]]:
    """Partials' requests (`partial`; else the others) grouped by the tokens they decoded
    past their confirmed draft (`PAST_DRAFT_BANDS`): how many, and their time queued
    (p50) and in a lane (p50 / p95), in ms. Under load the bands past a few tokens hold
    the latency tail: each such token waits for a turn of its lane, prefills included."""
    mine = [a for a in answered if a.partial == partial]
    out = []
    for low, high in PAST_DRAFT_BANDS:
        band = [a for a in mine if a.past_draft >= low and (high is None or a.past_draft <= high)]
        if not band:
            continue
        compute = [a.compute * 1000 for a in band]
        out.append(
            {
                "tokens": f"{low}-{high}" if high is not None else f"{low}+",
                "requests": len(band),
                "queued_ms_p50": round(_pct([a.queued * 1000 for a in band], 0.5), 1),
                "compute_ms_p50": round(_pct(compute, 0.5), 1),
                "compute_ms_p95": round(_pct(compute, 0.95), 1),
            }
        )
    return out


def format_summary(result: dict[str, Any]) -> str:
    """`summary` as a few lines for people."""
    if not result.get("steps"):
        return "timeline: no steps"
    lines = [
        f"timeline: {result['steps']} lane turns; rows per decoder call p50 "
        f"{result['rows_p50']}, p95 {result['rows_p95']:g}"
    ]
    for lane, s in result["lanes"].items():
        lines.append(
            f"  lane {lane}: {s['wall_s']:.1f} s: waiting {s['waited_share']:.0%}, encode "
            f"{s['encode_share']:.0%} ({s['encodes']} calls, {s['encode_rows_mean']} rows), "
            f"update {s['update_share']:.0%}, schedule+prefill {s['schedule_share']:.0%} "
            f"({s['prefills']} prefills), execute {s['execute_share']:.0%}; rows p50 "
            f"{s['rows_p50']} p95 {s['rows_p95']:g} max {s['rows_max']}; execute p50 "
            f"{s['execute_ms_p50']} ms, update p50 {s['python_ms_p50']} ms"
        )
    bands = result.get("partials_by_past_draft") or []
    if bands:
        lines.append("  partials' requests by tokens decoded past the draft (ms):")
        lines.extend(
            f"    {b['tokens']:>5}: {b['requests']:>5} requests, queued p50 "
            f"{b['queued_ms_p50']:g}, in a lane p50 {b['compute_ms_p50']:g} p95 "
            f"{b['compute_ms_p95']:g}"
            for b in bands
        )
    return "\n".join(lines)
