"""Subtitle files from finals: the layout rule (line length, lines per cue, reading speed,
no overlap) and files that independent parsers (srt, webvtt-py) read back as written."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.logs.format import read_log
from engine.subtitles import Cue, CueRules, Final, layout, wrap, write
from tests.conftest import FIXTURE_MODEL, ROOT, needs_fixture

LOG = ROOT / "examples" / "logs" / "fixture_two_streams.jsonl"


def test_wrap_breaks_latin_at_spaces_and_chinese_after_punctuation() -> None:
    lines = wrap("the quick brown fox jumps over the lazy dog again and again", 20)
    assert lines == ["the quick brown fox", "jumps over the lazy", "dog again and again"]
    assert all(len(line) <= 20 for line in lines)
    assert wrap("supercalifragilistic word", 10) == ["supercalifragilistic", "word"]
    zh = "我们今天下午三点，在图书馆见面吧。然后一起去吃饭"
    lines = wrap(zh, 10)
    assert lines[0] == "我们今天下午三点，"  # the comma is near the limit: break after it
    assert "".join(lines) == zh and all(len(line) <= 10 for line in lines)


def check_cues(cues: list[Cue], rules: CueRules, finals: list[Final]) -> None:
    for a, b in pairwise(cues):
        assert a.end_ms <= b.start_ms, (a, b)  # no overlap
    for cue in cues:
        assert 1 <= len(cue.lines) <= rules.max_lines
        assert cue.end_ms - cue.start_ms <= rules.max_duration_ms
        max_chars, _ = rules.for_text(cue.text)
        assert all(len(line) <= max_chars for line in cue.lines)
    starts = {cue.start_ms for cue in cues}
    assert all(round(f.start_ms) in starts for f in finals)  # each final starts on time


def test_long_finals_become_several_cues_in_their_speech_span() -> None:
    text = "我们今天下午三点在图书馆见面然后一起去吃饭再去看一场电影最后坐火车回家休息"
    finals = [Final(1000, 9000, text), Final(9400, 10000, "好的"), Final(20000, 20500, "再见")]
    rules = CueRules()
    cues = layout(finals, rules)
    check_cues(cues, rules, finals)
    first = [c for c in cues if 1000 <= c.start_ms < 9000]
    assert len(first) == 2 and "".join(c.text.replace("\n", "") for c in first) == text
    assert first[1].start_ms < 9000 and first[1].end_ms <= 9400 - rules.gap_ms
    # "好的" is spoken in 0.6 s but held for the minimum duration; "再见" too, then nothing
    short = next(c for c in cues if c.text == "好的")
    assert short.end_ms - short.start_ms == pytest.approx(rules.min_duration_ms, abs=1)
    # Reading speed: a long Latin sentence in a short span runs into the following silence.
    latin = "I will meet Tom at three in the library with my friend from school"
    cue = layout([Final(0, 1000, latin)], rules)
    shown = sum(len(line) for line in cue[0].lines)
    assert len(cue) == 1 and cue[0].end_ms >= shown / 17 * 1000 - 1 > 1000


def test_replay_writes_files_that_independent_parsers_read(tmp_path: Path) -> None:
    srt = pytest.importorskip("srt")
    webvtt = pytest.importorskip("webvtt")
    needs_fixture()
    out = tmp_path / "subs.vtt"
    argv = ["replay", "--model", str(FIXTURE_MODEL), str(LOG), "--out", str(tmp_path / "u")]
    assert main([*argv, "--vtt", str(out), "--srt", str(tmp_path / "subs.srt")]) == 0
    lines = read_log(LOG)
    for stream in ("left", "right"):
        finals = [line for line in lines if line["is_final"] and line["stream_id"] == stream]
        vtt = list(webvtt.read(str(tmp_path / f"subs.{stream}.vtt")))
        with open(tmp_path / f"subs.{stream}.srt", encoding="utf-8") as f:
            subs = list(srt.parse(f.read()))
        assert len(vtt) == len(subs) == len(finals)  # the fixture's finals fit one cue each
        for final, v, s in zip(finals, vtt, subs, strict=True):
            assert round(s.start.total_seconds() * 1000) == round(final["start_ms"])
            assert v.start_time.in_milliseconds() == round(final["start_ms"])
            assert s.content == v.text and s.content  # a translation, the same in both
            assert s.end > s.start


def test_unknown_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vtt or srt"):
        write(tmp_path / "subs.txt", [])
