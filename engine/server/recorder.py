"""`serve --record DIR`: every stream's finals written to subtitle files as they arrive.

One file per stream life (`<stream id>.<epoch>.vtt`, the id percent-encoded so that any id
is a safe file name; `<stream id>.<epoch>.<lang>.vtt` per target language when the engine
translates into several), rewritten whole after every final through a temporary file and an
atomic rename: a crash loses at most the cue being written, never the file. Cues are laid
out by `engine.subtitles` and timed by the finals' audio span (`start_ms`/`end_ms`, which
updates carry when the recogniser sent them); without one, by when the segment's first
update and its final arrived, counted from the stream's first update. A stream life's
finals are kept only while it lives (its file is complete when it ends), so a server that
runs for weeks holds the finals of its open streams, not of every stream it ever saw.
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

SWEEP_EVERY = 256
"""Updates between two checks of every track for ended stream lives."""
GRACE_S = 60.0
"""Quiet time after which an ended stream life's track is dropped."""


@dataclass
class _Track:
    """What one stream life has said so far."""

    path: Path
    started: float  # monotonic time of its first update
    last_seen: float = 0.0  # monotonic time of its last update
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
    files = seen = 0
    async for update in engine.updates(None):
        if not isinstance(update, TranslationUpdate):
            continue  # an error in place of a final: nothing was said
        seen += 1
        now = time.monotonic()
        forget_ended(engine, tracks, update, seen % SWEEP_EVERY == 0, now)
        key = (update.stream_id, update.epoch, update.lang)
        track = tracks.get(key)
        if track is None:
            path = record_path(directory, update, kind, by_lang)
            track = tracks[key] = _Track(path, now)
        track.last_seen = now
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
        else:
            files += len(track.finals) == 1  # its first final made the file
    return files


def forget_ended(
    engine: IncrementalTranslator,
    tracks: dict[tuple[str, int | None, str | None], _Track],
    update: TranslationUpdate,
    sweep: bool,
    now: float,
) -> int:
    """Drop the tracks of stream lives that have ended (their files are complete); returns
    how many. The update's own stream: its earlier lives, at once (a life's updates all
    come before the next life's). With `sweep`, any life the engine no longer has that
    said nothing for `GRACE_S` (an update may still wait in the subscription queue)."""
    keys = [k for k in tracks if k[0] == update.stream_id and k[1] != update.epoch]
    if sweep:
        keys += [
            k
            for k, track in tracks.items()
            if k[0] != update.stream_id
            and engine.epoch_of(k[0]) != k[1]
            and now - track.last_seen > GRACE_S
        ]
    for key in keys:
        del tracks[key]
    return len(keys)
