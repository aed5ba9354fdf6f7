"""Transcript logs (`engine.logs`): synthetic logs' shape, determinism and ASR-like
behaviour, file handling and merging."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from engine.evaluation.metrics import (
    SegmentTrace,
    UpdatePoint,
    segment_audio_span,
)
from engine.evaluation.report import build_report
from engine.evaluation.revisions import source_revisions
from engine.evaluation.units import split_units
from engine.logs.format import (
    TranscriptLogError,
    read_log,
    read_references,
    references_output_path,
    segment_order,
    validate_message,
    write_log,
)
from engine.logs.make import AsrStyle, generate_log, make_log_files
from engine.logs.merge import interleave_logs
from tests.conftest import FIXTURE_DIR, FLORES, ROOT, shared_absent

EN = [
    "I will go home now.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Scientists announced yesterday that the mice were no longer diabetic.",
    "He added that the research is still in its early days.",
]
ZH = [
    "他补充道：“我们现在有 4 个月大没有糖尿病的老鼠。”",
    "这项研究仍处在早期阶段，COVID-19 的影响还不清楚。",
    "和其他一些专家一样，他对糖尿病能否治愈持怀疑态度。",
]


def is_prefix(a: list[str], b: list[str]) -> bool:
    return a == b[: len(a)]


def segments(lines: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        out.setdefault(line["segment_id"], []).append(line)
    return out


def check_log(lines: list[dict[str, Any]], sources: list[str], lang: str) -> int:
    """Every invariant a replay relies on; returns the number of revised partials."""
    assert [line["seq"] for line in lines] == list(range(len(lines)))
    emits = [line["emit_ms"] for line in lines]
    assert emits == sorted(emits)
    segs = segments(lines)
    assert list(segs) == list(range(len(sources)))
    revised = 0
    prev_end = -1.0
    for sid, msgs in segs.items():
        finals = [m for m in msgs if m["is_final"]]
        assert len(finals) == 1 and msgs[-1] is finals[0]
        final = finals[0]
        assert final["text"] == sources[sid].strip()
        assert final["start_ms"] >= prev_end  # segments follow each other on one clock
        prev_end = final["end_ms"]
        final_units = split_units(final["text"], lang)
        for i, m in enumerate(msgs):
            assert m["start_ms"] == final["start_ms"]
            assert m["start_ms"] <= m["end_ms"] <= final["end_ms"]
            assert m["emit_ms"] > m["end_ms"]  # the ASR needs some time after the audio
            units = split_units(m["text"], lang)
            if is_prefix(units, final_units):
                assert final["text"].startswith(m["text"])
                continue
            # a revision: only the last unit is wrong, and the next message fixes it
            revised += 1
            assert is_prefix(units[:-1], final_units)
            nxt = split_units(msgs[i + 1]["text"], lang)
            assert is_prefix(nxt, final_units) and len(nxt) == len(units)
    return revised


def test_english_log_invariants_and_pacing() -> None:
    lines = generate_log(EN, "en", seed=3, revision_rate=0.3, repeat_rate=0.2)
    assert check_log(lines, EN, "en") > 0
    assert all(line["stream_id"] == "s1" and line["type"] == "partial_transcript" for line in lines)
    for sid, msgs in segments(lines).items():
        # word by word: the correct partials grow by exactly one word
        sizes = [len(m["text"].split()) for m in msgs if not m["is_final"]]
        distinct = sorted(set(sizes))
        assert distinct == list(range(1, len(EN[sid].split()) + 1))
        final = msgs[-1]
        per_word = (final["end_ms"] - final["start_ms"]) / len(EN[sid].split())
        assert 350 * 0.7 <= per_word <= 350 * 1.3


def test_chinese_log_reveals_one_to_three_characters() -> None:
    lines = generate_log(ZH, "zh", seed=5, revision_rate=0.3, repeat_rate=0.2)
    assert check_log(lines, ZH, "zh") > 0
    for msgs in segments(lines).values():
        final_units = split_units(msgs[-1]["text"], "zh")
        counts = [0]
        for m in msgs:
            units = split_units(m["text"], "zh")
            if is_prefix(units, final_units) and len(units) != counts[-1]:
                counts.append(len(units))
        steps = [b - a for a, b in pairwise(counts)]
        assert steps and all(1 <= s <= 3 for s in steps)
        assert counts[-1] == len(final_units)
        # ~200 ms per character (punctuation is shorter, Latin runs longer)
        final = msgs[-1]
        per_char = (final["end_ms"] - final["start_ms"]) / len(final_units)
        assert 200 * 0.5 <= per_char <= 200 * 1.3


def test_deterministic_for_a_seed() -> None:
    assert generate_log(EN, "en", seed=11) == generate_log(EN, "en", seed=11)
    assert generate_log(ZH, "zho", seed=11) == generate_log(ZH, "zh", seed=11)
    assert generate_log(EN, "en", seed=11) != generate_log(EN, "en", seed=12)


def test_repeats_re_emit_identical_text() -> None:
    lines = generate_log(EN, "en", seed=1, revision_rate=0.0, repeat_rate=0.5)
    repeats = [(a, b) for a, b in pairwise(lines) if a["text"] == b["text"] and not b["is_final"]]
    assert repeats
    assert all(b["end_ms"] >= a["end_ms"] and b["emit_ms"] >= a["emit_ms"] for a, b in repeats)
    assert check_log(lines, EN, "en") == 0  # no revisions at rate 0


def test_no_revision_or_repeat_gives_one_partial_per_step() -> None:
    lines = generate_log(["a b c"], "en", revision_rate=0.0, repeat_rate=0.0)
    assert [(m["text"], m["is_final"]) for m in lines] == [
        ("a", False),
        ("a b", False),
        ("a b c", False),
        ("a b c", True),
    ]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="source 1 is empty"):
        generate_log(["a", "  "], "en")
    with pytest.raises(ValueError, match="revision_rate"):
        generate_log(["a"], "en", revision_rate=1.5)
    with pytest.raises(ValueError, match="unsupported language"):
        generate_log(["a"], "xx")


# ---------------------------------------------------------------------------------------
# Files


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    lines = generate_log(ZH, "zh", seed=2)
    path = tmp_path / "log.jsonl"
    assert write_log(path, lines) == len(lines)
    assert read_log(path) == lines
    assert "糖尿病" in path.read_text(encoding="utf-8")  # written as UTF-8, not \\u escapes


def test_malformed_lines_name_the_line(tmp_path: Path) -> None:
    good = json.dumps(generate_log(["a b"], "en")[0])
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n\n" + '{"type": "partial_transcript", oops\n', encoding="utf-8")
    with pytest.raises(TranscriptLogError, match=r"bad\.jsonl:3: invalid JSON"):
        read_log(path)

    missing = json.loads(good)
    del missing["text"]
    path.write_text(good + "\n" + json.dumps(missing) + "\n", encoding="utf-8")
    with pytest.raises(TranscriptLogError, match=r":2: missing field 'text'"):
        read_log(path)

    # The message fields are the protocol's checks (PartialTranscript), so a log is refused
    # for exactly what replay would refuse, e.g. an empty final.
    for changes, why in [
        ({"is_final": "no"}, "is_final must be a boolean"),
        ({"seq": -1}, "seq must be between 0 and"),
        ({"segment_id": True}, "segment_id must be an integer"),
        ({"emit_ms": "soon"}, "'emit_ms' must be a finite number"),
        ({"type": "translation_update"}, "'type' must be 'partial_transcript'"),
        ({"start_ms": 100.0, "end_ms": 50.0}, r"end_ms \(50.0\) is before start_ms"),
        ({"is_final": True, "text": ""}, "text must not be empty in a final transcript"),
    ]:
        bad = {**json.loads(good), **changes}
        path.write_text(json.dumps(bad) + "\n", encoding="utf-8")
        with pytest.raises(TranscriptLogError, match=rf":1: {why}"):
            read_log(path)

    path.write_text("[1, 2]\n", encoding="utf-8")
    with pytest.raises(TranscriptLogError, match=":1: expected a JSON object"):
        read_log(path)


def test_write_log_rejects_bad_lines_before_writing(tmp_path: Path) -> None:
    lines = generate_log(["a b"], "en")
    lines[1] = {**lines[1], "text": None}
    path = tmp_path / "out.jsonl"
    with pytest.raises(TranscriptLogError, match=r"out\.jsonl:2: text must be a string"):
        write_log(path, lines)
    assert not path.exists()


def test_audio_times_are_optional() -> None:

    line = generate_log(["a"], "en")[0]
    del line["start_ms"], line["end_ms"]
    assert validate_message(line) is line


def test_read_references(tmp_path: Path) -> None:
    path = tmp_path / "refs.txt"
    path.write_text("第一句。\n second one \n\nlast\n", encoding="utf-8")
    assert read_references(path) == ["第一句。", "second one", "", "last"]


def test_make_log_files(tmp_path: Path) -> None:
    src = tmp_path / "src.en"
    refs = tmp_path / "refs.zh"
    src.write_text("\n".join(EN) + "\n", encoding="utf-8")
    refs.write_text("一。\n二。\n三。\n四。\n", encoding="utf-8")
    out = tmp_path / "log.jsonl"
    assert make_log_files(src, out, "eng_Latn", references_path=refs, limit=2, seed=4) == 2
    lines = read_log(out)
    assert lines == generate_log(EN[:2], "en", seed=4)
    assert references_output_path(out) == tmp_path / "log.ref.txt"
    assert read_references(tmp_path / "log.ref.txt") == ["一。", "二。"]

    assert make_log_files(src, out, "en") == 4

    refs.write_text("一。\n", encoding="utf-8")
    with pytest.raises(TranscriptLogError, match="1 references for 4 source lines"):
        make_log_files(src, out, "en", references_path=refs)
    src.write_text("a\n\nb\n", encoding="utf-8")
    with pytest.raises(TranscriptLogError, match=r"src\.en:2: empty source line"):
        make_log_files(src, out, "en")
    with pytest.raises(ValueError, match="limit"):
        make_log_files(src, out, "en", limit=-1)


@pytest.mark.skipif(not FLORES.is_dir(), reason=shared_absent(FLORES))
@pytest.mark.parametrize(("name", "lang"), [("eng_Latn", "en"), ("zho_Hans", "zh")])
def test_flores_sentences(name: str, lang: str) -> None:
    sources = read_references(FLORES / f"{name}.devtest")[:20]
    lines = generate_log(sources, lang, seed=0)
    assert check_log(lines, sources, lang) > 0


def _echo_traces(lines: list[dict[str, Any]], *, wait_until_end: bool) -> list[SegmentTrace]:
    """Traces from a toy "translator" that shows the transcript itself, keeping all but its
    last word stable, 50 ms after each partial (or only answers finals)."""
    traces = []
    for sid, msgs in segments(lines).items():
        updates = [
            UpdatePoint(
                source_text=m["text"],
                text=m["text"],
                stable_text=m["text"] if m["is_final"] else " ".join(m["text"].split()[:-1]),
                is_final=m["is_final"],
                emit_ms=m["emit_ms"],
                done_ms=m["emit_ms"] + 50.0,
            )
            for m in msgs
            if m["is_final"] or not wait_until_end
        ]
        start, end = segment_audio_span(msgs)
        traces.append(SegmentTrace(updates, start, end, "en", "en", segment_id=sid))
    return traces


def test_metrics_on_a_generated_log() -> None:
    lines = generate_log(EN, "en", seed=3, revision_rate=0.3)
    echo = build_report(_echo_traces(lines, wait_until_end=False))
    batch = build_report(_echo_traces(lines, wait_until_end=True))
    lengths = [len(s.split()) for s in EN]
    # answering only finals lags the whole source; echoing lags about one word
    assert batch.al == pytest.approx(sum(lengths) / len(lengths))
    assert batch.normalized_erasure == 0.0 and batch.segments_with_early_stable == 0
    assert echo.al is not None and 0.9 <= echo.al <= 1.5
    assert echo.al_stable is not None and echo.al_stable > echo.al
    assert echo.normalized_erasure is not None and echo.normalized_erasure > 0  # ASR revisions
    assert echo.segments_with_early_stable == len(EN)
    assert echo.update_latency_p50_ms == pytest.approx(50.0)
    assert echo.laal_ms is not None and batch.laal_ms is not None
    assert echo.laal_ms < batch.laal_ms


# -- recogniser-style logs -------------------------------------------------------------


def _line(seg: int, seq: int, text: str, final: bool = False) -> dict[str, Any]:
    return {"stream_id": "s", "segment_id": seg, "seq": seq, "text": text, "is_final": final}


def test_source_revisions_tell_extensions_from_rewrites() -> None:
    lines = [
        _line(0, 0, "my"),
        _line(0, 1, "mike"),  # rewrites 1 shown word
        _line(0, 2, "mike ev"),
        _line(0, 3, "mike every"),  # completes a word heard in part: not a rewrite
        _line(0, 4, "mike every"),  # unchanged: not a change
        _line(0, 5, "my father every", final=True),  # the final rewrites "mike"
        _line(1, 6, "tom reads a book"),
        _line(1, 7, "tom read", final=True),  # drops "a book" and alters "reads": 3 units
    ]
    stats = source_revisions(lines, "en")
    assert (stats.segments, stats.changes, stats.revising_changes) == (2, 5, 3)
    assert stats.revised_units == 1 + 1 + 3
    assert stats.finals_differing == 2


def test_default_style_reproduces_the_committed_log() -> None:
    """The ASR style is off by default: the committed fixture log is still what it makes."""
    committed = read_log(ROOT / "examples" / "logs" / "fixture_en_zh.jsonl")
    rows = (FIXTURE_DIR / "heldout.tsv").read_text(encoding="utf-8").splitlines()
    segments = len({line["segment_id"] for line in committed})
    sources = [row.split("\t")[0] for row in rows][:segments]
    assert generate_log(sources, "en") == committed


def test_realistic_style_rewrites_shown_words_like_a_recogniser() -> None:
    rows = (FIXTURE_DIR / "heldout.tsv").read_text(encoding="utf-8").splitlines()
    sources = [row.split("\t")[0] for row in rows]
    lines = generate_log(sources, "en", seed=3, style=AsrStyle.realistic())
    finals = [line["text"] for line in lines if line["is_final"]]
    assert finals == [" ".join(s.lower().split()) for s in sources]  # finals are right
    assert all(line["text"] == line["text"].lower() for line in lines)
    stats = source_revisions(lines, "en")
    assert stats.revising_share is not None and 0.3 <= stats.revising_share <= 0.5
    assert 0.3 * len(sources) <= stats.finals_differing <= 0.6 * len(sources)
    assert 1.0 <= stats.revised_units / stats.revising_changes <= 1.6
    plain = source_revisions(generate_log(sources, "en", seed=3), "en")
    assert plain.finals_differing == 0 and (plain.revising_share or 0) < 0.15
    for line in lines:
        validate_message(line)  # every line is a valid protocol message


def test_style_drops_punctuation_in_chinese_too() -> None:
    lines = generate_log(["你好，世界。", "今天很好！"], "zh", style=AsrStyle(punctuation=False))
    assert [line["text"] for line in lines if line["is_final"]] == ["你好世界", "今天很好"]


def test_interleave_logs(tmp_path: Path) -> None:
    a = generate_log(["I will go home now.", "He added that."], "en", stream_id="a")
    b = generate_log(["The quick brown fox jumps."], "en", stream_id="b", seed=1)
    merged = interleave_logs(a, b)
    assert len(merged) == len(a) + len(b)
    assert [m["emit_ms"] for m in merged] == sorted(m["emit_ms"] for m in merged)
    assert [m for m in merged if m["stream_id"] == "a"] == a
    assert segment_order(merged)[0] in {("a", 0), ("b", 0)}
    write_log(tmp_path / "m.jsonl", merged)  # still a valid log
    with pytest.raises(ValueError, match="stream 'a' appears in logs 1 and 2"):
        interleave_logs(a, a)
