"""A glossary's matched terms as a model's constraints: the target token ids each term must
appear as (`TermTokens`), checked against the model's vocabulary once per term.

Matching is the glossary's (`engine.glossary`, no model); the tokens are the model's:
a term's target is written the way it appears inside a sentence (with its word-start
marker where the target language spaces words; without the sentence-start marker where
it does not: Chinese pieces carry no marker past a sentence's first).
"""

from __future__ import annotations

import functools
import threading

from engine.decoding.constraints import Constraint
from engine.glossary import Glossary, GlossaryError, Term
from engine.languages import base_lang, written_without_spaces
from engine.model.tokenizer import PIECE_MARKER, MarianTokenizer

CUE_CHARS = 3
"""Characters a rendering's first piece needs to cue a term where words are spaced."""

CONSTRAINTS_KEPT = 65536
"""Constraints (target, rendering) a `TermTokens` keeps made; past it, it starts over."""

CHECKED = 8
"""Glossaries whose every target a `TermTokens` remembers having checked."""


class TermTokens:
    """Target ids of glossary terms for one tokenizer and target language, cached."""

    def __init__(
        self, tokenizer: MarianTokenizer, source_lang: str | None, target_lang: str | None
    ) -> None:
        self.tokenizer = tokenizer
        self.source_lang = base_lang(source_lang) if source_lang else ""
        self.target_lang = base_lang(target_lang) if target_lang else ""
        self._ids: dict[str, tuple[int, ...]] = {}
        self._constraints: dict[tuple[str, str], Constraint] = {}  # (target, rendering)
        self._checked: list[Glossary] = []  # the last few checked whole (by identity)
        self._lock = threading.Lock()

    def check(self, glossary: Glossary) -> None:
        """Refuse a glossary of another language pair, or with a target the model cannot
        write (`GlossaryError`, naming the term). Once per glossary object (the last
        `CHECKED` of them are remembered)."""
        with self._lock:
            if any(seen is glossary for seen in self._checked):
                return
        pair = (glossary.source_lang, glossary.target_lang)
        if self.source_lang and self.target_lang and pair != (self.source_lang, self.target_lang):
            raise GlossaryError(
                f"the glossary is {pair[0]}->{pair[1]}, the model translates "
                f"{self.source_lang}->{self.target_lang}"
            )
        for term in glossary.terms:
            self.ids(term.target)
        with self._lock:
            self._checked = [glossary, *self._checked[: CHECKED - 1]]

    def ids(self, target: str) -> tuple[int, ...]:
        with self._lock:
            found = self._ids.get(target)
        if found is not None:
            return found
        ids = self._tokenize(target)
        with self._lock:
            self._ids[target] = ids
        return ids

    def _tokenize(self, target: str) -> tuple[int, ...]:
        tok = self.tokenizer
        ids = tok.encode_target(target)
        if written_without_spaces(self.target_lang) and ids:
            first = tok.id_to_piece(ids[0])
            if first == PIECE_MARKER:
                ids = ids[1:]
            elif first.startswith(PIECE_MARKER):
                inner = first[len(PIECE_MARKER) :]
                ids = [tok.vocab.get(inner, tok.unk_id), *ids[1:]]
                if ids[0] == tok.unk_id:  # no such piece without the marker: characters
                    ids = [tok.vocab.get(ch, tok.unk_id) for ch in inner] + ids[1:]
        if not ids or tok.unk_id in ids:
            unknown = [piece for piece in tok.target_pieces(target) if piece not in tok.vocab]
            shown = "".join(unknown).replace(PIECE_MARKER, "") or target
            raise GlossaryError(f"target {target!r}: the model cannot write {shown!r}")
        return tuple(ids)

    def initial(self, target: str) -> tuple[int, ...]:
        """`target`'s ids at the start of a sentence (as the tokenizer writes it there)."""
        return tuple(self.tokenizer.encode_target(target))

    def cues(self, rendering: str) -> frozenset[int]:
        """The first ids of the model's own rendering of a term's source, in either form."""
        if not rendering.strip():
            return frozenset()
        try:
            inside = self.ids(rendering)
        except GlossaryError:
            inside = ()
        initial = self.initial(rendering)
        if initial and self.tokenizer.id_to_piece(initial[0]) == PIECE_MARKER:
            initial = initial[1:]  # a bare start marker cues nothing
        return frozenset(ids[0] for ids in (inside, initial) if self._telling(ids))

    def _telling(self, ids: tuple[int, ...]) -> bool:
        """Whether a rendering's first piece says the rendering starts: the whole of it,
        any piece where words are not spaced (Chinese pieces are words or characters),
        else a piece of at least `CUE_CHARS` characters (a letter or two, "K", "Ka",
        starts many German words: docs/glossaries.md)."""
        if not ids:
            return False
        piece = self.tokenizer.id_to_piece(ids[0]).lstrip(PIECE_MARKER)
        spaced = not written_without_spaces(self.target_lang)
        return len(ids) == 1 or not spaced or len(piece) >= CUE_CHARS

    @functools.cached_property
    def glued(self) -> tuple[int, ...]:
        """Pieces that continue a word (no word-start marker, not punctuation): none may
        follow a term where the language spaces words, so a term stays a whole word."""
        if written_without_spaces(self.target_lang):
            return ()
        tok = self.tokenizer
        special = set(tok.special_ids)
        return tuple(
            i
            for i in range(len(tok))
            if i not in special
            and not (piece := tok.id_to_piece(i)).startswith(PIECE_MARKER)
            and any(ch.isalnum() for ch in piece)
        )

    def constraint(self, target: str, rendering: str) -> Constraint:
        """The constraint of a term whose target is `target` and whose source the model
        renders by itself as `rendering`."""
        key = (target, rendering)
        with self._lock:
            found = self._constraints.get(key)
        if found is not None:
            return found
        try:
            inside = self.ids(rendering) if rendering.strip() else ()
        except GlossaryError:
            inside = ()
        at_start = self.initial(rendering) if rendering.strip() else ()
        made = Constraint(
            self.ids(target),
            self.cues(rendering),
            self.initial(target),
            self.glued,
            inside,
            at_start,
        )
        with self._lock:
            if len(self._constraints) >= CONSTRAINTS_KEPT:
                self._constraints.clear()
            self._constraints[key] = made
        return made

    def matched(self, glossary: Glossary | None, text: str, *, partial: bool = False) -> list[Term]:
        """`text`'s matched terms, one per target, in order (none without a glossary)."""
        return self.scan(glossary, text, partial=partial)[0]

    def scan(
        self, glossary: Glossary | None, text: str, *, partial: bool = False
    ) -> tuple[list[Term], list[Term]]:
        """`matched`, and the terms a partial's open end holds (`Glossary.scan`)."""
        if glossary is None or not glossary.terms:
            return [], []
        found, left_open = glossary.scan(text, partial=partial)
        seen: dict[str, Term] = {}
        for match in found:
            seen.setdefault(match.term.target, match.term)
        return list(seen.values()), [match.term for match in left_open]
