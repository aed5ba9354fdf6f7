"""`serve --record DIR`: every stream's finals written to subtitle files as they arrive.

One file per stream life (`<stream id>.<epoch>.vtt`, the id percent-encoded so that any id
is a safe file name; `<stream id>.<epoch>.<lang>.vtt` per target language when the engine
translates into several), rewritten whole after every final through a temporary file and an
atomic rename: a crash loses at most the cue being written, never the file. Cues are laid
out by `engine.subtitles` and timed by the finals' audio span (`start_ms`/`end_ms`, which
updates carry when the recogniser sent them); without one, by when the segment's first
update and its final arrived, counted from the stream's first update.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from engine import subtitles
from engine.streaming.controller import IncrementalTranslator
from protocol import TranslationUpdate

log = logging.getLogger(__name__)


@dataclass
class _Track:
    """What one stream life has said so far."""

    path: Path
    started: float  # monotonic time of its first update
    finals: list[subtitles.Final] = field(default_factory=list)
    segment_start: dict[int, float] = field(default_factory=dict)  # first update, ms


def record_path(
    directory: Path, update: TranslationUpdate, kind: str, by_lang: bool = False
) -> Path:
    name = urllib.parse.quote(update.stream_id, safe="")
    lang = f".{update.lang}" if by_lang and update.lang else ""
    return directory / f"{name}.{update.epoch or 0}{lang}.{kind}"


def _write_atomically(path: Path, cues: list[subtitles.Cue], kind: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    subtitles.write(tmp, cues, kind)
    os.replace(tmp, path)


async def record(engine: IncrementalTranslator, directory: Path, kind: str = "vtt") -> int:
    """Write every stream's finals under `directory` until the engine closes; returns how
    many files were written. Subscribes at once, so start it before the first push."""
    directory.mkdir(parents=True, exist_ok=True)
    by_lang = len(engine.languages) > 1
    tracks: dict[tuple[str, int | None, str | None], _Track] = {}
    async for update in engine.updates(None):
        if not isinstance(update, TranslationUpdate):
            continue  # an error in place of a final: nothing was said
        key = (update.stream_id, update.epoch, update.lang)
        now = time.monotonic()
        track = tracks.get(key)
        if track is None:
            path = record_path(directory, update, kind, by_lang)
            track = tracks[key] = _Track(path, now)
        elapsed = (now - track.started) * 1000.0
        track.segment_start.setdefault(update.segment_id, elapsed)
        if not update.is_final:
            continue
        first = track.segment_start.pop(update.segment_id, elapsed)
        start = update.start_ms if update.start_ms is not None else first
        end = update.end_ms if update.end_ms is not None else max(elapsed, start)
        track.finals.append(subtitles.Final(start, end, update.stable_text))
        try:
            _write_atomically(track.path, subtitles.layout(track.finals), kind)
        except OSError as exc:  # a full disk must not stop the translation
            log.error("cannot write %s: %s", track.path, exc)
    return len(tracks)
