"""The updates file a replay writes: one `translation_update` wire message a line, with its
times on the log's clock, so that reports can be recomputed from files without the model."""

from __future__ import annotations

import json
from dataclasses import dataclass

import protocol
from engine.logs.format import PathLike, TranscriptLogError
from protocol import TranslationUpdate


@dataclass(frozen=True)
class TimedUpdate:
    """An update with the emit-clock time of the partial it answers and of its delivery."""

    update: TranslationUpdate
    emit_ms: float
    done_ms: float

    @property
    def latency_ms(self) -> float:
        """Arrival of the partial at the engine -> update, as the engine measured it."""
        return self.update.latency_ms


TIME_KEYS = ("emit_ms", "done_ms")


def timed_update_line(timed: TimedUpdate) -> str:
    """One line of a replay's updates file: the `translation_update` wire message plus,
    like a transcript log line, its times on the log's clock (`emit_ms`: the partial it
    answers; `done_ms`: when it was delivered), so reports can be recomputed from files."""
    obj = json.loads(protocol.serialize(timed.update))
    obj.update(emit_ms=timed.emit_ms, done_ms=timed.done_ms)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def read_updates(path: PathLike) -> list[TimedUpdate]:
    """The updates file `timed_update_line` wrote."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            obj = json.loads(raw)
            times = [float(obj.pop(key)) for key in TIME_KEYS]
            update = protocol.parse(json.dumps(obj), accept={"translation_update"})
            if not isinstance(update, TranslationUpdate):
                raise TranscriptLogError(f"{path}:{number}: {getattr(update, 'message', '')}")
            out.append(TimedUpdate(update, *times))
    return out
