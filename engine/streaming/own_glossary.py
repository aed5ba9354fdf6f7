"""A stream's own glossary, sent by its writer (`protocol.SetGlossary`).

The text is read with the glossary file's rules (`engine.glossary`: a bad entry is refused
with its line) and checked against the model of the target language its header names
(`glossaries_by_language`). A stream's sessions translate with the server's glossary for
their language merged with the stream's own, the stream's entries winning. A glossary
sent before the stream's first partial waits, for that writer only, until the partial
opens the stream (a bridge sends it first). The text as sent is what the bus keeps
beside the stream's histories (`UpdateBus.keep_glossaries`), so that a life that resumes
the stream on any node reads it again here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from engine.decoding.targets import Targets, glossaries_by_language
from engine.glossary import Glossary, GlossaryError, merged
from engine.streaming.lifecycle import Owner
from engine.streaming.stream import Stream
from protocol import ErrorCode, ErrorMessage, InvalidEvent, SetGlossary

log = logging.getLogger(__name__)

MAX_WAITING = 64
"""Streams per writer with a glossary waiting for their first partial: past it, the
writer is refused (`limit_exceeded`) rather than held to without bound."""

Own = dict[str, tuple[str, Glossary]]
"""A stream's own glossaries: target language -> (the text as sent, the glossary)."""


def read(message: SetGlossary, targets: Targets) -> tuple[str, Glossary]:
    """The target language and glossary of a `SetGlossary`; `InvalidEvent`
    (`invalid_message`, field `glossary`) naming the first bad line, or a language pair
    or term the models cannot take."""
    try:
        glossary = Glossary.parse(message.glossary, where="glossary")
        (lang,) = glossaries_by_language([glossary], targets)
    except GlossaryError as exc:
        raise InvalidEvent(
            ErrorMessage(ErrorCode.INVALID_MESSAGE, str(exc), "glossary", message.stream_id)
        ) from None
    return lang, glossary


def parse_kept(stream_id: str, texts: Mapping[str, str], targets: Targets) -> Own:
    """What the bus kept for a stream (an earlier life, maybe on another node), read
    again; a text this node cannot take (its models differ) is left out, and logged."""
    own: Own = {}
    for text in texts.values():
        try:
            lang, glossary = read(SetGlossary(stream_id, text), targets)
        except (InvalidEvent, ValueError) as exc:
            log.warning("stream %r: its kept glossary is not applied here: %s", stream_id, exc)
            continue
        own[lang] = (text, glossary)
    return own


def texts_of(own: Own) -> dict[str, str]:
    return {lang: text for lang, (text, _) in own.items()}


def apply(stream: Stream, own: Own, server: Mapping[str, Glossary]) -> None:
    """Give the stream its own glossaries (replacing what it had): each session then
    translates with the server's merged with the stream's, from its next translation."""
    stream.own_glossaries = dict(own)
    for lang, session in stream.sessions.items():
        mine = own.get(lang)
        chosen = [g for g in (server.get(lang), mine[1] if mine else None) if g is not None]
        session.glossary = merged(chosen) if len(chosen) > 1 else next(iter(chosen), None)


def update(own: Own, lang: str, text: str, glossary: Glossary) -> Own:
    """`own` with `lang`'s glossary replaced (one without entries clears it)."""
    changed = dict(own)
    if len(glossary):
        changed[lang] = (text, glossary)
    else:
        changed.pop(lang, None)
    return changed


class Waiting:
    """Glossaries sent for streams their writer has not opened yet, per writer."""

    def __init__(self) -> None:
        self._held: dict[Owner | None, dict[str, Own]] = {}

    def hold(
        self, owner: Owner | None, stream_id: str, lang: str, text: str, glossary: Glossary
    ) -> None:
        streams = self._held.setdefault(owner, {})
        if stream_id not in streams and len(streams) >= MAX_WAITING:
            raise InvalidEvent(
                ErrorMessage(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"glossaries for {MAX_WAITING} streams not opened yet: send their "
                    "first partials first",
                    "stream_id",
                    stream_id,
                )
            )
        streams[stream_id] = update(streams.get(stream_id, {}), lang, text, glossary)

    def take(self, owner: Owner | None, stream_id: str) -> Own:
        streams = self._held.get(owner, {})
        own = streams.pop(stream_id, {})
        if not streams:
            self._held.pop(owner, None)
        return own

    def forget(self, owner: Owner | None) -> None:
        self._held.pop(owner, None)
