"""Recogniser stability hints (``stable_chars``) added to a transcript log after the fact.

A recogniser that reports what it has settled lets the engine commit sooner; logs made
from text or recorded from recognisers that do not report it can be given the hints a
truthful recogniser would have sent, to measure what they are worth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.evaluation.units import unit_spans


def with_stability_hints(
    lines: Sequence[Mapping[str, Any]], *, lag: int = 0, lang: str | None = None
) -> list[dict[str, Any]]:
    """The log as a recogniser that reports what it settled would send it: each partial gets
    ``stable_chars``, the length of its longest unit prefix that no later message of its
    segment (the final included) changes, less its last ``lag`` units.

    Truthful by construction, so it is what a recogniser keeping its promise could say at
    best (``lag`` 0) or with a confirmation delay (e.g. whisper_streaming confirms a word
    when two consecutive hypotheses agree on it: ``lag`` 1-2). Finals get no hint (a final
    settles everything). Lines are returned in the same order, copied.
    """
    if lag < 0:
        raise ValueError(f"lag must be >= 0, got {lag}")
    out = [dict(line) for line in lines]
    # Per segment, walking backwards: what every later message shares, as the longest
    # common character prefix and the unit ends that are unit ends in each of them (so a
    # settled prefix is whole units there too: "draw" does not settle "drawer").
    later: dict[tuple[str, int], _Later] = {}
    for line in reversed(out):
        key = (line["stream_id"], line["segment_id"])
        text = line["text"]
        ends = [end for _, end in unit_spans(text, lang)]
        shared = later.get(key)
        if not line["is_final"]:
            if shared is None:  # nothing comes after it: all of it stands
                settled = len(ends)
            else:
                agree = _common_prefix_chars(text, shared.text)
                settled = 0
                for k, end in enumerate(ends):
                    if end > agree or end not in shared.ends:
                        break
                    settled = k + 1
            settled = max(settled - lag, 0)
            line["stable_chars"] = ends[settled - 1] if settled else 0
        if shared is None:
            later[key] = _Later(text, set(ends))
        else:
            shared.text = shared.text[: _common_prefix_chars(shared.text, text)]
            shared.ends &= set(ends)
    return out


@dataclass
class _Later:
    """What the later messages of a segment share (`with_stability_hints`)."""

    text: str  # their longest common prefix
    ends: set[int]  # character offsets that end a unit in every one of them


def _common_prefix_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
