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

Lang = Literal["en", "zh"]

_LANG_ALIASES: dict[str, Lang] = {
    "en": "en",
    "eng": "en",
    "english": "en",
    "zh": "zh",
    "zho": "zh",
    "cmn": "zh",
    "chi": "zh",
    "chinese": "zh",
}

# Ideographs, kana, hangul, CJK symbols/punctuation and full-width forms: each is one unit.
_CJK_RANGES: tuple[tuple[int, int], ...] = (
    (0x2E80, 0x2FDF),  # radicals
    (0x3000, 0x303F),  # CJK symbols and punctuation
    (0x3040, 0x30FF),  # hiragana, katakana
    (0x3100, 0x31BF),  # bopomofo
    (0x3400, 0x4DBF),  # extension A
    (0x4E00, 0x9FFF),  # unified ideographs
    (0xAC00, 0xD7AF),  # hangul syllables
    (0xF900, 0xFAFF),  # compatibility ideographs
    (0xFE30, 0xFE4F),  # compatibility forms (vertical punctuation)
    (0xFF00, 0xFFEF),  # half-width and full-width forms
    (0x20000, 0x3134F),  # extensions B..H
)

# Only ideographs vote for "this text is Chinese"; shared punctuation must not.
_IDEOGRAPH_RANGES: tuple[tuple[int, int], ...] = (
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF),
    (0x20000, 0x3134F),
)


def normalize_lang(lang: str) -> Lang:
    """Map a language code (``en``, ``eng_Latn``, ``zh-CN``, ``cmn_Hans``...) to ``en``/``zh``.

    Raises ValueError for anything else so that a typo does not silently change the units.
    """
    key = lang.strip().lower().replace("-", "_").split("_", 1)[0]
    try:
        return _LANG_ALIASES[key]
    except KeyError:
        raise ValueError(
            f"unsupported language {lang!r}: expected one of en/eng or zh/zho/cmn"
        ) from None


def _in_ranges(ch: str, ranges: tuple[tuple[int, int], ...]) -> bool:
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in ranges)


def is_cjk(ch: str) -> bool:
    """True for a character that is a unit of its own in Chinese text (ideograph, CJK mark)."""
    return _in_ranges(ch, _CJK_RANGES)


def guess_lang(text: str, *, threshold: float = 0.3) -> Lang:
    """Guess ``zh`` when at least ``threshold`` of the non-space characters are CJK ideographs.

    Used when a log or a caller does not say which language a text is in; a ratio rather
    than "any ideograph" keeps English with a quoted Chinese name English.
    """
    chars = [ch for ch in text if not ch.isspace()]
    if not chars:
        return "en"
    ideographs = sum(1 for ch in chars if _in_ranges(ch, _IDEOGRAPH_RANGES))
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
