"""`serve --record DIR`: every stream's finals written to subtitle files as they arrive.

Names. One file per stream life (and target language when the engine translates into
several): `<stream>.<run>.<epoch>[.<lang>].vtt`. `<stream>` is the id percent-encoded
(a leading "." too), so that any id is a safe file name and none is hidden, cut to
`PREFIX_CHARS` and followed by `~` and a hash of the whole id when it is longer (a name
stays far below the 255 bytes file systems allow, whatever the id). `<run>` is when
recording started, with the server (UTC, to the second: `20261124T101503Z`): epochs start
at 1 in every run, so without it a restart would write over the last run's files.
A file is only ever created new (a name already taken, e.g. by a run that started in the
same second, gets `-2`, `-3`, ... after the run).

Writing. The event loop only turns updates into finals and queues them; one writer thread
lays them out and writes, so a slow or full disk never holds up translation. A file grows
a final at a time: a final's cues never change once the next final is known (only the
last cue's end waits for the next final's start, see `subtitles.final_cues`), so a write
rewrites that one final's cues in place and appends the new final's, in one `pwrite`: the
cost of a final does not grow with the finals before it. A file is created complete
(written under a temporary name, then linked to its own), and every later write changes
it from one valid file to the next: whenever the process dies (SIGKILL included) each
file is valid and holds the finals written so far (a SIGKILL in the microseconds while a
file is being created may leave its hidden `.NAME.PID.tmp` behind, never a partial file).
For finals in time order the file is byte for byte what
`subtitles.write(subtitles.layout(finals))` writes (unless their speech overlaps: see
Times).

Times. Cues are timed by the finals' audio span (`start_ms`/`end_ms`, which updates carry
when the recogniser sent them); without one, by when the segment's first update and its
final arrived, counted from the stream life's first update. A life whose first final
starts at 100 hours or later (a recogniser counting Unix-epoch milliseconds, or from its
own start days ago) is timed from that final, its first cue at 0: the file plays against
the life's own audio instead of putting every cue past 99:59:59 (later times past 99 h
are written with more hour digits, see `subtitles.timestamp`). A final that starts
before the previous final's last cue does (finals out of audio order, or overlapping
speech) starts with that cue: a file's cues never go back in time, and a file only grows.

Failures. A write that fails (a full disk, a directory removed) leaves the file as it was
and no temporary file behind; the failure is logged once per file (and once when writing
works again), not per final, and the finals it could not write are kept and tried again
with the next final (at most once per `RETRY_S`) and when the stream life ends. `serve`
checks the directory before it serves (`check_directory`).

Memory: a stream life's state is let go once it has ended (at once when its id opens
again, else in a sweep after `GRACE_S` quiet); the writer keeps one final per open
life (the last, whose cue may still change), plus those a failing disk could not take.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import logging
import os
import queue
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

import anyio

from engine import subtitles
from engine.streaming.controller import IncrementalTranslator
from protocol import TranslationUpdate

log = logging.getLogger(__name__)

SWEEP_EVERY = 256
"""Updates between two checks of every track for ended stream lives."""
GRACE_S = 60.0
"""Quiet time after which an ended stream life's track is dropped."""
PREFIX_CHARS = 96
"""Longest percent-encoded stream id kept whole in a file name; a longer one is cut there
and followed by `~` and `HASH_CHARS` hex digits of its hash."""
HASH_CHARS = 10
REBASE_FROM_MS = 100 * 3600 * 1000.0
"""A life whose first final starts this late is timed from that final (see Times)."""
RETRY_S = 1.0
"""Least time between two tries to write a failing file's finals."""
MAX_NAME_TRIES = 100
"""Names tried (`-2`, `-3`, ...) before a file is given up as impossible to create."""

Key: TypeAlias = tuple[str, int | None, str | None]
"""A stream life and language: (stream id, epoch, language)."""


class RecordDirectoryError(ValueError):
    """`--record DIR` names a directory that cannot be created or written."""


def check_directory(directory: Path) -> Path:
    """Create `directory` if it is missing and check that files can be created in it;
    raises `RecordDirectoryError` saying why not. `serve` calls it before it serves, so
    that a bad `--record` is an error at start (exit 2), not a crash once streams speak."""
    if directory.exists() and not directory.is_dir():
        raise RecordDirectoryError(f"--record {directory}: exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RecordDirectoryError(
            f"--record {directory}: cannot create the directory: {exc.strerror or exc}"
        ) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".record-check-", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise RecordDirectoryError(
            f"--record {directory}: cannot create files in it: {exc.strerror or exc}"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return directory


def file_stem(stream_id: str) -> str:
    """The stream id as the start of a file name: percent-encoded, and when that passes
    `PREFIX_CHARS`, a readable prefix, `~` and a short hash of the whole id. A leading
    "." is encoded too (`%2E`): a file named by the id is never hidden."""
    name = urllib.parse.quote(stream_id, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if len(name) <= PREFIX_CHARS:
        return name
    cut = name[:PREFIX_CHARS]
    escape = cut.find("%", PREFIX_CHARS - 2)  # never half of a %XX
    if escape >= 0:
        cut = cut[:escape]
    digest = hashlib.sha256(stream_id.encode("utf-8")).hexdigest()[:HASH_CHARS]
    return f"{cut}~{digest}"


def file_name(key: Key, run: str, kind: str, by_lang: bool = False, attempt: int = 1) -> str:
    """`<stream>.<run>[-<attempt>].<epoch>[.<lang>].<kind>` (see the module's Names)."""
    stream_id, epoch, lang = key
    tag = f".{urllib.parse.quote(lang, safe='')}" if by_lang and lang else ""
    again = f"-{attempt}" if attempt > 1 else ""
    return f"{file_stem(stream_id)}.{run}{again}.{epoch or 0}{tag}.{kind}"


def run_stamp(now: float | None = None) -> str:
    """The `<run>` part of file names: a UTC time to the second."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


@dataclass
class RecorderStats:
    """What the recorder did (read from the event loop; written by its thread)."""

    files: int = 0  # files created
    finals: int = 0  # finals written
    failures: int = 0  # files whose writing failed (each counted once per failing spell)
    lost: int = 0  # finals never written (their stream life ended while writes failed)


@dataclass
class _Track:
    """What the event loop keeps of one stream life: enough to time finals that carry no
    audio span."""

    started: float  # monotonic time of its first update
    last_seen: float = 0.0  # monotonic time of its last update
    segment_start: dict[int, float] = field(default_factory=dict)  # first update, ms


@dataclass
class _File:
    """What the writer thread knows of one stream life's file."""

    key: Key
    path: Path | None = None  # None until created
    size: int = 0  # bytes in the file
    committed: int = 0  # bytes that never change again (header, earlier finals' cues)
    numbered: int = 0  # cues in the committed bytes
    tail: subtitles.Final | None = None  # the last final written (its last cue may change)
    tail_bytes: bytes = b""
    floor: float = 0.0  # where the last cue starts: no later final starts before it
    origin: float | None = None  # subtracted from every time (see the module's Times)
    pending: list[subtitles.Final] = field(default_factory=list)  # not in the file yet
    failing: bool = False
    retry_at: float = 0.0


@dataclass(frozen=True)
class _Final:
    key: Key
    final: subtitles.Final


@dataclass(frozen=True)
class _End:
    key: Key


_Job: TypeAlias = _Final | _End | None  # None: the engine closed, finish and stop


class Recorder:
    """The files of one `record` run: `take` on the event loop, `write_all` in one thread.

    The two share nothing but a queue (and `stats`, counters the thread increments)."""

    def __init__(
        self,
        directory: Path,
        kind: str = "vtt",
        by_lang: bool = False,
        run: str | None = None,
        rules: subtitles.CueRules | None = None,
    ) -> None:
        if kind not in ("vtt", "srt"):
            raise ValueError(f"subtitle format must be vtt or srt, not {kind!r}")
        self.directory = directory
        self.kind = kind
        self.by_lang = by_lang
        self.run = run or run_stamp()
        self.rules = rules or subtitles.CueRules()
        self.stats = RecorderStats()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._tracks: dict[Key, _Track] = {}  # the event loop's
        self._files: dict[Key, _File] = {}  # the writer thread's
        self._seen = 0
        self._header = subtitles.header(kind).encode("utf-8")

    # -- the event loop's side: cheap, never touches the disk ------------------------

    def take(self, update: TranslationUpdate, engine: IncrementalTranslator) -> None:
        """Note one update; a final goes to the writer thread's queue."""
        self._seen += 1
        now = time.monotonic()
        for key in forget_ended(engine, self._tracks, update, self._seen % SWEEP_EVERY == 0, now):
            self._jobs.put(_End(key))
        key = (update.stream_id, update.epoch, update.lang)
        track = self._tracks.get(key)
        if track is None:
            track = self._tracks[key] = _Track(now)
        track.last_seen = now
        elapsed = (now - track.started) * 1000.0
        track.segment_start.setdefault(update.segment_id, elapsed)
        if not update.is_final:
            return
        first = track.segment_start.pop(update.segment_id, elapsed)
        start = update.start_ms if update.start_ms is not None else first
        end = update.end_ms if update.end_ms is not None else max(elapsed, start)
        self._jobs.put(_Final(key, subtitles.Final(start, end, update.stable_text)))

    def close(self) -> None:
        """No more updates: the thread writes what is queued, then `write_all` returns."""
        self._jobs.put(None)

    # -- the writer thread's side ----------------------------------------------------

    def write_all(self) -> None:
        """Write queued finals until `close` (run in one thread)."""
        while (job := self._jobs.get()) is not None:
            try:
                if isinstance(job, _End):
                    self._end(job.key)
                else:
                    self._add(job.key, job.final)
            except Exception:  # a bug here must not stop the translation either
                log.exception("recorder: cannot handle %s", job)
        for key in list(self._files):
            self._end(key)

    def _add(self, key: Key, final: subtitles.Final) -> None:
        if not final.text.strip():
            return  # no cue (as in subtitles.layout), and no bearing on the next cue
        file = self._files.get(key)
        if file is None:
            file = self._files[key] = _File(key)
        if file.origin is None:
            file.origin = final.start_ms if final.start_ms >= REBASE_FROM_MS else 0.0
            if file.origin:
                log.info(
                    "recording stream %r: its first final starts at %.0f ms (a clock such "
                    "as Unix time?): its cues are timed from that final",
                    key[0],
                    file.origin,
                )
        start = max(final.start_ms - file.origin, file.floor)
        end = max(final.end_ms - file.origin, start)
        final = subtitles.Final(start, end, final.text)
        file.floor = subtitles.final_cues(final, float("inf"), self.rules)[-1].start_ms
        file.pending.append(final)
        if not file.failing or time.monotonic() >= file.retry_at:
            self._flush(file)

    def _end(self, key: Key) -> None:
        file = self._files.pop(key, None)
        if file is None or not file.pending:
            return
        self._flush(file)  # one last try
        if file.pending:
            self.stats.lost += len(file.pending)
            log.error(
                "recording stream %r: %d final(s) could not be written to %s",
                key[0],
                len(file.pending),
                file.path or self.directory / file_name(key, self.run, self.kind, self.by_lang),
            )

    def _flush(self, file: _File) -> None:
        """Write `file`'s tail (again, with its final cue's end now known) and pending
        finals; on failure, leave the file as it was and keep them pending."""
        finals = ([file.tail] if file.tail is not None else []) + file.pending
        chunks: list[bytes] = []
        counts: list[int] = []
        number = file.numbered + 1
        for i, final in enumerate(finals):
            following = finals[i + 1].start_ms if i + 1 < len(finals) else float("inf")
            cues = subtitles.final_cues(final, following, self.rules)
            chunks.append(subtitles.render(cues, self.kind, number).encode("utf-8"))
            counts.append(len(cues))
            number += len(cues)
        data = b"".join(chunks)
        try:
            if file.path is None:
                file.path = self._create(file.key, self._header + data)
                file.committed = len(self._header)
                self.stats.files += 1
            else:
                _rewrite(file.path, data, file.committed, file.size, file.tail_bytes)
        except OSError as exc:
            file.retry_at = time.monotonic() + RETRY_S
            if not file.failing:
                file.failing = True
                self.stats.failures += 1
                where = file.path or self.directory / file_name(
                    file.key, self.run, self.kind, self.by_lang
                )
                log.error(
                    "recording stream %r: cannot write %s: %s (logged once; its finals "
                    "are kept and tried again)",
                    file.key[0],
                    where,
                    exc,
                )
            return
        if file.failing:
            file.failing = False
            log.warning("recording stream %r: writing %s again", file.key[0], file.path)
        file.committed += sum(len(chunk) for chunk in chunks[:-1])
        file.numbered += sum(counts[:-1])
        file.tail, file.tail_bytes = finals[-1], chunks[-1]
        file.size = file.committed + len(file.tail_bytes)
        self.stats.finals += len(file.pending)
        file.pending = []

    def _create(self, key: Key, data: bytes) -> Path:
        """A new file holding `data`, under the first free name: written under a
        temporary name first and linked to its own, so that the file never exists half
        written and no existing file is ever replaced."""
        paths = [
            self.directory / file_name(key, self.run, self.kind, self.by_lang, attempt)
            for attempt in range(1, MAX_NAME_TRIES + 1)
        ]
        tmp = paths[0].with_name(f".{paths[0].name}.{os.getpid()}.tmp")
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                _write_at(fd, data, 0)
            finally:
                os.close(fd)
            for i, path in enumerate(paths):
                try:
                    os.link(tmp, path)
                    return path
                except FileExistsError:
                    continue
                except OSError as exc:
                    if exc.errno not in _NO_HARD_LINKS:
                        raise
                    return _create_exclusive(paths[i:], data)
            raise FileExistsError(errno.EEXIST, "no free file name", str(paths[0]))
        finally:
            tmp.unlink(missing_ok=True)


# What `link` fails with on file systems without hard links (FAT, some network mounts).
_NO_HARD_LINKS = frozenset(
    {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}
)


def _create_exclusive(paths: list[Path], data: bytes) -> Path:
    """Without hard links: the first of `paths` that does not exist, created and written
    (removed again if the write fails)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        try:
            _write_at(fd, data, 0)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return path
    raise FileExistsError(errno.EEXIST, "no free file name", str(paths[0]))


def _write_at(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _rewrite(path: Path, data: bytes, offset: int, size: int, old: bytes) -> None:
    """Write `data` at `offset` (where `old`, the file's last `size - offset` bytes, are):
    one `pwrite` takes the file from one valid state to the next. If it fails part way
    (a full disk), `old` is put back and the file cut to `size` again."""
    fd = os.open(path, os.O_WRONLY)
    try:
        try:
            _write_at(fd, data, offset)
            if offset + len(data) < size:
                os.ftruncate(fd, offset + len(data))
        except OSError:
            try:  # the bytes being overwritten need no new space
                _write_at(fd, old, offset)
                os.ftruncate(fd, size)
            except OSError:
                log.exception("recorder: cannot restore %s after a failed write", path)
            raise
    finally:
        os.close(fd)


async def record(
    engine: IncrementalTranslator, directory: Path, kind: str = "vtt", run: str | None = None
) -> int:
    """Write every stream's finals under `directory` until the engine closes; returns how
    many files were created. Subscribes at once, so start it before the first push. The
    files are written by one thread; this returns once it has written every final."""
    updates = engine.updates(None)
    recorder = Recorder(directory, kind, by_lang=len(engine.languages) > 1, run=run)
    async with anyio.create_task_group() as tg:
        # Not abandoned on cancel: the thread finishes the queued finals first. Its own
        # limiter: it holds its thread for the engine's life, not one of the shared pool's.
        writer = functools.partial(
            anyio.to_thread.run_sync, recorder.write_all, limiter=anyio.CapacityLimiter(1)
        )
        tg.start_soon(writer)
        try:
            async for update in updates:
                if isinstance(update, TranslationUpdate):  # an error: nothing was said
                    recorder.take(update, engine)
        finally:
            recorder.close()
    return recorder.stats.files


def forget_ended(
    engine: IncrementalTranslator,
    tracks: dict[Key, _Track],
    update: TranslationUpdate,
    sweep: bool,
    now: float,
) -> list[Key]:
    """Drop the tracks of stream lives that have ended (their files are complete); returns
    their keys. The update's own stream: its earlier lives, at once (a life's updates all
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
    return keys
