"""A (stream, language) history as both buses keep it: entries ordered by cursor, read by
a viewer that joins late or resumes, and by a writer's resent final. Pure functions over
entries, so the in-process bus and Redis answer each question the same way."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from engine.replies import RECENT_FINALS, Reply
from protocol import ErrorCode, ErrorMessage, PartialTranscript, TranslationUpdate

HISTORY = 512
"""Entries of a (stream, language) history kept for viewers that resume and writers that
resend: at a few updates per second, a couple of minutes of talk, far more than a
reconnect takes."""

Position: TypeAlias = tuple[int, int]


def position(cursor: str) -> Position:
    """A cursor (`MS-N`) as a pair that orders like the history."""
    ms, _, n = cursor.partition("-")
    return int(ms), int(n)


def by_cursor(update: TranslationUpdate) -> Position:
    """Sort key: an update's place in the history (updates without one first)."""
    return (0, 0) if update.cursor is None else position(update.cursor)


@dataclass(frozen=True)
class Entry:
    """One place in a (stream, language) history: a reply, or (`reply` None) a mark
    (`epoch`: the life that wrote it): that the stream's writer closed it there, or
    (`started_over`) that a writer started over there, numbering from 0 again (a
    restarted process): what came before is another life's, which its seqs are never
    judged against. Viewers go on past a restart mark (the new life's `epoch` tells
    them); a close mark ends them."""

    cursor: str
    reply: Reply | None
    epoch: int | None = None
    started_over: bool = False

    @property
    def at(self) -> Position:
        return position(self.cursor)


def current_life(entries: Sequence[Entry]) -> Sequence[Entry]:
    """The entries after the last mark: the stream's lives since its writer last closed
    it or started over (lives joined by handovers, whose finals a resending writer may
    find). A restart mark may come after replies of the life that started over (it is
    written when that life shows it, `StreamLifecycle.starts_over`): those are its own."""
    for i in range(len(entries) - 1, -1, -1):
        mark = entries[i]
        if mark.reply is None:
            if mark.started_over and mark.epoch is not None:
                own = [e for e in entries[:i] if e.epoch == mark.epoch and e.reply is not None]
                return [*own, *entries[i + 1 :]]
            return entries[i + 1 :]
    return entries


def answered_through(entries: Sequence[Entry]) -> int | None:
    """The highest seq with a reply in the current life of a history (None: none)."""
    seqs = [
        entry.reply.seq
        for entry in current_life(entries)
        if entry.reply is not None and entry.reply.seq is not None
    ]
    return max(seqs) if seqs else None


def backlog_lines(entries: Sequence[Entry]) -> list[TranslationUpdate]:
    """The recent finals, then the current segment's latest update, of a history (oldest
    first), as a late viewer is to see them."""
    finals: deque[TranslationUpdate] = deque(maxlen=RECENT_FINALS)
    last: TranslationUpdate | None = None
    for entry in current_life(entries):
        if isinstance(entry.reply, TranslationUpdate):
            last = entry.reply
            if last.is_final:
                finals.append(last)
    current = [last] if last is not None and not last.is_final else []
    return [*finals, *current]


class Resent(Enum):
    """What a history says of a final that a writer sends again after a handover (at or
    below the seq the earlier life answered up to). Whether the writer rather started
    over is the stream's lifecycle's decision (`StreamLifecycle.starts_over`), made
    from this."""

    # Each value is the engine counter (`IncrementalTranslator.stats`) it is counted in.
    ANSWERED = "answered_from_history"  # its update is here: the writer gets it again
    CONFLICT = "resent_refused"  # its seq was answered with other words: refused
    UNKNOWN = "resent_unshown"  # older than what is kept: shown maybe; the writer's only
    NEW = "resent_new"  # never answered: translated and shown like any final


def resent_final(
    entries: Sequence[Entry], segment_id: int, seq: int, source: str, trimmed: bool
) -> tuple[Resent, TranslationUpdate | None]:
    """Decide on a resent final from its history (`trimmed`: it may have lost older
    entries). Only the current life (`current_life`) is searched: the same seq with the
    same segment and words is the update to answer with (the newest wins); the same seq
    with anything else was another event, which a seq cannot name twice in a life. A seq
    older than all a trimmed history keeps cannot be placed: it may have been shown
    already."""
    life = current_life(entries)
    conflict = False
    for entry in reversed(life):
        reply = entry.reply
        if isinstance(reply, TranslationUpdate) and reply.seq == seq:
            if reply.is_final and reply.segment_id == segment_id and reply.source_text == source:
                return Resent.ANSWERED, reply
            conflict = True
    if conflict:
        return Resent.CONFLICT, None
    if trimmed and len(life) == len(entries):  # no close mark: where the life began is gone
        kept = [e.reply.seq for e in life if e.reply is not None and e.reply.seq is not None]
        if not kept or seq < min(kept):
            return Resent.UNKNOWN, None
    return Resent.NEW, None


def seq_reused(event: PartialTranscript, lang: str) -> ErrorMessage:
    """The answer to a resent final whose seq the stream answered with other words."""
    return ErrorMessage(
        ErrorCode.OUT_OF_ORDER,
        f"seq {event.seq} was answered before with other text: send a final again "
        "unchanged, number new events after it, or close the stream to start again from 0",
        "seq",
        event.stream_id,
        event.seq,
        lang,
    )


def resume_from(entries: Sequence[Entry], after: str) -> list[Entry] | None:
    """The entries after cursor `after` (`0-0`: all that is kept); None when the history
    cannot say (the cursor is older than what is kept, or newer than anything here: from
    another history)."""
    at = position(after)
    if at == (0, 0):  # "from the start": everything kept (a transcript view)
        return list(entries)
    if not entries or at > entries[-1].at:
        return None
    if at < entries[0].at:
        return None
    return [entry for entry in entries if entry.at > at]
