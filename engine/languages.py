"""Language facts, one table each: codes, CJK script ranges, which languages are written
without spaces, the languages metrics count units for, and hesitation fillers.

Several layers need them and must agree: the model config (which language a model
translates from and to), the translator (how translated pieces are joined), the streaming
session (a CJK character is a commit boundary of its own, a Latin word is not), the metrics
and peer formats (words for English, characters for Chinese) and the subtitle layout. Pure
Python, no dependencies, so every layer may import it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

# Codes as models and corpora write them (ISO 639-1/2/3, OPUS and FLORES names) -> the
# short code the engine uses. Cantonese and Wu count as Chinese: the same units.
LANG_ALIASES: dict[str, str] = {
    "eng": "en",
    "english": "en",
    "zho": "zh",
    "chi": "zh",
    "cmn": "zh",
    "yue": "zh",
    "wuu": "zh",
    "chinese": "zh",
}

WITHOUT_SPACES: frozenset[str] = frozenset({"zh"})
"""Languages (short codes) written without spaces between words: their pieces are joined
with nothing, and metrics count their text in characters rather than words."""

Lang = Literal["en", "zh"]
"""The units metrics count, named by their model language: words (as English) or
characters (as Chinese)."""

COUNTED_IN_WORDS: frozenset[str] = frozenset({"en", "de", "fr", "es", "it", "pt", "nl"})
"""Languages (short codes) whose text metrics count in words, as English (`"en"` units):
the project's fixtures' (en, de) and the common OPUS-MT targets written with spaces."""

UNIT_LANGS: tuple[Lang, ...] = ("en", "zh")

# Ideographs, kana, hangul, CJK symbols and punctuation, full-width forms: each character
# is a unit (and a commit boundary) of its own.
CJK_RANGES: tuple[tuple[int, int], ...] = (
    (0x2E80, 0x9FFF),  # radicals .. CJK symbols and punctuation, kana, ext. A, ideographs
    (0xAC00, 0xD7AF),  # hangul syllables
    (0xF900, 0xFAFF),  # compatibility ideographs
    (0xFE30, 0xFE4F),  # compatibility forms (vertical punctuation)
    (0xFF00, 0xFFEF),  # half-width and full-width forms
    (0x20000, 0x3FFFF),  # supplementary ideographic planes (extensions B..)
)

# Only ideographs vote for "this text is Chinese"; shared punctuation must not.
IDEOGRAPH_RANGES: tuple[tuple[int, int], ...] = (
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF),
    (0x20000, 0x3FFFF),
)

CJK_TEXT_SHARE = 0.3
"""A text counts as Chinese (CJK) when at least this share of its non-space characters is:
a share rather than "any" keeps English with a quoted Chinese name English."""


# Hesitation fillers recognisers write out ("um I will meet Tom"): not content, never
# translated or committed. Chinese ones are single characters written without spaces; only
# those that are never part of a word are listed (not 啊, a sentence particle, nor 额).
FILLERS: dict[str, frozenset[str]] = {
    "en": frozenset({"uh", "um", "uhm", "umm", "er", "erm", "ah", "eh", "hmm", "mm", "mhm"}),
    "zh": frozenset({"嗯", "呃"}),
}
_EDGE_PUNCTUATION = ",.;:!?…，。；：！？、"


def base_lang(code: str) -> str:
    """'cmn_Hans', 'zh-CN', 'zho' -> 'zh'; 'eng_Latn' -> 'en'; 'de' -> 'de' (lowercase)."""
    base = code.strip().lower().replace("-", "_").split("_", 1)[0]
    return LANG_ALIASES.get(base, base)


def match_lang(tag: str, languages: Iterable[str]) -> str | None:
    """Which of `languages` (base codes, as models are keyed) a tag such as "zh-Hans" or
    "zh" names, or None: viewers and subtitle pages write full tags."""
    known = list(languages)
    if tag in known:
        return tag
    base = base_lang(tag)
    return base if base in known else None


def written_without_spaces(lang: str | None) -> bool:
    """Whether `lang` (any code `base_lang` knows; None: unknown) is in `WITHOUT_SPACES`."""
    return lang is not None and base_lang(lang) in WITHOUT_SPACES


def word_joiner(lang: str | None) -> str:
    """What goes between two pieces of text in `lang`: nothing, or a space."""
    return "" if written_without_spaces(lang) else " "


def normalize_lang(lang: str) -> Lang:
    """Map a language code (``en``, ``eng_Latn``, ``de``, ``zh-CN``, ``cmn_Hans``...) to
    the units its text is counted in: ``en`` (words: `COUNTED_IN_WORDS`) or ``zh``
    (characters: `WITHOUT_SPACES`).

    Raises ValueError for anything else so that a typo does not silently change the units.
    """
    base = base_lang(lang)
    if base in WITHOUT_SPACES:
        return "zh"
    if base in COUNTED_IN_WORDS:
        return "en"
    words = "/".join(sorted(COUNTED_IN_WORDS))
    raise ValueError(
        f"unsupported language {lang!r}: expected one counted in words ({words}) or "
        "in characters (zh/zho/cmn)"
    )


def in_ranges(ch: str, ranges: tuple[tuple[int, int], ...]) -> bool:
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in ranges)


def is_cjk(ch: str) -> bool:
    """True for a character that is a unit of its own in Chinese/Japanese/Korean text."""
    return in_ranges(ch, CJK_RANGES)


def is_ideograph(ch: str) -> bool:
    return in_ranges(ch, IDEOGRAPH_RANGES)


def cjk_share(text: str, *, ideographs: bool = False) -> float | None:
    """The share of the non-space characters of `text` that are CJK (`ideographs`: only
    ideographs count); None for a text of spaces only."""
    chars = [ch for ch in text if not ch.isspace()]
    if not chars:
        return None
    test = is_ideograph if ideographs else is_cjk
    return sum(1 for ch in chars if test(ch)) / len(chars)


OTHER_SCRIPT_SHARE = 0.5
"""A text in a language written with spaces is "mostly in another script" when at least this
share of its letters are ideographs (Chinese sent to an English model)."""

IDEOGRAPH_SHARE_MIN = 0.1
"""Chinese text is "in another script" only below this share of ideographs among its letters:
Chinese quotes Latin names, units and product names freely ("802.11n 标准在 2.4Ghz 和 5.0Ghz
频率上都可运行" is Chinese), so only text with next to no ideographs is flagged."""


_ASCII_LETTER = re.compile("[A-Za-z]")


def ideograph_share(text: str) -> float | None:
    """The share of ideographs among the letters of `text` (digits, punctuation and spaces
    left out); None for a text without letters."""
    if text.isascii():  # no ideograph is: only whether it has letters (22 -> 0.3 us)
        return 0.0 if _ASCII_LETTER.search(text) else None
    ideographs = letters = 0
    for ch in text:
        if is_ideograph(ch):
            ideographs += 1
            letters += 1
        elif ch.isalpha():
            letters += 1
    return ideographs / letters if letters else None


def in_other_script(text: str, source_lang: str | None) -> bool:
    """Whether `text` is mostly in another script than `source_lang` is written in:
    Chinese sent to an English model, or English to a Chinese one. Such input is
    translated into nonsense without a word from the model, so the engine says so once
    (the log, replay's report). False when the language is unknown or the text has no
    letters."""
    if not source_lang:
        return False
    share = ideograph_share(text)
    if share is None:
        return False
    if written_without_spaces(source_lang):
        return share < IDEOGRAPH_SHARE_MIN
    return share >= OTHER_SCRIPT_SHARE


def guess_lang(text: str, *, threshold: float = CJK_TEXT_SHARE) -> Lang:
    """``zh`` when at least ``threshold`` of the non-space characters are CJK ideographs,
    else ``en``: for a log or caller that does not say which language a text is in."""
    share = cjk_share(text, ideographs=True)
    return "zh" if share is not None and share >= threshold else "en"


def text_lang(text: str, lang: str | None = None) -> Lang:
    """The unit language of `text`: `lang` normalized when given, else guessed from it."""
    return guess_lang(text) if lang is None else normalize_lang(lang)


def drop_fillers(text: str, lang: str | None) -> str:
    """`text` without the filler words of its language (a word with trailing punctuation,
    "Um," included); other languages are left as they are."""
    fillers = FILLERS.get(base_lang(lang)) if lang else None
    if not fillers:
        return text
    if written_without_spaces(lang):
        return "".join(ch for ch in text if ch not in fillers)
    kept = [w for w in text.split(" ") if w.strip(_EDGE_PUNCTUATION).lower() not in fillers]
    return " ".join(kept)
