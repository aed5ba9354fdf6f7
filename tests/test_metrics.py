"""Streaming metrics checked against small examples worked out by hand."""

from __future__ import annotations

import json
import math

import pytest

from engine.evaluation.metrics import (
    SegmentTrace,
    UpdatePoint,
    average_lagging,
    corpus_quality,
    differentiable_average_lagging,
    display_text,
    erased_units,
    first_stable_updates,
    length_adaptive_average_lagging,
    normalized_erasure,
    percentile,
    real_time_factor,
    segment_audio_span,
    segment_metrics,
    simulated_done_times,
    unit_delays,
    update_compute_ms,
    yet_another_average_lagging,
)
from engine.evaluation.report import build_report
from engine.evaluation.units import count_units, guess_lang, normalize_lang, split_units


def up(
    source: str,
    text: str,
    stable: str = "",
    *,
    final: bool = False,
    emit: float = 0.0,
    done: float = 0.0,
    compute: float | None = None,
) -> UpdatePoint:
    return UpdatePoint(source, text, stable, final, emit, done, compute)


def example_trace(reference: str | None = None) -> SegmentTrace:
    """4-word source, 3-unit output; the first guess "x" is erased.

    update  source read  displayed  stable   emit   done
    t0      a      (1)   x          -         500    600
    t1      a b    (2)   A          -         900   1000
    t2      a b c  (3)   A B        A        1400   1500
    t3 fin  a b c d(4)   A B C      A B C    2300   2400
    Audio 0..2000 ms on the emit clock.
    """
    return SegmentTrace(
        updates=[
            up("a", "x", emit=500, done=600),
            up("a b", "A", emit=900, done=1000),
            up("a b c", "A B", "A", emit=1400, done=1500),
            up("a b c d", "A B C", "A B C", final=True, emit=2300, done=2400),
        ],
        audio_start_ms=0.0,
        audio_end_ms=2000.0,
        source_lang="en",
        target_lang="en",
        reference=reference,
        segment_id=7,
    )


# ---------------------------------------------------------------------------------------
# Units


def test_english_units_are_whitespace_words() -> None:
    assert split_units("  I will  go home. ", "en") == ["I", "will", "go", "home."]
    assert split_units("", "en") == []


def test_chinese_units_are_characters_with_latin_runs_whole_and_no_spaces() -> None:
    # 我 们 有 4 个 月 大 的 COVID - 19 老 鼠 。 -> 14 units; the spaces count for nothing.
    text = "我们有 4 个月大的COVID-19老鼠。"
    assert split_units(text, "zh") == [
        "我", "们", "有", "4", "个", "月", "大", "的", "COVID", "-", "19", "老", "鼠", "。",
    ]  # fmt: skip
    assert count_units(text, "zh") == 14


def test_chinese_punctuation_each_counts() -> None:
    assert split_units("他说：“好。”", "zh") == ["他", "说", "：", "“", "好", "。", "”"]


def test_language_aliases_and_guess() -> None:
    assert [normalize_lang(x) for x in ("en", "eng", "eng_Latn", "EN-us")] == ["en"] * 4
    assert [normalize_lang(x) for x in ("zh", "zho", "cmn", "zho_Hans", "zh-CN")] == ["zh"] * 5
    assert normalize_lang("de") == "en"  # counted in words
    with pytest.raises(ValueError, match="unsupported language 'xx'"):
        normalize_lang("xx")
    assert guess_lang("我们现在有 4 个月大的老鼠") == "zh"
    assert guess_lang("He visited 北京 last year with his family") == "en"
    assert guess_lang("") == "en"
    assert split_units("我们 走") == ["我", "们", "走"]  # guessed as Chinese


# ---------------------------------------------------------------------------------------
# Lagging formulas


def test_al_laal_dal_by_hand() -> None:
    d = [2.0, 3.0, 4.0]  # |X| = 4, |Y| = 3
    # AL: gamma = 3/4, 1/gamma = 4/3; tau = 3 (first d_i = 4)
    #   (2 - 0) + (3 - 4/3) + (4 - 8/3) = 2 + 5/3 + 4/3 = 5  ->  5 / 3
    assert average_lagging(d, 4) == pytest.approx(5 / 3)
    # LAAL with |Y*| = 5: gamma = 5/4, 1/gamma = 0.8
    #   (2 - 0) + (3 - 0.8) + (4 - 1.6) = 6.6  ->  6.6 / 3 = 2.2
    assert length_adaptive_average_lagging(d, 4, 5) == pytest.approx(2.2)
    # LAAL with a shorter reference uses |Y| = 3, i.e. equals AL
    assert length_adaptive_average_lagging(d, 4, 2) == pytest.approx(5 / 3)
    assert length_adaptive_average_lagging(d, 4) == pytest.approx(5 / 3)
    # DAL: d'_1 = 2, d'_2 = max(3, 2 + 4/3) = 10/3, d'_3 = max(4, 10/3 + 4/3) = 14/3
    #   (2 - 0) + (10/3 - 4/3) + (14/3 - 8/3) = 6  ->  6 / 3 = 2
    assert differentiable_average_lagging(d, 4) == pytest.approx(2.0)


def test_tau_cuts_off_units_after_the_whole_source() -> None:
    # |X| = 2, |Y| = 4, d = [1, 2, 2, 2]: gamma = 2, tau = 2
    #   (1 - 0) + (2 - 0.5) = 2.5  ->  2.5 / 2 = 1.25 (units 3 and 4 are ignored)
    assert average_lagging([1, 2, 2, 2], 2) == pytest.approx(1.25)
    # DAL keeps them: d' = 1, 2, 2.5, 3; minus (i-1)/gamma = 0, .5, 1, 1.5 -> 1+1.5+1.5+1.5
    assert differentiable_average_lagging([1, 2, 2, 2], 2) == pytest.approx(5.5 / 4)


def test_wait_until_end_lags_the_whole_source() -> None:
    # every d_i = |X| = 4: tau = 1 -> AL = 4 - 0 = 4
    assert average_lagging([4, 4, 4], 4) == pytest.approx(4.0)
    # DAL: d' = 4, 16/3, 20/3 minus 0, 4/3, 8/3 -> 4 each -> 4
    assert differentiable_average_lagging([4, 4, 4], 4) == pytest.approx(4.0)


def test_perfectly_simultaneous_policy_lags_zero() -> None:
    # d_i = (i-1)/gamma exactly (the ideal diagonal): every term is 0
    assert average_lagging([0, 1, 2, 3], 4) == pytest.approx(0.0)
    assert differentiable_average_lagging([0, 1, 2, 3], 4) == pytest.approx(0.0)
    # wait-1 (one unit out per unit read) is one unit behind the diagonal
    assert average_lagging([1, 2, 3, 4], 4) == pytest.approx(1.0)


def test_yaal_and_long_yaal_by_hand() -> None:
    d = [2.0, 3.0, 4.0, 4.0]  # |X| = 4, |Y| = 4, |Y*| = 5: gamma = 5/4, 1/gamma = 0.8
    # YAAL counts only units before the source ended (d < 4): (2 - 0) + (3 - 0.8) = 4.2
    assert yet_another_average_lagging(d, 4, 5) == pytest.approx(4.2 / 2)
    # LAAL also counts the first unit at the end: 4.2 + (4 - 1.6) = 6.6 -> 2.2
    assert length_adaptive_average_lagging(d, 4, 5) == pytest.approx(2.2)
    # LongYAAL counts until the recording ends (here 4.5 after this segment's start):
    #   4.2 + (4 - 1.6) + (4 - 2.4) = 8.2 over 4 units
    assert yet_another_average_lagging(d, 4, 5, cutoff=4.5) == pytest.approx(8.2 / 4)
    # A segment with nothing out before its end is left out, not scored.
    assert yet_another_average_lagging([4.0, 4.0], 4) is None
    # ...unless long-form: gamma = 2/4, (4 - 0) + (4 - 2) = 6 over 2 units
    assert yet_another_average_lagging([4.0, 4.0], 4, cutoff=5.0) == pytest.approx(3.0)


def test_yaal_agrees_with_omnisteval() -> None:
    """OmniSTEval's own scorer on the same delays (short- and long-form)."""
    scoring = pytest.importorskip("omnisteval.scoring")
    from omnisteval.data import Instance

    cases = [
        ([0.5, 1.0, 2.5, 4.0, 4.0], 4.0, 6, None),
        ([1200.0, 1900.0, 2600.0, 3100.0], 3000.0, 3, 5000.0),
        ([300.0, 300.0, 2000.0], 1800.0, 4, 2500.0),
        ([2500.0, 2600.0], 2000.0, 2, 9000.0),
    ]
    for delays, source_len, ref_len, recording_end in cases:
        instance = Instance(
            prediction="x",
            reference="x" * ref_len,
            latency_unit="char",
            source_length=source_len,
            emission_cu=list(delays),
            time_to_recording_end=recording_end,
        )
        short = scoring.YAALScorer(is_longform=False).compute(instance)
        long = scoring.YAALScorer(is_longform=True).compute(instance)
        cutoff = math.inf if recording_end is None else recording_end
        assert yet_another_average_lagging(delays, source_len, ref_len) == (
            pytest.approx(short) if short is not None else None
        )
        assert yet_another_average_lagging(delays, source_len, ref_len, cutoff=cutoff) == (
            pytest.approx(long) if long is not None else None
        )


def test_undefined_lagging_is_none() -> None:
    assert average_lagging([], 4) is None
    assert length_adaptive_average_lagging([], 4, 3) is None
    assert differentiable_average_lagging([], 4) is None
    assert average_lagging([1.0], 0) is None


# ---------------------------------------------------------------------------------------
# Stability of displayed prefixes and erasure


def test_first_stable_updates_handles_flicker() -> None:
    # "A B" is shown at t1, withdrawn at t2, shown again at t3: B only counts from t3
    outputs = [["A"], ["A", "B"], ["A"], ["A", "B"]]
    assert first_stable_updates(outputs) == [0, 3]
    assert unit_delays(outputs, [1, 2, 3, 4]) == [1.0, 4.0]
    with pytest.raises(ValueError, match="4 outputs but 3"):
        unit_delays(outputs, [1, 2, 3])


def test_erasure_with_a_revision() -> None:
    outputs = [["the", "cat", "sat"], ["the", "dog"], ["the", "dog", "sat", "down"]]
    # t1: |o0| = 3, LCP = 1 ("the") -> 2 erased; t2: |o1| = 2, LCP = 2 -> 0 erased
    assert erased_units(outputs) == 2
    assert normalized_erasure(outputs) == pytest.approx(2 / 4)
    assert normalized_erasure([["a"], []]) is None
    assert erased_units([["a"]]) == 0


# ---------------------------------------------------------------------------------------
# Per-segment metrics from update traces


def test_segment_metrics_by_hand() -> None:
    m = segment_metrics(example_trace())
    assert (m.source_units, m.target_units, m.updates, m.segment_id) == (4, 3, 4, 7)
    # displayed: A settles at t1 (2 read), B at t2 (3), C at t3 (final = 4) -> d = [2, 3, 4]
    assert m.al == pytest.approx(5 / 3)
    assert m.laal == pytest.approx(5 / 3)
    assert m.dal == pytest.approx(2.0)
    # stable: A promised at t2 (3 read), B and C only by the final (4) -> d = [3, 4, 4]
    # gamma = 3/4, tau = 2: (3 - 0) + (4 - 4/3) = 17/3 -> 17/6
    assert m.al_stable == pytest.approx(17 / 6)
    # ms: d = done - audio start = [1000, 1500, 2400], |X| = 2000 ms, 1/gamma = 2000/3
    # tau = 3: 1000 + (1500 - 666.67) + (2400 - 1333.33) = 2900 -> 966.67
    assert m.laal_ms == pytest.approx(2900 / 3)
    # stable ms: d = [1500, 2400, 2400], tau = 2: 1500 + (2400 - 666.67) -> 1616.67
    assert m.laal_ms_stable == pytest.approx((1500 + 2400 - 2000 / 3) / 2)
    # "x" -> "A" erases 1 unit; the final has 3 units
    assert m.erased_units == 1
    assert m.normalized_erasure == pytest.approx(1 / 3)
    assert m.early_stable and not m.revised_final and m.stable_retractions == 0
    assert m.update_latencies_ms == (100.0, 100.0, 100.0, 100.0)
    assert m.audio_ms == 2000.0
    assert m.compute_ms == pytest.approx(400.0)  # no compute given: done - max(emit, prev)


def test_reference_length_enters_laal() -> None:
    m = segment_metrics(example_trace(reference="A B C D E"))
    assert m.laal == pytest.approx(2.2)  # see test_al_laal_dal_by_hand
    assert m.al == pytest.approx(5 / 3)


def test_single_final_update_is_wait_until_end() -> None:
    trace = SegmentTrace(
        [up("a b c d", "A B C", "A B C", final=True, emit=2000, done=2300)],
        0.0, 2000.0, "en", "en",
    )  # fmt: skip
    m = segment_metrics(trace)
    assert m.al == pytest.approx(4.0)  # = |X|
    assert m.dal == pytest.approx(4.0)
    assert m.al_stable == pytest.approx(4.0)
    # ms: every d = 2300 >= 2000: tau = 1 -> 2300
    assert m.laal_ms == pytest.approx(2300.0)
    assert m.erased_units == 0 and m.normalized_erasure == 0.0
    assert not m.early_stable and not m.revised_final


def test_wait_one_trace_lags_one_unit() -> None:
    src = ["a", "a b", "a b c", "a b c d"]
    out = ["A", "A B", "A B C", "A B C D"]
    trace = SegmentTrace(
        [up(s, o, o, final=i == 3) for i, (s, o) in enumerate(zip(src, out, strict=True))],
        0.0, 1.0, "en", "en",
    )  # fmt: skip
    m = segment_metrics(trace)
    assert m.al == pytest.approx(1.0)
    assert m.al_stable == pytest.approx(1.0)
    assert m.normalized_erasure == 0.0


def test_read_position_is_cumulative_and_capped() -> None:
    # The ASR briefly shows 5 words, then 2 (revision), then the 4-word final.
    trace = SegmentTrace(
        [
            up("a b c d e", "A"),
            up("a b", "A B"),
            up("a b c d", "A B", final=True),
        ],
        0.0, 1.0, "en", "en",
    )  # fmt: skip
    m = segment_metrics(trace)
    # reads: min(4, 5) = 4, max(4, 2) = 4, final 4 -> d = [4, 4]; tau = 1 -> AL = 4
    assert m.al == pytest.approx(4.0)


def test_empty_output_and_empty_trace() -> None:
    m = segment_metrics(
        SegmentTrace([up("a b", "x"), up("a b", "", final=True)], 0.0, 500.0, "en", "en")
    )
    assert m.target_units == 0
    assert m.al is None and m.laal is None and m.dal is None and m.laal_ms is None
    assert m.erased_units == 1 and m.normalized_erasure is None
    empty = segment_metrics(SegmentTrace([], 0.0, 500.0, "en", "en"))
    assert empty.updates == 0 and empty.al is None and empty.audio_ms == 500.0


def test_stability_counters() -> None:
    trace = SegmentTrace(
        [
            up("a", "A", ""),
            up("a b", "A B", "A B"),
            up("a b c", "A D", "A"),  # stable "A B" withdrawn: a retraction
            up("a b c", "A D E", "A D"),
            up("a b c d", "A X Y", "A X Y", final=True),  # does not extend "A D": revised
        ],
        0.0, 1.0, "en", "en",
    )  # fmt: skip
    m = segment_metrics(trace)
    assert m.early_stable
    assert m.stable_retractions == 1
    assert m.revised_final


def test_chinese_target_counts_characters() -> None:
    trace = SegmentTrace(
        [
            up("We", "我们走", "", emit=100, done=150),
            up("We went", "我们去了", "我们", emit=400, done=450),
            up("We went home", "我们去了家", "我们去了家", final=True, emit=900, done=950),
        ],
        0.0, 800.0, "en", "zh",
    )  # fmt: skip
    m = segment_metrics(trace)
    assert m.target_units == 5
    # 我们走 -> 我们去了: LCP 2, erased 3 - 2 = 1 -> NE = 1/5
    assert m.erased_units == 1
    assert m.normalized_erasure == pytest.approx(0.2)
    # 我 们 settle at t0 (1 word read), 去 了 at t1 (2), 家 at the final (3): d = [1,1,2,2,3]
    # gamma = 5/3, 1/gamma = 0.6; tau = 5: 1 + 0.4 + 0.8 + 0.2 + 0.6 = 3.0 -> 0.6
    assert m.al == pytest.approx(0.6)


def test_display_text_joins_stable_and_unstable() -> None:
    assert display_text("I will", "go home", "en") == "I will go home"
    assert display_text("I will ", "go", "en") == "I will go"
    assert display_text("", "go", "en") == "go"
    assert display_text("我们", "去了", "zh") == "我们去了"
    assert display_text("我们", "去了") == "我们去了"


# ---------------------------------------------------------------------------------------
# Times, speed, quality, corpus report


def test_simulated_clock_and_compute_recovery() -> None:
    # engine free at 0: 0+120 = 120; next arrives 100 but waits: 120+30 = 150; 150+10 = 160
    done = simulated_done_times([0, 100, 150], [120, 30, 10])
    assert done == [120.0, 150.0, 160.0]
    ups = [up("a", "A", emit=e, done=d) for e, d in zip([0, 100, 150], done, strict=True)]
    assert update_compute_ms(ups) == pytest.approx([120.0, 30.0, 10.0])
    assert real_time_factor(160.0, 1600.0) == pytest.approx(0.1)
    assert real_time_factor(1.0, 0.0) is None


def test_segment_audio_span_conventions() -> None:
    partials = [
        {"start_ms": 0.0, "end_ms": 600.0, "emit_ms": 650.0},
        {"start_ms": 0.0, "end_ms": 1800.0, "emit_ms": 2100.0},
    ]
    assert segment_audio_span(partials) == (0.0, 1800.0)
    # other clock: 650 - (600 - 0) = 50, plus the final's 1800 ms of audio
    assert segment_audio_span(partials, same_clock=False) == (50.0, 1850.0)
    assert segment_audio_span([{"emit_ms": 10.0}, {"emit_ms": 90.0}]) == (10.0, 90.0)
    with pytest.raises(ValueError):
        segment_audio_span([])


def test_percentile_interpolates_like_numpy() -> None:
    # positions: p50 -> 1.5 -> 2.5; p95 -> 2.85 -> 3 + 0.85 = 3.85
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([4, 1, 3, 2], 95) == pytest.approx(3.85)
    assert percentile([], 50) is None


def test_quality_uses_chinese_tokenizer_for_chinese() -> None:
    sacrebleu = pytest.importorskip("sacrebleu")
    hyps, refs = ["我们去了公园。"], ["我们去公园了。"]
    zh = corpus_quality(hyps, refs, "zh")
    assert zh.bleu == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs], tokenize="zh").score)
    assert zh.bleu > 0.0  # 13a would see one token per sentence and score 0
    assert sacrebleu.corpus_bleu(hyps, [refs], tokenize="13a").score == 0.0
    en = corpus_quality(["the cat sat on the mat"], ["the cat sat on the mat"], "en")
    assert en.bleu == pytest.approx(100.0) and en.chrf == pytest.approx(100.0)
    with pytest.raises(ValueError):
        corpus_quality(["a"], [], "en")


def test_build_report_aggregates() -> None:
    pytest.importorskip("sacrebleu")
    first = example_trace()
    second = SegmentTrace(
        [up("a b", "C D", "C D", final=True, emit=3000, done=3300)],
        2500.0, 3000.0, "en", "en",
    )  # fmt: skip
    report = build_report([first, second], ["A B C", "C D"])
    assert report.segments == 2 and report.updates == 5
    assert (report.source_units, report.target_units) == (6, 5)
    # AL: mean(5/3, 2) where the second is wait-until-end (|X| = 2)
    assert report.al == pytest.approx((5 / 3 + 2.0) / 2)
    # corpus erasure: (1 + 0) / (3 + 2)
    assert report.erased_units == 1
    assert report.normalized_erasure == pytest.approx(0.2)
    assert report.segments_with_early_stable == 1 and report.revised_finals == 0
    # latencies 100, 100, 100, 100, 300: p50 100, max 300; p95 at 3.8 -> 100 + 0.8*200 = 260
    assert report.update_latency_p50_ms == pytest.approx(100.0)
    assert report.update_latency_p95_ms == pytest.approx(260.0)
    assert report.update_latency_max_ms == pytest.approx(300.0)
    # compute 400 + 300 over audio 2000 + 500
    assert report.rtf == pytest.approx(700 / 2500)
    # hypotheses equal the references (too short for 4-grams, so BLEU itself is 0)
    assert report.chrf == pytest.approx(100.0)
    assert report.bleu is not None
    data = report.to_dict(per_segment=True)
    assert json.loads(json.dumps(data)) == data
    assert [row["segment_id"] for row in data["per_segment"]] == [7, 0]
    assert "per_segment" not in report.to_dict()
    table = report.format_table()
    assert "normalized erasure" in table and "0.200" in table
    assert len({len(line) for line in table.splitlines()}) == 1  # aligned columns


def test_build_report_without_references_and_empty_corpus() -> None:
    report = build_report([example_trace()])
    assert report.bleu is None and report.chrf is None
    empty = build_report([])
    assert empty.segments == 0 and empty.al is None and empty.rtf is None
    assert "-" in empty.format_table()
    with pytest.raises(ValueError, match="1 segments but 2 references"):
        build_report([example_trace()], ["a", "b"])
