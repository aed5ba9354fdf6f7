"""Where a stream's replies go: subscriptions, and the bus that fans replies out to them.

The controller publishes every reply of a stream (its updates, and the errors that answer
its finals) to an `UpdateBus` and knows nothing about who reads them. The bus hands each
reply to the stream's owner (the writer), to the stream's viewers and to viewers of every
stream, each in the language it asked for, and keeps each (stream, language)'s recent
history: what a viewer joining late starts from, what a viewer that reconnects resumes
from (`after`, a `cursor`), and where a final resent by a writer after a lost connection
is found already answered. The bus also hands out each stream life's `epoch` (`claim`):
with several server processes the stream's owner is decided there, not in one process.

`InProcessBus` is the default and all that replay and the embedding API need;
`engine.streaming.redis_bus.RedisBus` is the same interface over one Redis shared by
several server nodes.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, TypeAlias, TypeVar, runtime_checkable

import anyio

from engine.languages import match_lang
from engine.streaming.lifecycle import Owner
from protocol import ErrorCode, ErrorMessage, InvalidEvent, TranslationUpdate

Reply: TypeAlias = TranslationUpdate | ErrorMessage
"""What a subscription yields: updates, and an `error` (code `internal`) in place of the
final update of a final transcript whose translation failed."""

RECENT_FINALS = 8
"""Final updates of a stream kept per language for viewers who join late (the page shows
a few lines)."""

HISTORY = 512
"""Entries of a (stream, language) history kept for viewers that resume and writers that
resend: at a few updates per second, a couple of minutes of talk, far more than a
reconnect takes."""

HANDED_OVER = 1024
"""Histories of streams whose writer left without closing them, kept (oldest dropped
first) so that the writer, reconnecting, finds the finals already answered."""

Position: TypeAlias = tuple[int, int]


def position(cursor: str) -> Position:
    """A cursor (`MS-N`) as a pair that orders like the history."""
    ms, _, n = cursor.partition("-")
    return int(ms), int(n)


def by_cursor(update: TranslationUpdate) -> Position:
    """Sort key: an update's place in the history (updates without one first)."""
    return (0, 0) if update.cursor is None else position(update.cursor)


def target_language(tag: str, languages: Sequence[str], stream_id: str | None = None) -> str:
    """The language of `languages` (base codes, as models are keyed) that a viewer's tag
    names ("zh-Hans" -> "zh"). Raises `InvalidEvent` (`invalid_message`, field `lang`,
    about `stream_id`) for one nothing here translates into: the server's `subscribe` and
    the engine's `updates` refuse with the same words."""
    lang = match_lang(tag, languages)
    if lang is None:
        raise InvalidEvent(
            ErrorMessage(
                ErrorCode.INVALID_MESSAGE,
                f"no translation into {tag[:40]!r} here; languages: " + ", ".join(languages),
                "lang",
                stream_id,
            )
        )
    return lang


class ReplyQueue(AsyncIterator[Reply]):
    """A bounded queue of replies for one consumer, iterated with `async for`.

    When it is full, the oldest non-final update is dropped (a newer one supersedes it);
    finals and errors (which answer finals) are never dropped, so a slow consumer cannot
    stall translation for others and every final transcript still gets its reply. The
    engine's subscriptions and a remote client's (`engine.remote`) are both one.
    """

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self.dropped = 0
        self._items: deque[Reply] = deque()
        self._ready = anyio.Event()
        self._ended = False

    def put(self, reply: Reply) -> None:
        """Queue `reply` (nothing once ended)."""
        if self._ended:
            return
        if len(self._items) >= self.max_items:
            for i, old in enumerate(self._items):
                if isinstance(old, TranslationUpdate) and not old.is_final:
                    del self._items[i]
                    self.dropped += 1
                    break
        self._items.append(reply)
        self._ready.set()

    def end(self) -> None:
        """Take nothing more: iteration yields what is queued, then stops."""
        self._ended = True
        self._ready.set()

    @property
    def ended(self) -> bool:
        return self._ended

    def __len__(self) -> int:
        return len(self._items)

    def __aiter__(self) -> ReplyQueue:
        return self

    async def __anext__(self) -> Reply:
        while not self._items:
            if self._ended:
                raise StopAsyncIteration
            self._ready = anyio.Event()
            await self._ready.wait()
        return self._items.popleft()


class Subscription(ReplyQueue):
    """A `ReplyQueue` of one stream's replies (or every stream's, or one writer's), in one
    language or all, that skips a reply it had already by its cursor."""

    def __init__(
        self,
        stream_id: str | None,
        max_items: int,
        owner: Owner | None = None,
        lang: str | None = None,
    ) -> None:
        super().__init__(max_items)
        self.stream_id = stream_id  # None: every stream
        self.owner = owner  # set: the replies of every stream this owner writes
        self.lang = lang  # None: every language
        # The cursor of the last reply taken, per language: a reply at or before it is
        # one this subscription has had already (a history read and a live read overlap).
        self.positions: dict[str | None, Position] = {}

    def wants(self, reply: Reply) -> bool:
        """Whether `reply` is for this subscription's language (an error that names no
        language answers every language, so every subscription takes it)."""
        return self.lang is None or reply.lang is None or reply.lang == self.lang

    def put(self, reply: Reply, cursor: str | None = None, lane: str | None = None) -> None:
        """Queue `reply`; `cursor`: its place in its history (default: the update's own),
        by which a reply this subscription had already is skipped; `lane`: the language
        of that history (default: the reply's), each with its own order."""
        if self._ended:
            return
        if cursor is None and isinstance(reply, TranslationUpdate):
            cursor = reply.cursor
        # A writer's subscription is fed once per reply, in the order replies are made
        # (a resent final answered from the history comes late, with its old cursor).
        if cursor is not None and self.owner is None:
            key = lane if lane is not None else reply.lang
            at = position(cursor)
            last = self.positions.get(key)
            if last is not None and at <= last:
                return
            self.positions[key] = at
        super().put(reply)

    def end_at(self, cursor: str, lane: str | None = None) -> None:
        """End at a close mark of its history (`cursor`): a follow-up subscription
        resuming from `cursor` starts after it, with the stream's next life."""
        self.positions[lane if lane is not None else self.lang] = position(cursor)
        self.end()

    def close(self) -> None:
        """Deprecated: `end` (the old name goes in the next release)."""
        warnings.warn(
            "Subscription.close() is now Subscription.end(); the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        self.end()

    @property
    def cursor(self) -> str | None:
        """The cursor of the last reply it took, where a follow-up subscription resumes
        (None: none taken, or several languages', which no one cursor places)."""
        if len(self.positions) != 1:
            return None
        ms, n = next(iter(self.positions.values()))
        return f"{ms}-{n}"


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


def answered_through(entries: Sequence[Entry]) -> int | None:
    """The highest seq with a reply in the current life of a history (None: none)."""
    seqs = [
        entry.reply.seq
        for entry in current_life(entries)
        if entry.reply is not None and entry.reply.seq is not None
    ]
    return max(seqs) if seqs else None


@runtime_checkable
class UpdateBus(Protocol):
    """What the controller publishes to and its readers subscribe through.

    Replies are keyed by (stream, language); a stream's owner is the writer that gets its
    replies. Apart from `start`, `aclose`, `claim` and `answered`, none of the methods
    waits: the controller calls them from its event loop between translations, so a
    networked bus buffers and sends from its own tasks.
    """

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

    async def start(self, languages: Sequence[str] = ()) -> None:
        """Connect (a shared bus); raises `BusUnavailable` when that fails. `languages`:
        what the engine translates into (an error about every language is recorded in
        each one's history)."""
        ...

    async def aclose(self) -> None:
        """Let go of what this process holds (leases) and disconnect."""
        ...

    async def claim(self, stream_id: str) -> Claim:
        """This process opens `stream_id` for its writer: the new life's epoch, fenced
        so that an older life's late replies are refused. Raises `InvalidEvent`
        (`forbidden`) while another process's writer holds the stream, `unavailable`
        when the bus cannot be reached."""
        ...

    async def answered(
        self, stream_id: str, segment_id: int, seq: int, source: str, languages: Sequence[str]
    ) -> dict[str, TranslationUpdate]:
        """The final updates, by language, already published for the final transcript
        (`segment_id`, `seq`, normalised `source`) in the stream's current history: a
        writer that lost its connection sends its unanswered finals again, and one that
        was translated before is answered from here rather than twice."""
        ...

    def publish(self, reply: Reply, owner: Owner | None, epoch: int | None = None) -> None:
        """Hand `reply` (about `reply.stream_id`, in `reply.lang`; an error without a
        language answers every language) to `owner`'s subscriptions, the stream's and
        every-stream ones that want it, and record it in the stream's history (an update
        then carries its `cursor`). `epoch`: the life it belongs to; a shared bus refuses
        a reply of a life that is no longer the stream's current one."""
        ...

    def to_owner(self, reply: Reply, owner: Owner | None) -> None:
        """Hand `reply` to `owner`'s subscriptions only: a resent final answered from the
        history (its viewers had it when it was published)."""
        ...

    def release(self, stream_id: str) -> None:
        """A claim that opened no stream (the event was refused): let the stream go."""
        ...

    def subscribe(
        self,
        stream_id: str | None = None,
        *,
        owner: Owner | None = None,
        lang: str | None = None,
        after: str | None = None,
    ) -> Subscription:
        """A new subscription to one stream (all when None), or with `owner` to the
        replies of every stream that owner writes; `lang`: only that language (a base
        code the engine translates into; None: every one). A viewer's starts with the
        `backlog`, or with `after` (a cursor it had) with every reply after it; an
        owner's starts with nothing (a writer subscribes before it pushes)."""
        ...

    def backlog(self, stream_id: str | None, lang: str | None) -> list[TranslationUpdate]:
        """What a viewer joining now starts from: for each open stream (or the one) and
        language, its last few final updates, then its current segment's latest update."""
        ...

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop delivering to `sub` and end it."""
        ...

    def end_stream(self, stream_id: str, closed: bool = True) -> None:
        """A stream's life in this process is over (its last reply is published).
        `closed`: its writer closed it, so its history ends and its viewers' subscriptions
        end (a new stream with the id starts empty). Otherwise its writer left or this
        process stops (a handover): the history stays for the writer's resends; a
        shared bus lets the stream go on from another process, and releases it."""
        ...

    def end_all(self) -> None:
        """The engine stops: every subscription ends."""
        ...


class BusUnavailable(RuntimeError):
    """A shared bus cannot be reached (at start: the server exits with a clear error)."""


@dataclass(frozen=True)
class Entry:
    """One place in a (stream, language) history: a reply, or (`reply` None) the mark
    that the stream's writer closed it there (`epoch`: the life that wrote it)."""

    cursor: str
    reply: Reply | None
    epoch: int | None = None

    @property
    def at(self) -> Position:
        return position(self.cursor)


def current_life(entries: Sequence[Entry]) -> Sequence[Entry]:
    """The entries after the last close mark: the stream's lives since its writer last
    closed it (lives joined by handovers, whose finals a resending writer may find)."""
    for i in range(len(entries) - 1, -1, -1):
        if entries[i].reply is None:
            return entries[i + 1 :]
    return entries


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


def find_final(
    entries: Sequence[Entry], segment_id: int, seq: int, source: str
) -> TranslationUpdate | None:
    """The final update of (`segment_id`, `seq`) with this source text, if the history's
    current life (`current_life`) published one; the newest wins. The text is compared
    too: a writer that restarted without closing its stream numbers from 0 again, and
    only the same words may be answered with the same translation."""
    for entry in reversed(current_life(entries)):
        reply = entry.reply
        if (
            isinstance(reply, TranslationUpdate)
            and reply.is_final
            and reply.seq == seq
            and reply.segment_id == segment_id
            and reply.source_text == source
        ):
            return reply
    return None


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
    """The `UpdateBus` of one process: subscriptions in dictionaries, replies handed to
    them at once, histories in bounded deques."""

    def __init__(self, queue_size: int = 256) -> None:
        self.queue_size = queue_size
        self._viewers: dict[str | None, list[Subscription]] = {}  # None: every stream
        self._writers: dict[Owner, list[Subscription]] = {}
        # stream -> language -> entries; open streams, then handed-over ones (LRU).
        self._history: dict[str, dict[str, deque[Entry]]] = {}
        self._handed_over: OrderedDict[str, None] = OrderedDict()
        self._cursors = _Cursors()
        self._epochs = 0
        self._stats: Counter[str] = Counter()

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
        return None

    async def claim(self, stream_id: str) -> Claim:
        self._epochs += 1
        through = None
        if self._handed_over.pop(stream_id, "absent") is None:  # it was handed over
            seqs = [answered_through(list(e)) for e in self._history.get(stream_id, {}).values()]
            through = max((s for s in seqs if s is not None), default=None)
        return Claim(self._epochs, through)

    async def answered(
        self, stream_id: str, segment_id: int, seq: int, source: str, languages: Sequence[str]
    ) -> dict[str, TranslationUpdate]:
        found = {}
        for lang in languages:
            update = find_final(list(self._entries(stream_id, lang)), segment_id, seq, source)
            if update is not None:
                found[lang] = update
        return found

    def _entries(self, stream_id: str, lang: str) -> Sequence[Entry]:
        return self._history.get(stream_id, {}).get(lang, ())

    def publish(self, reply: Reply, owner: Owner | None, epoch: int | None = None) -> None:
        cursor = self._cursors.next()
        if isinstance(reply, TranslationUpdate):
            reply = replace(reply, cursor=cursor)
        by_lang = self._history.setdefault(reply.stream_id or "", {})
        langs = [reply.lang] if reply.lang is not None else list(by_lang) or [""]
        for lang in langs:
            by_lang.setdefault(lang or "", deque(maxlen=HISTORY)).append(
                Entry(cursor, reply, epoch)
            )
        subs = list(self._writers.get(owner, ())) if owner is not None else []
        for key in (reply.stream_id, None):
            subs.extend(self._viewers.get(key, ()))
        for sub in subs:
            if sub.wants(reply):
                sub.put(reply, cursor)

    def to_owner(self, reply: Reply, owner: Owner | None) -> None:
        for sub in list(self._writers.get(owner, ())) if owner is not None else []:
            sub.put(reply)

    def release(self, stream_id: str) -> None:
        return None

    def subscribe(
        self,
        stream_id: str | None = None,
        *,
        owner: Owner | None = None,
        lang: str | None = None,
        after: str | None = None,
    ) -> Subscription:
        sub = Subscription(stream_id, self.queue_size, owner, lang)
        if owner is not None:
            self._writers.setdefault(owner, []).append(sub)
            return sub
        missed = self._resume(stream_id, lang, after)
        if missed is None:
            for update in sorted(self.backlog(stream_id, lang), key=by_cursor):
                sub.put(update)
        else:
            for entry in missed:
                assert entry.reply is not None
                if sub.wants(entry.reply):
                    sub.put(entry.reply, entry.cursor)
        self._viewers.setdefault(stream_id, []).append(sub)
        return sub

    def _resume(
        self, stream_id: str | None, lang: str | None, after: str | None
    ) -> list[Entry] | None:
        """What a viewer resuming after `after` missed, oldest first; None: start from the
        backlog (no cursor, every stream, or a cursor this history cannot place)."""
        if after is None or stream_id is None:
            return None
        by_lang = self._history.get(stream_id, {})
        missed: list[Entry] = []
        for language, entries in by_lang.items():
            if lang not in (None, language):
                continue
            found = resume_from(list(entries), after)
            if found is None:
                return None
            missed.extend(found)
        missed.sort(key=lambda entry: entry.at)
        # Close marks are not replies; one of them means the life the viewer had ended.
        return [entry for entry in missed if entry.reply is not None]

    def backlog(self, stream_id: str | None, lang: str | None) -> list[TranslationUpdate]:
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

    def unsubscribe(self, sub: Subscription) -> None:
        if sub.owner is not None:
            remove_subscription(self._writers, sub.owner, sub)
        else:
            remove_subscription(self._viewers, sub.stream_id, sub)
        sub.end()

    def end_stream(self, stream_id: str, closed: bool = True) -> None:
        if closed:
            self._history.pop(stream_id, None)
            self._handed_over.pop(stream_id, None)
        elif stream_id in self._history:
            self._handed_over[stream_id] = None
            self._handed_over.move_to_end(stream_id)
            while len(self._handed_over) > HANDED_OVER:
                oldest, _ = self._handed_over.popitem(last=False)
                self._history.pop(oldest, None)
        for sub in self._viewers.pop(stream_id, []):
            sub.end()

    def end_all(self) -> None:
        for subs in [*self._viewers.values(), *self._writers.values()]:
            for sub in subs:
                sub.end()
        self._viewers.clear()
        self._writers.clear()
        self._history.clear()
        self._handed_over.clear()


K = TypeVar("K")


def remove_subscription(table: dict[K, list[Subscription]], key: K, sub: Subscription) -> None:
    """Take `sub` out of `table[key]`, and the key out once its list is empty."""
    subs = table.get(key, [])
    if sub in subs:
        subs.remove(sub)
    if not subs:
        table.pop(key, None)
