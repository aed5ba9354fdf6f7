"""Latency and erasure units: words for English, characters for Chinese.

Latency metrics (AL, LAAL, DAL) and erasure are only comparable across systems when both
sides count the same units, so every evaluation path splits text through this module.
English (written with spaces) counts whitespace-separated words. Chinese (written without,
``engine.languages.WITHOUT_SPACES``) counts each CJK character or punctuation mark as one
unit, a run of Latin letters/digits (``COVID``, ``2024``) as one unit because a reader
takes it in as one token, and never counts spaces.
"""

from __future__ import annotations

from engine.languages import (
    Lang,
    guess_lang,
    is_cjk,
    normalize_lang,
    text_lang,
    written_without_spaces,
)

# `Lang`, `guess_lang`, `normalize_lang` and `is_cjk` live in `engine.languages`, the one
# table of language facts; they stay importable from here.
__all__ = [
    "Lang",
    "count_units",
    "guess_lang",
    "is_cjk",
    "normalize_lang",
    "split_units",
    "unit_spans",
]


def unit_spans(text: str, lang: str | None = None) -> list[tuple[int, int]]:
    """Character offsets ``(start, end)`` of each unit of ``text``.

    Offsets (not just the units) let callers cut a text after its k-th unit without
    re-joining, which keeps the original spacing, e.g. to build ASR-like prefixes.
    ``lang=None`` guesses the language from the text.
    """
    spans: list[tuple[int, int]] = []
    n = len(text)
    i = 0
    if not written_without_spaces(text_lang(text, lang)):
        while i < n:
            if text[i].isspace():
                i += 1
                continue
            start = i
            while i < n and not text[i].isspace():
                i += 1
            spans.append((start, i))
        return spans
    while i < n:
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch.isalnum() and not is_cjk(ch):
            start = i
            while i < n and text[i].isalnum() and not is_cjk(text[i]):
                i += 1
            spans.append((start, i))
        else:
            spans.append((i, i + 1))
            i += 1
    return spans


def split_units(text: str, lang: str | None = None) -> list[str]:
    """Units of ``text``: words for English, characters (Latin runs kept whole) for Chinese."""
    return [text[a:b] for a, b in unit_spans(text, lang)]


def count_units(text: str, lang: str | None = None) -> int:
    """Number of units in ``text`` (see ``split_units``)."""
    return len(unit_spans(text, lang))
