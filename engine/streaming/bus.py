"""The update bus: what the processes serving the same streams share, and nothing more.

The controller publishes every reply of a stream (its updates, and the errors that answer
its finals) to an `UpdateBus` and knows nothing about who reads them. The bus keeps each
(stream, language)'s history (what a late viewer starts from, what a reconnecting viewer
resumes from, where a writer's resent final is found answered) and each stream's lease and
`epoch`: with several server processes a stream's owner is decided there, so the bus is
the one that counts epochs. Who in this process gets which reply is one local fan-out,
`engine.streaming.fanout.Hub`, which every bus holds.

`InProcessBus` is the default and all that replay and the embedding API need;
`engine.streaming.redis_bus.RedisBus` is the same interface over one Redis shared by
several server nodes.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from engine.replies import Reply
from engine.streaming.fanout import Hub
from engine.streaming.history import (
    HISTORY,
    Entry,
    Position,
    answered_through,
    backlog_lines,
)
from engine.streaming.lifecycle import Owner
from engine.streaming.subscriptions import Subscription
from protocol import TranslationUpdate

HANDED_OVER = 1024
"""Histories of streams whose writer left without closing them, kept (oldest dropped
first) so that the writer, reconnecting, finds the finals already answered."""


@dataclass(frozen=True)
class Claim:
    """A stream life handed out by the bus (`UpdateBus.claim`): its `epoch`, and, when it
    goes on from a life whose writer left without closing it, the highest `seq` that life
    published a reply for (`answered_through`): a final the writer sends again at or below
    it may have been answered already, and is looked up in the history; one above it
    cannot have been."""

    epoch: int
    answered_through: int | None = None

    @property
    def resumed(self) -> bool:
        return self.answered_through is not None


class BusUnavailable(RuntimeError):
    """A shared bus cannot be reached (at start: the server exits with a clear error)."""


@runtime_checkable
class UpdateBus(Protocol):
    """The shared part of serving a stream: publishing, histories, leases and epochs.

    Apart from `start`, `aclose`, `claim` and `history`, nothing here waits: the
    controller calls it from its event loop between translations, so a networked bus
    buffers and sends from its own tasks.
    """

    @property
    def hub(self) -> Hub:
        """This process's fan-out, which the bus feeds."""
        ...

    @property
    def ready(self) -> bool:
        """Whether replies can be published now (a shared bus: its server is reachable)."""
        ...

    @property
    def shared(self) -> bool:
        """Whether other processes serve the same streams (a writer cut off here may go
        on through another one)."""
        ...

    @property
    def stats(self) -> Counter[str]:
        """What the bus did, by kind (for the metrics)."""
        ...

    @property
    def history_size(self) -> int:
        """Entries a (stream, language) history keeps at most: one that `history` gives
        this many of may have lost older ones."""
        ...

    async def start(self, languages: Sequence[str] = ()) -> None:
        """Connect (a shared bus); raises `BusUnavailable` when that fails. `languages`:
        what the engine translates into (an error about every language is recorded in
        each one's history)."""
        ...

    async def aclose(self) -> None:
        """Let go of what this process holds (leases, histories) and disconnect."""
        ...

    async def claim(self, stream_id: str) -> Claim:
        """This process opens `stream_id` for its writer: the new life's epoch, fenced
        so that an older life's late replies are refused. Raises `InvalidEvent`
        (`forbidden`) while another process's writer holds the stream, `unavailable`
        when the bus cannot be reached."""
        ...

    def release(self, stream_id: str) -> None:
        """A claim that opened no stream (the event was refused): let the stream go."""
        ...

    def publish(self, reply: Reply, owner: Owner | None, epoch: int | None = None) -> None:
        """Record `reply` (about `reply.stream_id`, in `reply.lang`; an error without a
        language is about every language) in the stream's history, an update then
        carrying its `cursor`, and hand it to the hub for `owner` and the viewers.
        `epoch`: the life it belongs to; a shared bus refuses a reply of a life that is
        no longer the stream's current one."""
        ...

    async def history(self, stream_id: str, lang: str) -> list[Entry]:
        """A (stream, language) history as kept, oldest first. Raises `InvalidEvent`
        (`unavailable`) when the bus cannot be reached."""
        ...

    def start_over(self, stream_id: str, epoch: int) -> None:
        """The writer of life `epoch` started over (numbering from 0 again: a restarted
        process): mark the stream's histories there (ahead of this life's replies),
        so that no seq is judged against what came before any more (a later handover
        resumes this life only) and a late viewer's backlog starts there. Viewers go
        on (the new `epoch` tells them)."""
        ...

    async def keep_glossaries(self, stream_id: str, epoch: int, texts: Mapping[str, str]) -> None:
        """Record the stream's own glossaries of life `epoch` (target language -> the
        glossary file's text, as its writer sent it; empty: none), replacing what was
        kept, beside its histories and for as long: a life that resumes the stream
        (`Claim.resumed`, on any process) applies them (`kept_glossaries`). Fenced like
        `publish`: ignored once another life holds the stream. Raises `InvalidEvent`
        (`unavailable`) when the bus cannot be reached."""
        ...

    async def kept_glossaries(self, stream_id: str) -> dict[str, str]:
        """What `keep_glossaries` recorded last for the stream (empty: none). Raises
        `InvalidEvent` (`unavailable`) when the bus cannot be reached."""
        ...

    def keep_terms(self, stream_id: str, epoch: int, counts: Mapping[str, tuple[int, int]]) -> None:
        """Record the stream's glossary term counts (target language -> matched, placed,
        over its finals), replacing what was kept, beside its histories and for as long,
        so that any process can answer for them (`kept_terms`); a closed stream's go with
        it. Does not wait: a shared bus sends them with the stream's next append (they
        change with a final, which is published right after). Fenced like `publish`."""
        ...

    async def kept_terms(self, stream_id: str) -> dict[str, tuple[int, int]]:
        """What `keep_terms` recorded last for the stream (empty: nothing, or the stream
        was closed). Raises `InvalidEvent` (`unavailable`) when the bus cannot be
        reached."""
        ...

    def watch(self, sub: Subscription, after: str | None = None) -> None:
        """Start a viewer the hub made (`Hub.viewer`): replay its history through the hub
        (after cursor `after`, or its backlog), then feed it live replies."""
        ...

    def end_stream(self, stream_id: str, closed: bool = True) -> None:
        """A stream's life in this process is over (its last reply is published).
        `closed`: its writer closed it, so its history ends and its viewers' subscriptions
        end (a new stream with the id starts empty). Otherwise its writer left or this
        process stops (a handover): the history stays for the writer's resends; a
        shared bus lets the stream go on from another process, and releases it."""
        ...


def subscribe(
    bus: UpdateBus,
    stream_id: str | None = None,
    *,
    owner: Owner | None = None,
    lang: str | None = None,
    after: str | None = None,
) -> Subscription:
    """A new subscription to one stream (all when None), or with `owner` to the replies
    of every stream that owner writes; `lang`: only that language (a base code the
    engine translates into; None: every one). A viewer's starts with the backlog, or
    with `after` (a cursor it had) with every reply after it; an owner's starts with
    nothing (a writer subscribes before it pushes)."""
    if owner is not None:
        return bus.hub.writer(owner, lang, stream_id)
    sub = bus.hub.viewer(stream_id, lang)
    bus.watch(sub, after)
    return sub


class _Cursors:
    """Cursors as Redis numbers its stream entries (`MS-N`, milliseconds then a count),
    so they keep growing across restarts of the process, and resuming with a cursor from
    an earlier run finds nothing newer rather than skipping the new run's replies."""

    def __init__(self) -> None:
        self._last: Position = (0, 0)

    def next(self) -> str:
        ms = int(time.time() * 1000)
        last_ms, n = self._last
        self._last = (ms, 0) if ms > last_ms else (last_ms, n + 1)
        return f"{self._last[0]}-{self._last[1]}"


class InProcessBus:
    """The `UpdateBus` of one process: histories in bounded deques, epochs a counter,
    replies handed to the hub at once."""

    def __init__(self, queue_size: int = 256, history: int = HISTORY) -> None:
        self.queue_size = queue_size
        self.history_size = history
        self._hub = Hub(queue_size)
        # stream -> language -> entries; open streams, then handed-over ones (LRU).
        self._history: dict[str, dict[str, deque[Entry]]] = {}
        self._handed_over: OrderedDict[str, None] = OrderedDict()
        self._cursors = _Cursors()
        self._epochs = 0
        self._stats: Counter[str] = Counter()
        self._glossaries: dict[str, dict[str, str]] = {}  # stream -> language -> text
        self._terms: dict[str, dict[str, tuple[int, int]]] = {}  # stream -> language -> counts

    @property
    def hub(self) -> Hub:
        return self._hub

    @property
    def ready(self) -> bool:
        return True

    @property
    def shared(self) -> bool:
        return False

    @property
    def stats(self) -> Counter[str]:
        return self._stats

    async def start(self, languages: Sequence[str] = ()) -> None:
        return None

    async def aclose(self) -> None:
        self._history.clear()
        self._handed_over.clear()
        self._glossaries.clear()
        self._terms.clear()

    async def claim(self, stream_id: str) -> Claim:
        self._epochs += 1
        through = None
        if self._handed_over.pop(stream_id, "absent") is None:  # it was handed over
            seqs = [answered_through(list(e)) for e in self._history.get(stream_id, {}).values()]
            through = max((s for s in seqs if s is not None), default=None)
        return Claim(self._epochs, through)

    def release(self, stream_id: str) -> None:
        return None

    async def history(self, stream_id: str, lang: str) -> list[Entry]:
        return list(self._history.get(stream_id, {}).get(lang, ()))

    def publish(self, reply: Reply, owner: Owner | None, epoch: int | None = None) -> None:
        cursor = self._cursors.next()
        if isinstance(reply, TranslationUpdate):
            reply = reply.with_cursor(cursor)
        by_lang = self._history.setdefault(reply.stream_id or "", {})
        langs = (reply.lang,) if reply.lang is not None else list(by_lang) or [""]
        for lang in langs:
            key = lang or ""
            entries = by_lang.get(key)
            if entries is None:  # made once per language, not per update
                entries = by_lang[key] = deque(maxlen=self.history_size)
            entries.append(Entry(cursor, reply, epoch))
        self._hub.publish(reply, owner, cursor)

    async def keep_glossaries(self, stream_id: str, epoch: int, texts: Mapping[str, str]) -> None:
        if texts:
            self._glossaries[stream_id] = dict(texts)
        else:
            self._glossaries.pop(stream_id, None)

    async def kept_glossaries(self, stream_id: str) -> dict[str, str]:
        return dict(self._glossaries.get(stream_id, {}))

    def keep_terms(self, stream_id: str, epoch: int, counts: Mapping[str, tuple[int, int]]) -> None:
        self._terms[stream_id] = dict(counts)

    async def kept_terms(self, stream_id: str) -> dict[str, tuple[int, int]]:
        return dict(self._terms.get(stream_id, {}))

    def start_over(self, stream_id: str, epoch: int) -> None:
        cursor = self._cursors.next()
        for entries in self._history.get(stream_id, {}).values():
            entries.append(Entry(cursor, None, epoch, started_over=True))

    def watch(self, sub: Subscription, after: str | None = None) -> None:
        if sub.stream_id is None:  # every stream: the backlog of each open one
            ids = [sid for sid in self._history if sid not in self._handed_over]
            after = None
        else:
            ids = [sub.stream_id]
        histories = [
            (lang, list(entries))
            for sid in ids
            for lang, entries in self._history.get(sid, {}).items()
            if sub.lang in (None, lang)
        ]
        self._hub.join(sub, histories, after)

    def backlog(self, stream_id: str | None, lang: str | None) -> list[TranslationUpdate]:
        """What a viewer joining now starts from: for each open stream (or the one) and
        language, its last few final updates, then its current segment's latest update."""
        if stream_id is None:
            ids = [sid for sid in self._history if sid not in self._handed_over]
        else:
            ids = [stream_id]
        return [
            update
            for sid in ids
            for language, entries in self._history.get(sid, {}).items()
            if lang in (None, language)
            for update in backlog_lines(list(entries))
        ]

    def end_stream(self, stream_id: str, closed: bool = True) -> None:
        if closed:
            self._history.pop(stream_id, None)
            self._handed_over.pop(stream_id, None)
            self._glossaries.pop(stream_id, None)
            self._terms.pop(stream_id, None)
        elif stream_id in self._history:
            self._handed_over[stream_id] = None
            self._handed_over.move_to_end(stream_id)
            while len(self._handed_over) > HANDED_OVER:
                oldest, _ = self._handed_over.popitem(last=False)
                self._history.pop(oldest, None)
                self._glossaries.pop(oldest, None)
                self._terms.pop(oldest, None)
        self._hub.end_stream(stream_id)
