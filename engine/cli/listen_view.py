"""`listen`'s terminal view: `replay`'s live view of one stream being heard."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, TextIO

from engine.cli.replay import LiveView, _columns


class ListenView(LiveView):
    """`replay`'s live view for one stream being heard: the count line says how much
    audio was heard (of how much, for a file) instead of a log's events."""

    def __init__(self, out: TextIO, stream_id: str, duration_s: float | None, **kw: Any) -> None:
        super().__init__(out, segments=0, streams=[stream_id], log_span_ms=0.0, **kw)
        self.duration_s = duration_s
        self.heard_ms = 0.0

    @classmethod
    def on_terminal(
        cls,
        out: TextIO,
        stream_id: str,
        duration_s: float | None,
        env: Mapping[str, str] | None = None,
    ) -> ListenView:
        env = os.environ if env is None else env
        return cls(
            out,
            stream_id,
            duration_s,
            width=_columns(out, env),
            ansi=env.get("TERM", "") != "dumb",
            color="NO_COLOR" not in env,
        )

    def tick(self, heard_ms: float) -> None:
        """More audio was heard: redraw the count now and then."""
        self.heard_ms = heard_ms
        now = time.monotonic()
        if self.ansi and now - self._last_draw >= max(self.interval, 0.2):
            self._draw(now)

    def _count(self) -> str:
        heard = f"heard {self.heard_ms / 1000:.1f} s"
        if self.duration_s:
            heard += f" of {self.duration_s:.1f} s"
        return f"{heard} · {self.final_count} finals · {self.updates} updates"
