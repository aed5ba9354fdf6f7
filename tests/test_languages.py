"""One table of language facts: the session's commit boundaries, the metrics' units and the
model config's language codes come from `engine.languages` and agree."""

from __future__ import annotations

import pytest

from engine.evaluation import units
from engine.languages import CJK_RANGES, base_lang, is_cjk
from engine.model.config import _lang_code
from engine.streaming import session


@pytest.mark.parametrize(
    ("code", "base"),
    [
        ("cmn_Hans", "zh"),
        ("zh-CN", "zh"),
        ("zho", "zh"),
        ("yue_Hant", "zh"),
        ("eng_Latn", "en"),
        ("EN", "en"),
        ("de", "de"),
        ("deu", "deu"),
    ],
)
def test_language_codes_map_the_same_everywhere(code: str, base: str) -> None:
    assert base_lang(code) == _lang_code(code) == base
    if base in ("en", "zh"):
        assert units.normalize_lang(code) == base
    else:
        with pytest.raises(ValueError, match="unsupported language"):
            units.normalize_lang(code)


def test_cjk_characters_are_units_and_commit_boundaries_alike() -> None:
    # One character from each range, vertical punctuation (U+FE35) and kana included.
    samples = [chr(lo + (hi - lo) // 2) for lo, hi in CJK_RANGES] + ["\ufe35", "の", "，"]
    for ch in samples:
        assert is_cjk(ch), hex(ord(ch))
        assert units.split_units(f"ab{ch}{ch}cd", "zh") == ["ab", ch, ch, "cd"], hex(ord(ch))
        assert not session._word_char(ch)  # a CJK character never extends a word
    assert session._word_char("a") and session._word_char("7")
