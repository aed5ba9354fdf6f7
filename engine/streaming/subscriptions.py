"""A reader's view of a stream's replies: one stream's (or every stream's, or one writer's),
in one language or all, each reply once even where a history read and a live read
overlap. Who feeds it is the local fan-out (`engine.streaming.fanout`)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.languages import match_lang
from engine.replies import Reply, ReplyQueue
from engine.streaming.history import Position, position
from engine.streaming.lifecycle import Owner
from protocol import ErrorCode, ErrorMessage, InvalidEvent, TranslationUpdate


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

    @property
    def cursor(self) -> str | None:
        """The cursor of the last reply it took, where a follow-up subscription resumes
        (None: none taken, or several languages', which no one cursor places)."""
        if len(self.positions) != 1:
            return None
        ms, n = next(iter(self.positions.values()))
        return f"{ms}-{n}"
