"""Where a stream's replies go: subscriptions, and the bus that fans replies out to them.

The controller publishes every reply of a stream (its updates, and the errors that answer
its finals) to an `UpdateBus` and knows nothing about who reads them. The bus hands each
reply to the stream's owner (the writer), to the stream's viewers and to viewers of every
stream, each in the language it asked for, and keeps what a viewer joining late starts
from. `InProcessBus` is the default and all that replay and the embedding API need; a bus
shared by several server processes (issue 24) implements the same six methods.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import AsyncIterator, Sequence
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


class Subscription(AsyncIterator[Reply]):
    """A bounded queue of replies for one consumer, iterated with `async for`.

    When it is full, the oldest non-final update is dropped (a newer one supersedes it);
    finals and errors (which answer finals) are never dropped, so a slow consumer cannot
    stall translation for others and every final transcript still gets its reply.
    """

    def __init__(
        self,
        stream_id: str | None,
        max_items: int,
        owner: Owner | None = None,
        lang: str | None = None,
    ) -> None:
        self.stream_id = stream_id  # None: every stream
        self.owner = owner  # set: the replies of every stream this owner writes
        self.lang = lang  # None: every language
        self.max_items = max_items
        self.dropped = 0
        self._items: deque[Reply] = deque()
        self._ready = anyio.Event()
        self._ended = False

    def wants(self, reply: Reply) -> bool:
        """Whether `reply` is for this subscription's language (an error that names no
        language answers every language, so every subscription takes it)."""
        return self.lang is None or reply.lang is None or reply.lang == self.lang

    def put(self, reply: Reply) -> None:
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

    def close(self) -> None:
        """Deprecated: `end` (the old name goes in the next release)."""
        warnings.warn(
            "Subscription.close() is now Subscription.end(); the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        self.end()

    @property
    def ended(self) -> bool:
        return self._ended

    def __len__(self) -> int:
        return len(self._items)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Reply:
        while not self._items:
            if self._ended:
                raise StopAsyncIteration
            self._ready = anyio.Event()
            await self._ready.wait()
        return self._items.popleft()


@runtime_checkable
class UpdateBus(Protocol):
    """What the controller publishes to and its readers subscribe through.

    Replies are keyed by (stream, language); a stream's owner is the writer that gets its
    replies. None of the methods waits: the controller calls them from its event loop
    between translations, so a networked bus buffers and sends from its own task.
    """

    def publish(self, reply: Reply, owner: Owner | None) -> None:
        """Hand `reply` (about `reply.stream_id`, in `reply.lang`; an error without a
        language answers every language) to `owner`'s subscriptions, the stream's and
        every-stream ones that want it; an update also becomes the stream's backlog."""
        ...

    def subscribe(
        self,
        stream_id: str | None = None,
        *,
        owner: Owner | None = None,
        lang: str | None = None,
    ) -> Subscription:
        """A new subscription to one stream (all when None), or with `owner` to the
        replies of every stream that owner writes; `lang`: only that language (a base
        code the engine translates into; None: every one). A viewer's starts with the
        `backlog`, an owner's with nothing (a writer subscribes before it pushes)."""
        ...

    def backlog(self, stream_id: str | None, lang: str | None) -> list[TranslationUpdate]:
        """What a viewer joining now starts from: for each open stream (or the one) and
        language, its last few final updates, then its current segment's latest update."""
        ...

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop delivering to `sub` and end it."""
        ...

    def end_stream(self, stream_id: str) -> None:
        """A stream's life is over (its last reply is published): its viewers'
        subscriptions end and its backlog goes (a new stream with the id starts empty)."""
        ...

    def end_all(self) -> None:
        """The engine stops: every subscription ends, every backlog goes."""
        ...


class _Backlog:
    """One stream's lines in one language, as a late viewer is to see them."""

    def __init__(self) -> None:
        self.finals: deque[TranslationUpdate] = deque(maxlen=RECENT_FINALS)
        self.last: TranslationUpdate | None = None

    def record(self, update: TranslationUpdate) -> None:
        self.last = update
        if update.is_final:
            self.finals.append(update)

    def lines(self) -> list[TranslationUpdate]:
        current = [self.last] if self.last is not None and not self.last.is_final else []
        return [*self.finals, *current]


class InProcessBus:
    """The `UpdateBus` of one process: subscriptions in dictionaries, replies handed to
    them at once."""

    def __init__(self, queue_size: int = 256) -> None:
        self.queue_size = queue_size
        self._viewers: dict[str | None, list[Subscription]] = {}  # None: every stream
        self._writers: dict[Owner, list[Subscription]] = {}
        self._backlogs: dict[str, dict[str, _Backlog]] = {}  # stream -> language -> lines

    def publish(self, reply: Reply, owner: Owner | None) -> None:
        if isinstance(reply, TranslationUpdate):
            lines = self._backlogs.setdefault(reply.stream_id, {})
            lines.setdefault(reply.lang or "", _Backlog()).record(reply)
        subs = list(self._writers.get(owner, ())) if owner is not None else []
        for key in (reply.stream_id, None):
            subs.extend(self._viewers.get(key, ()))
        for sub in subs:
            if sub.wants(reply):
                sub.put(reply)

    def subscribe(
        self,
        stream_id: str | None = None,
        *,
        owner: Owner | None = None,
        lang: str | None = None,
    ) -> Subscription:
        sub = Subscription(stream_id, self.queue_size, owner, lang)
        if owner is not None:
            self._writers.setdefault(owner, []).append(sub)
            return sub
        for update in self.backlog(stream_id, lang):
            sub.put(update)
        self._viewers.setdefault(stream_id, []).append(sub)
        return sub

    def backlog(self, stream_id: str | None, lang: str | None) -> list[TranslationUpdate]:
        streams = (
            self._backlogs.items()
            if stream_id is None
            else [(stream_id, self._backlogs.get(stream_id, {}))]
        )
        return [
            update
            for _, by_lang in streams
            for language, lines in by_lang.items()
            if lang in (None, language)
            for update in lines.lines()
        ]

    def unsubscribe(self, sub: Subscription) -> None:
        if sub.owner is not None:
            _remove(self._writers, sub.owner, sub)
        else:
            _remove(self._viewers, sub.stream_id, sub)
        sub.end()

    def end_stream(self, stream_id: str) -> None:
        self._backlogs.pop(stream_id, None)
        for sub in self._viewers.pop(stream_id, []):
            sub.end()

    def end_all(self) -> None:
        for subs in [*self._viewers.values(), *self._writers.values()]:
            for sub in subs:
                sub.end()
        self._viewers.clear()
        self._writers.clear()
        self._backlogs.clear()


K = TypeVar("K")


def _remove(table: dict[K, list[Subscription]], key: K, sub: Subscription) -> None:
    subs = table.get(key, [])
    if sub in subs:
        subs.remove(sub)
    if not subs:
        table.pop(key, None)
