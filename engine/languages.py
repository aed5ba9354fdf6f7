"""Language facts in one table each: language codes, and which characters are CJK.

Several layers need them and must agree: the model config (which language a model
translates from and to), the streaming session (a CJK character is a commit boundary of
its own, a Latin word is not) and the metrics (words for English, characters for
Chinese). Pure Python, no dependencies, so every layer may import it.
"""

from __future__ import annotations

from collections.abc import Iterable

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


# Hesitation fillers recognisers write out ("um I will meet Tom"): not content, never
# translated or committed. Chinese ones are single characters written without spaces; only
# those that are never part of a word are listed (not 啊, a sentence particle, nor 额).
FILLERS: dict[str, frozenset[str]] = {
    "en": frozenset({"uh", "um", "uhm", "umm", "er", "erm", "ah", "eh", "hmm", "mm", "mhm"}),
    "zh": frozenset({"嗯", "呃"}),
}
_EDGE_PUNCTUATION = ",.;:!?…，。；：！？、"


def drop_fillers(text: str, lang: str | None) -> str:
    """`text` without the filler words of its language (a word with trailing punctuation,
    "Um," included); other languages are left as they are."""
    fillers = FILLERS.get(base_lang(lang)) if lang else None
    if not fillers:
        return text
    if base_lang(lang or "") == "zh":
        return "".join(ch for ch in text if ch not in fillers)
    kept = [w for w in text.split(" ") if w.strip(_EDGE_PUNCTUATION).lower() not in fillers]
    return " ".join(kept)


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


def in_ranges(ch: str, ranges: tuple[tuple[int, int], ...]) -> bool:
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in ranges)


def is_cjk(ch: str) -> bool:
    """True for a character that is a unit of its own in Chinese/Japanese/Korean text."""
    return in_ranges(ch, CJK_RANGES)


def is_ideograph(ch: str) -> bool:
    return in_ranges(ch, IDEOGRAPH_RANGES)
