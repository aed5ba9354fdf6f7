"""Several streams' transcript logs as one, in the order a server would receive them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def by_emit_time(lines: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Log lines in emit order; ties keep log order, so one stream's order is preserved."""
    return sorted(lines, key=lambda line: float(line["emit_ms"]))


class SharedStreamId(ValueError):
    """Two logs to merge hold the same stream id (`first` and `second`: 0-based)."""

    def __init__(self, stream_id: str, first: int, second: int) -> None:
        super().__init__(f"stream {stream_id!r} appears in logs {first + 1} and {second + 1}")
        self.stream_id = stream_id
        self.first = first
        self.second = second


def interleave_logs(*logs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Merge logs of different streams into one, by emit time.

    Refuses logs that share a stream id, since their ``seq`` values would collide.
    """
    seen: dict[str, int] = {}
    for i, log in enumerate(logs):
        for sid in {line["stream_id"] for line in log}:
            if sid in seen and seen[sid] != i:
                raise SharedStreamId(sid, seen[sid], i)
            seen[sid] = i
    return [dict(line) for line in by_emit_time([line for log in logs for line in log])]
