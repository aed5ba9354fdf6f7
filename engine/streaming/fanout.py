"""The one local fan-out of a process, under whichever bus it runs (after Centrifuge's
hub): the subscriptions of this process's writers and viewers, what each reply reaches,
and the history a joining viewer is replayed. A bus decides where replies and histories
come from (this process, or Redis); who gets them is decided here for both."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TypeVar

from engine.replies import Reply
from engine.streaming.history import Entry, backlog_lines, by_cursor, resume_from
from engine.streaming.lifecycle import Owner
from engine.streaming.subscriptions import Subscription

History = Sequence[tuple[str, Sequence[Entry]]]
"""Histories as a joining viewer is replayed them: (language, entries oldest first)."""


class Hub:
    """Writers' subscriptions by owner, viewers' by stream (None: every stream), and the
    viewers still being replayed their history (`joining`), which take nothing live yet
    so that nothing reaches them out of order."""

    def __init__(self, queue_size: int = 256) -> None:
        self.queue_size = queue_size
        self._writers: dict[Owner, list[Subscription]] = {}
        self._viewers: dict[str | None, list[Subscription]] = {}
        self._joining: list[Subscription] = []

    # -- subscribing ----------------------------------------------------------------------

    def writer(
        self, owner: Owner, lang: str | None = None, stream_id: str | None = None
    ) -> Subscription:
        """The replies of every stream `owner` writes, from now on (a writer subscribes
        before it pushes, so it needs no history)."""
        sub = Subscription(stream_id, self.queue_size, owner, lang)
        self._writers.setdefault(owner, []).append(sub)
        return sub

    def viewer(self, stream_id: str | None, lang: str | None = None) -> Subscription:
        """A viewer's subscription, joining: it takes replies once `join` replayed it
        its history."""
        sub = Subscription(stream_id, self.queue_size, None, lang)
        self._joining.append(sub)
        return sub

    def join(self, sub: Subscription, histories: History, after: str | None = None) -> bool:
        """Replay `histories` to a joining viewer, then deliver it live replies: what came
        after cursor `after`, or (no cursor, or one these histories cannot place) the
        backlog, each stream's last lines. A close mark among what it missed ends it there
        (a restart mark does not: the stream goes on, its new `epoch` says so).
        Returns whether `after` could not be placed (the viewer has a gap)."""
        if sub in self._joining:
            self._joining.remove(sub)
        if sub.ended:
            return False
        if after is not None and sub.stream_id is not None:
            missed: list[tuple[Entry, str]] = []
            placed = True
            for lang, entries in histories:
                found = resume_from(entries, after)
                if found is None:
                    placed = False
                    break
                missed.extend((entry, lang) for entry in found)
            if placed:
                missed.sort(key=lambda item: item[0].at)
                for entry, lang in missed:
                    if entry.started_over:  # the stream goes on, a new life
                        continue
                    if entry.reply is None:
                        sub.end_at(entry.cursor, lang)
                        return False
                    if sub.wants(entry.reply):
                        sub.put(entry.reply, entry.cursor, lang if sub.lang else None)
                self._viewers.setdefault(sub.stream_id, []).append(sub)
                return False
        lines = [update for _, entries in histories for update in backlog_lines(entries)]
        for update in sorted(lines, key=by_cursor):
            sub.put(update)
        self._viewers.setdefault(sub.stream_id, []).append(sub)
        return after is not None and bool(lines)

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop delivering to `sub` and end it."""
        if sub in self._joining:
            self._joining.remove(sub)
        elif sub.owner is not None:
            _remove(self._writers, sub.owner, sub)
        else:
            _remove(self._viewers, sub.stream_id, sub)
        sub.end()

    # -- delivering -----------------------------------------------------------------------

    def publish(
        self, reply: Reply, owner: Owner | None, cursor: str | None = None, viewers: bool = True
    ) -> None:
        """Hand `reply` to `owner`'s subscriptions and every-stream viewers, and (`viewers`)
        the stream's own viewers, each once, in the language it asked for."""
        subs = list(self._writers.get(owner, ())) if owner is not None else []
        if viewers:
            subs.extend(self._viewers.get(reply.stream_id, ()))
        subs.extend(self._viewers.get(None, ()))
        for sub in subs:
            if sub.wants(reply):
                sub.put(reply, cursor)

    def to_owner(self, reply: Reply, owner: Owner | None) -> None:
        """Hand `reply` to `owner`'s subscriptions only: a resent final answered from the
        history, or an error only its writer is to act on."""
        for sub in list(self._writers.get(owner, ())) if owner is not None else []:
            sub.put(reply)

    def deliver(self, stream_id: str, lane: str, entry: Entry) -> None:
        """A history entry of (`stream_id`, `lane`) read live, to the stream's viewers of
        that language; a close mark ends them there (a restart mark does not)."""
        if entry.started_over:
            return
        subs = [s for s in self._viewers.get(stream_id, ()) if s.lang in (None, lane)]
        for sub in subs:
            if entry.reply is None:
                sub.end_at(entry.cursor, lane)
                _remove(self._viewers, stream_id, sub)
            elif sub.wants(entry.reply):
                sub.put(entry.reply, entry.cursor, lane)

    # -- ending ---------------------------------------------------------------------------

    def end_stream(self, stream_id: str) -> None:
        """The stream's life is over: its viewers end (a new life has new viewers)."""
        for sub in self._viewers.pop(stream_id, []):
            sub.end()

    def end_all(self) -> None:
        """The engine stops: every subscription ends."""
        for sub in [*self._joining, *self.subscriptions()]:
            sub.end()
        self._joining.clear()
        self._viewers.clear()
        self._writers.clear()

    # -- reading the registry ---------------------------------------------------------------

    def subscriptions(self) -> list[Subscription]:
        return [s for subs in [*self._writers.values(), *self._viewers.values()] for s in subs]

    def watched(self) -> dict[str, set[str | None]]:
        """The streams with viewers here, each with the languages they asked for (None:
        every language): what a shared bus reads for this process."""
        return {
            sid: {sub.lang for sub in subs}
            for sid, subs in self._viewers.items()
            if sid is not None and subs
        }

    def viewers(self) -> dict[str, int]:
        """Viewer subscriptions per stream (for the metrics)."""
        counts: Counter[str] = Counter()
        for sid, subs in self._viewers.items():
            if sid is not None:
                counts[sid] += len(subs)
        return dict(counts)


K = TypeVar("K")


def _remove(table: dict[K, list[Subscription]], key: K, sub: Subscription) -> None:
    """Take `sub` out of `table[key]`, and the key out once its list is empty."""
    subs = table.get(key, [])
    if sub in subs:
        subs.remove(sub)
    if not subs:
        table.pop(key, None)
