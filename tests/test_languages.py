"""One table of language facts: the session's commit boundaries, the metrics' units, the
model config's language codes and which languages are written without spaces come from
`engine.languages` and agree."""

from __future__ import annotations

import pytest

from engine import languages
from engine.evaluation import units
from engine.evaluation.metrics import SegmentTrace, UpdatePoint, display_text
from engine.evaluation.peers import simuleval_instances
from engine.evaluation.report import build_report
from engine.languages import CJK_RANGES, base_lang, is_cjk
from engine.model.config import _lang_code
from engine.streaming import boundaries


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
    elif base == "de":  # German text is counted in words, as English
        assert units.normalize_lang(code) == "en"
    else:
        with pytest.raises(ValueError, match="unsupported language"):
            units.normalize_lang(code)


def test_cjk_characters_are_units_and_commit_boundaries_alike() -> None:
    # One character from each range, vertical punctuation (U+FE35) and kana included.
    samples = [chr(lo + (hi - lo) // 2) for lo, hi in CJK_RANGES] + ["\ufe35", "の", "，"]
    for ch in samples:
        assert is_cjk(ch), hex(ord(ch))
        assert units.split_units(f"ab{ch}{ch}cd", "zh") == ["ab", ch, ch, "cd"], hex(ord(ch))
        assert not boundaries.word_char(ch)  # a CJK character never extends a word
    assert boundaries.word_char("a") and boundaries.word_char("7")


def test_one_table_says_which_languages_are_written_without_spaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Units, the displayed text, peer formats and fillers all read `WITHOUT_SPACES`: with
    English added to it, English text is counted, joined and cleaned like Chinese."""

    def prediction(text: str) -> object:
        update = UpdatePoint("ab cd", text, text, True, 0.0, 1.0)
        report = build_report([SegmentTrace([update], 0.0, 1.0, "en", "en")])
        return simuleval_instances(report, target_lang="en")[0]["prediction"]

    assert languages.word_joiner("zh-Hans") == "" and languages.word_joiner("en") == " "
    assert units.split_units("ab cd", "en") == ["ab", "cd"]
    assert display_text("ab", "cd", "en") == "ab cd"
    assert prediction("ab cd") == "ab cd"
    assert languages.drop_fillers("um hello", "en") == "hello"

    monkeypatch.setattr(languages, "WITHOUT_SPACES", frozenset({"zh", "en"}))
    assert languages.word_joiner("en") == "" and languages.written_without_spaces("eng")
    assert units.split_units("ab cd", "en") == ["ab", "cd"]  # Latin runs stay whole
    assert units.split_units("ab,cd", "en") == ["ab", ",", "cd"]  # punctuation: a unit
    assert display_text("ab", "cd", "en") == "abcd"
    assert prediction("ab cd") == "abcd"
    assert languages.drop_fillers("um hello", "en") == "um hello"  # by character now


def test_text_in_another_script_than_the_source_language_is_told_apart() -> None:
    from engine.languages import in_other_script

    assert in_other_script("我们三点钟见汤姆", "en")
    assert in_other_script("我们三点钟见 Tom", "en")  # mostly ideographs
    assert not in_other_script("I will meet 汤姆 at three", "en")
    assert in_other_script("I will meet Tom at three", "zh")
    assert not in_other_script("我们三点钟见 Tom", "zh")
    assert not in_other_script("Ich werde Tom treffen", "de")
    # Chinese quotes Latin and numbers freely: still Chinese.
    assert not in_other_script("802.11n 标准在 2.4Ghz 和 5.0Ghz 频率上都可运行。", "zh")
    assert not in_other_script("Tom 和 Jack 去 IKEA", "zh")
    assert not in_other_script("", "en") and not in_other_script("我们", None)


def test_an_ascii_texts_ideograph_share_is_that_of_the_character_by_character_count() -> None:
    """ASCII text takes a shortcut (no ideograph is ASCII); the answer is the same as the
    count over its characters: 0 with letters, None without."""
    from engine.languages import ideograph_share

    for text in ["", "  ", "802.11 & 5.0", "Tom reads a book", "x", "2.4Ghz", "Lily 读书"]:
        letters = [ch for ch in text if ch.isalpha()]
        ideographs = [ch for ch in letters if "\u4e00" <= ch <= "\u9fff"]
        expected = len(ideographs) / len(letters) if letters else None
        assert ideograph_share(text) == expected, text


def test_clean_normalises_whatever_dropping_fillers_leaves() -> None:
    from engine.streaming.session import StreamingOptions, normalize_source

    options = StreamingOptions()
    cases = [
        "um so this is, uh, a test",
        "Um, hello",
        "嗯 我们 呃 去",
        "  a   b ",
        "plain text",
        "uh",
    ]
    for text in cases:
        for lang in ("en", "zh", "de"):
            expected = normalize_source(languages.drop_fillers(normalize_source(text), lang))
            assert options.clean(text, lang) == expected, (text, lang)
    assert options.clean("嗯 我们 呃 去", "zh") == "我们 去"
    assert options.clean("so um  this", "en") == "so this"
