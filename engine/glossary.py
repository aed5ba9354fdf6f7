"""Glossaries as data: term pairs for one language pair and a do-not-translate list, and
where their sources occur in recognizer text.

A glossary is what a speaker's audience knows (a conference's product names, a
lecturer's terms): each matched term's target must appear in the translation
(`engine.decoding.constraints` makes the search place it). This module is pure: it parses
and matches text, it needs no model, so the streaming layer, the CLI and the protocol's
per-stream glossaries share one reading of a file.

The file is TSV, as DeepL takes glossaries, with a header naming the languages, as
Amazon Translate's custom terminology does::

    en<TAB>de
    Tom<TAB>Thomas
    # a comment
    Acme            (one column: do not translate, the term is kept as it is)

Matching follows the recognizer's text, not a writer's: case- and punctuation-insensitive,
whole words where the source language spaces its words (characters where it does not),
hesitation fillers skipped as the streaming options drop them, longest match first,
each word in one match at most. In a partial, a term counts once its source is complete:
another word, a space or punctuation follows it (the last word of a partial may still grow:
"Tom" -> "Tomorrow").
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import EngineError
from engine.languages import FILLERS, base_lang, written_without_spaces

MAX_ENTRIES = 10_000
"""Entries a glossary may hold: a file past it is refused, not cut."""

MAX_TERM_CHARS = 200
"""Characters of one term (source or target)."""

MAX_TERM_WORDS = 16
"""Matching units (words, or characters where the language has no spaces) of a source."""

MAX_FILE_BYTES = 2 * 1024 * 1024
"""Bytes of a glossary file."""

_WORD = re.compile(r"\w+(?:['’]\w+)*")


class GlossaryError(EngineError, ValueError):
    """A glossary that cannot be used: the first bad line, named with its number."""


@dataclass(frozen=True)
class Term:
    """One entry: its source as written, its target (the source itself for a
    do-not-translate entry) and the source's matching units."""

    source: str
    target: str
    keep: bool  # do not translate
    key: tuple[str, ...]


@dataclass(frozen=True)
class Match:
    """A term found in a text: the units [start, end) of the text's matching units."""

    term: Term
    start: int
    end: int


def _units(text: str, lang: str) -> list[tuple[str, int]]:
    """The matching units of `text` with where each ends in it: casefolded words (or
    non-space, non-punctuation characters where `lang` has no spaces), fillers left out."""
    fillers = FILLERS.get(base_lang(lang), frozenset())
    text = unicodedata.normalize("NFKC", text)
    units: list[tuple[str, int]] = []
    if written_without_spaces(lang):
        for at, ch in enumerate(text):
            if ch.isspace() or unicodedata.category(ch)[0] in "PSZ" or ch in fillers:
                continue
            units.append((ch.casefold(), at + 1))
        return units
    for found in _WORD.finditer(text):
        word = found.group().casefold().replace("’", "'")
        if word not in fillers:
            units.append((word, found.end()))
    return units


def source_key(text: str, lang: str) -> tuple[str, ...]:
    """How a term's source is matched: its units (`_units`)."""
    return tuple(unit for unit, _ in _units(text, lang))


@dataclass(frozen=True)
class Glossary:
    """Term pairs from `source_lang` to `target_lang`, indexed by their first unit for
    matching (a text of n units costs O(n) lookups, whatever the glossary's size)."""

    source_lang: str
    target_lang: str
    terms: tuple[Term, ...]
    _index: dict[str, tuple[Term, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, list[Term]] = {}
        for term in self.terms:
            index.setdefault(term.key[0], []).append(term)
        # Longest first: the first that fits is the longest match.
        ordered = {
            first: tuple(sorted(terms, key=lambda t: -len(t.key))) for first, terms in index.items()
        }
        object.__setattr__(self, "_index", ordered)

    def __len__(self) -> int:
        return len(self.terms)

    @classmethod
    def from_pairs(
        cls,
        source_lang: str,
        target_lang: str,
        pairs: Iterable[tuple[str, str | None]],
        *,
        where: str = "glossary",
    ) -> Glossary:
        """A glossary from (source, target) pairs, target None for do-not-translate;
        `where` names the origin in errors (entry numbers count from 1)."""
        _check_lang(source_lang, f"{where}: source language")
        _check_lang(target_lang, f"{where}: target language")
        terms: list[Term] = []
        seen: dict[tuple[str, ...], Term] = {}
        for number, (source, target) in enumerate(pairs, start=1):
            if number > MAX_ENTRIES:
                raise GlossaryError(f"{where}: more than {MAX_ENTRIES} entries")
            term = _term(source, target, source_lang, f"{where}: entry {number}")
            previous = seen.get(term.key)
            if previous is not None:
                if previous.target == term.target:
                    continue
                raise GlossaryError(
                    f"{where}: entry {number}: {source!r} is already translated as "
                    f"{previous.target!r}"
                )
            seen[term.key] = term
            terms.append(term)
        return cls(base_lang(source_lang), base_lang(target_lang), tuple(terms))

    @classmethod
    def parse(cls, text: str, *, where: str = "glossary") -> Glossary:
        """A glossary from a file's text (module docstring); `GlossaryError` names the
        first bad line."""
        lines = text.split("\n")
        header: tuple[str, str] | None = None
        pairs: list[tuple[str, str | None]] = []
        numbers: list[int] = []
        for number, raw in enumerate(lines, start=1):
            line = raw.rstrip("\r")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            at = f"{where}:{number}"
            fields = line.split("\t")
            if header is None:
                if len(fields) != 2 or not all(f.strip() for f in fields):
                    raise GlossaryError(
                        f"{at}: the first line must name the languages, "
                        "source<TAB>target (e.g. en<TAB>de)"
                    )
                header = (fields[0].strip(), fields[1].strip())
                for lang, side in zip(header, ("source", "target"), strict=True):
                    _check_lang(
                        lang, f"{at}: the first line must name the languages; {side} language"
                    )
                continue
            if len(fields) > 2:
                raise GlossaryError(
                    f"{at}: {len(fields)} tab-separated fields; expected source<TAB>target, "
                    "or one term to keep untranslated"
                )
            if len(pairs) >= MAX_ENTRIES:
                raise GlossaryError(f"{at}: more than {MAX_ENTRIES} entries")
            source = fields[0].strip()
            target = fields[1].strip() if len(fields) == 2 else None
            _term(source, target, header[0], at)  # the line's own error, with its number
            pairs.append((source, target))
            numbers.append(number)
        if header is None:
            raise GlossaryError(f"{where}: empty; the first line must be source<TAB>target")
        try:
            return cls.from_pairs(header[0], header[1], pairs, where=where)
        except GlossaryError as exc:  # a duplicate: name its line, not its entry number
            found = re.match(rf"{re.escape(where)}: entry (\d+): (.*)", str(exc))
            if found is None:
                raise
            line_number = numbers[int(found.group(1)) - 1]
            raise GlossaryError(f"{where}:{line_number}: {found.group(2)}") from None

    @classmethod
    def read(cls, path: str | Path) -> Glossary:
        """A glossary file (UTF-8, at most `MAX_FILE_BYTES`)."""
        path = Path(path)
        try:
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                raise GlossaryError(
                    f"{path}: {size} bytes; a glossary holds at most {MAX_FILE_BYTES}"
                )
            data = path.read_bytes()
        except OSError as exc:
            raise GlossaryError(f"{path}: {exc.strerror or exc}") from None
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            raise GlossaryError(f"{path}:{line}: not UTF-8 ({exc.reason})") from None
        return cls.parse(text, where=str(path))

    def match(self, text: str, *, partial: bool = False) -> list[Match]:
        """The terms whose sources occur in `text`, left to right, longest first, each
        unit in one match at most. `partial`: `text` may still grow, so a match that
        ends at the text's very end (no space or punctuation after it) does not count."""
        return self.scan(text, partial=partial)[0]

    def scan(self, text: str, *, partial: bool = False) -> tuple[list[Match], list[Match]]:
        """`match`, and the matches it left out because they end at a partial's open end
        (`partial`): terms heard but not complete yet, about to count if the word does not
        grow (a caller prepares for them: `Translator.render_ahead`). One pass for both."""
        units = _units(text, self.source_lang)
        if not units or not self._index:
            return [], []
        words = [unit for unit, _ in units]
        end_open = partial and units[-1][1] == len(unicodedata.normalize("NFKC", text))
        found: list[Match] = []
        left_open: list[Match] = []
        at = 0
        while at < len(words):
            for term in self._index.get(words[at], ()):
                n = len(term.key)
                if tuple(words[at : at + n]) != term.key:
                    continue
                if end_open and at + n == len(words):
                    if not left_open or left_open[-1].start != at:  # the longest only
                        left_open.append(Match(term, at, at + n))
                    continue
                found.append(Match(term, at, at + n))
                at += n
                break
            else:
                at += 1
        return found, left_open

    def targets(self, text: str, *, partial: bool = False) -> list[str]:
        """The targets that `text`'s matched terms require, once each, in order."""
        seen: dict[str, None] = {}
        for found in self.match(text, partial=partial):
            seen.setdefault(found.term.target, None)
        return list(seen)


def _check_lang(lang: str, what: str) -> None:
    if not re.fullmatch(r"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})*", lang):
        raise GlossaryError(f"{what} {lang!r} is not a language code (e.g. en, de, zh)")


def _term(source: str, target: str | None, source_lang: str, at: str) -> Term:
    """One checked entry; `at` says where it came from."""
    if not source:
        raise GlossaryError(f"{at}: empty source term")
    if target is not None and not target:
        raise GlossaryError(
            f"{at}: empty target for {source!r} (one column alone keeps a term untranslated)"
        )
    for side, value in (("source", source), ("target", target)):
        if value is None:
            continue
        if len(value) > MAX_TERM_CHARS:
            raise GlossaryError(
                f"{at}: {side} term of {len(value)} characters (at most {MAX_TERM_CHARS})"
            )
        bad = next(
            (ch for ch in value if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co")), None
        )
        if bad is not None:
            raise GlossaryError(f"{at}: {side} term holds control character U+{ord(bad):04X}")
    key = source_key(source, source_lang)
    if not key:
        raise GlossaryError(f"{at}: source {source!r} has no word to match")
    if len(key) > MAX_TERM_WORDS:
        raise GlossaryError(
            f"{at}: source {source!r} is {len(key)} words long (at most {MAX_TERM_WORDS})"
        )
    return Term(source, source if target is None else target, target is None, key)


def merged(glossaries: Sequence[Glossary]) -> Glossary:
    """One glossary from several of the same language pair, later entries winning (a
    stream's own over the server's)."""
    first = glossaries[0]
    by_key: dict[tuple[str, ...], Term] = {}
    for glossary in glossaries:
        if (glossary.source_lang, glossary.target_lang) != (first.source_lang, first.target_lang):
            raise GlossaryError("glossaries of different language pairs cannot be merged")
        for term in glossary.terms:
            by_key[term.key] = term
    return Glossary(first.source_lang, first.target_lang, tuple(by_key.values()))


def holds(text: str, target: str, lang: str | None) -> bool:
    """Whether a translation `text` in `lang` holds a term's `target` (spaces ignored where
    the language writes none, as its detokenized text may carry some)."""
    if written_without_spaces(lang):
        return "".join(target.split()) in "".join(text.split())
    return target in text
