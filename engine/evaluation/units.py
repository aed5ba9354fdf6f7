"""Latency and erasure units: words for English, characters for Chinese.

Latency metrics (AL, LAAL, DAL) and erasure are only comparable across systems when both
sides count the same units, so every evaluation path splits text through this module.
English (and any whitespace-delimited text) counts whitespace-separated words. Chinese
counts each CJK character or punctuation mark as one unit, a run of Latin letters/digits
(``COVID``, ``2024``) as one unit because a reader takes it in as one token, and never
counts spaces.
"""

from __future__ import annotations

from typing import Literal

from engine.languages import base_lang, is_cjk, is_ideograph

__all__ = ["Lang", "guess_lang", "is_cjk", "normalize_lang", "split_units", "unit_spans"]

Lang = Literal["en", "zh"]


def normalize_lang(lang: str) -> Lang:
    """Map a language code (``en``, ``eng_Latn``, ``zh-CN``, ``cmn_Hans``...) to ``en``/``zh``.

    Raises ValueError for anything else so that a typo does not silently change the units.
    """
    base = base_lang(lang)
    if base == "en":
        return "en"
    if base == "zh":
        return "zh"
    raise ValueError(f"unsupported language {lang!r}: expected one of en/eng or zh/zho/cmn")


def guess_lang(text: str, *, threshold: float = 0.3) -> Lang:
    """Guess ``zh`` when at least ``threshold`` of the non-space characters are CJK ideographs.

    Used when a log or a caller does not say which language a text is in; a ratio rather
    than "any ideograph" keeps English with a quoted Chinese name English.
    """
    chars = [ch for ch in text if not ch.isspace()]
    if not chars:
        return "en"
    ideographs = sum(1 for ch in chars if is_ideograph(ch))
    return "zh" if ideographs / len(chars) >= threshold else "en"


def _resolve(text: str, lang: str | None) -> Lang:
    return guess_lang(text) if lang is None else normalize_lang(lang)


def unit_spans(text: str, lang: str | None = None) -> list[tuple[int, int]]:
    """Character offsets ``(start, end)`` of each unit of ``text``.

    Offsets (not just the units) let callers cut a text after its k-th unit without
    re-joining, which keeps the original spacing, e.g. to build ASR-like prefixes.
    ``lang=None`` guesses the language from the text.
    """
    spans: list[tuple[int, int]] = []
    n = len(text)
    i = 0
    if _resolve(text, lang) == "en":
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
