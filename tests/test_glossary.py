"""Glossary files and matching (engine/glossary.py): every kind of bad line is named with
its line number; matching is case/punctuation-insensitive, whole-word, longest first,
and waits for a partial's last word to be complete."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.glossary import MAX_ENTRIES, MAX_TERM_CHARS, Glossary, GlossaryError, merged

GOOD = "en\tde\n# names\nTom\tThomas\nNew York\tNeu-York\nNew York City\tNYC-Stadt\n\nAcme\n"


def test_parse_pairs_and_do_not_translate() -> None:
    g = Glossary.parse(GOOD)
    assert (g.source_lang, g.target_lang) == ("en", "de")
    assert len(g) == 4
    acme = next(t for t in g.terms if t.source == "Acme")
    assert acme.keep and acme.target == "Acme"


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("", None, "empty"),
        ("Tom\tThomas\n", 1, "first line must name the languages"),
        ("en\n", 1, "first line must name the languages"),
        ("en\tdeutsch!\n", 1, "not a language code"),
        ("en\tde\nTom\tThomas\tx\n", 2, "3 tab-separated fields"),
        ("en\tde\n\tThomas\n", 2, "empty source term"),
        ("en\tde\nTom\t\n", 2, "empty target"),
        ("en\tde\n...\tPunkte\n", 2, "no word to match"),
        ("en\tde\nTom\tThomas\ntom\tTommy\n", 3, "already translated as 'Thomas'"),
        ("en\tde\nTom\tTho\x07mas\n", 2, "control character U+0007"),
        (f"en\tde\nTom\t{'x' * (MAX_TERM_CHARS + 1)}\n", 2, "characters"),
        ("en\tde\n" + "a " * 17 + "\tb\n", 2, "17 words long"),
    ],
)
def test_bad_lines(text: str, line: int | None, message: str) -> None:
    with pytest.raises(GlossaryError) as caught:
        Glossary.parse(text, where="g.tsv")
    error = str(caught.value)
    assert "\n" not in error
    assert message in error
    if line is not None:
        assert error.startswith(f"g.tsv:{line}: ")


def test_too_many_entries() -> None:
    text = "en\tde\n" + "".join(f"w{i}\tz{i}\n" for i in range(MAX_ENTRIES + 1))
    with pytest.raises(GlossaryError, match=rf"g.tsv:{MAX_ENTRIES + 2}: more than {MAX_ENTRIES}"):
        Glossary.parse(text, where="g.tsv")


def test_same_pair_twice_is_kept_once() -> None:
    assert len(Glossary.parse("en\tde\nTom\tThomas\ntom\tThomas\n")) == 1


def test_read_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"en\tde\nTom\tTh\xffomas\n")
    with pytest.raises(GlossaryError, match=r"bad.tsv:2: not UTF-8"):
        Glossary.read(bad)
    with pytest.raises(GlossaryError, match=r"missing\.tsv"):
        Glossary.read(tmp_path / "missing.tsv")
    good = tmp_path / "good.tsv"
    good.write_text("\ufeff" + GOOD, encoding="utf-8")  # a BOM as spreadsheets write it
    assert len(Glossary.read(good)) == 4


def test_match_is_case_and_punctuation_insensitive_whole_words_longest_first() -> None:
    g = Glossary.parse(GOOD)
    found = g.match("Um, I met TOM, in new-york city... and Tomorrow Acme's")
    assert [(m.term.source, m.start, m.end) for m in found] == [
        ("Tom", 2, 3),
        ("New York City", 4, 7),
    ]  # "Tomorrow" is not "Tom"; "Acme's" is one word, not "Acme"
    assert g.targets("in New York now") == ["Neu-York"]
    assert g.targets("um tom uh tom") == ["Thomas"]  # fillers skipped, each target once


def test_partial_counts_a_term_once_its_source_is_complete() -> None:
    g = Glossary.parse(GOOD)
    assert g.targets("I met Tom", partial=True) == []  # may become "Tomorrow"
    assert g.targets("I met Tom ", partial=True) == ["Thomas"]
    assert g.targets("I met Tom,", partial=True) == ["Thomas"]
    assert g.targets("I met Tom and", partial=True) == ["Thomas"]
    assert g.targets("I met Tom") == ["Thomas"]  # a final is complete


def test_unspaced_source_matches_characters() -> None:
    g = Glossary.parse("zh\ten\n汤姆\tThomas\n")
    assert g.targets("我见汤姆了") == ["Thomas"]
    assert g.targets("我见汤姆", partial=True) == []


def test_merged_later_wins() -> None:
    a = Glossary.parse("en\tde\nTom\tThomas\nAnna\tAnne\n")
    b = Glossary.parse("en\tde\ntom\tTommy\n")
    assert sorted(t.target for t in merged([a, b]).terms) == ["Anne", "Tommy"]
    with pytest.raises(GlossaryError):
        merged([a, Glossary.parse("en\tzh\nTom\t汤米\n")])
