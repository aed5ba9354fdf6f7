"""A replay as one self-contained HTML page: a summary, the numbers, latency over time,
and every segment's timeline on demand.

Meant to be opened in a browser and read by someone who has not read the metrics papers,
so it needs nothing else (no script, no external style or font, charts drawn as inline
SVG) and says what each number means where it shows it (`EXPLAIN`). What it shows, the
short part first:

- the settings, without the ones that do not apply (no "None");
- a summary: the few figures that say how early, how steady and how right the subtitles
  were, each with its one-line meaning;
- the streaming report's table (the same numbers as ``replay``'s stderr), explained;
- arrival -> update latency of every update against the log's clock, with p50 and p95;
- one line per segment, named by what was said and its translation, with what went wrong
  (text taken back, a final that broke a promise) as badges; opened (a ``<details>``), a
  timeline of units against time from the segment's audio start: source units heard,
  target units displayed and target units stable, as step lines (where the displayed line
  drops the viewer saw text retracted: that is the erasure; a marker where the final came),
  and every update's text with its stable part and tentative tail. Closed, 40 segments take
  a screen, not 12,000 pixels.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.evaluation.metrics import SegmentMetrics, SegmentTrace, percentile
from engine.evaluation.report import StreamingReport
from engine.evaluation.units import split_units

WIDTH, HEIGHT, PAD = 860, 220, 40
SEGMENT_HEIGHT = 150
SPEECH_ENDS_WIDTH = 70  # px the "speech ends" label takes at font-size 11
COLORS = {"source": "#8a8a8a", "shown": "#e0a030", "stable": "#2060c0", "latency": "#2060c0"}

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 920px;
       color: #222; background: #fff; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; }
table.numbers { border-collapse: collapse; } .numbers td { padding: 2px 12px 2px 0; }
.numbers td:last-child { text-align: right; font-variant-numeric: tabular-nums; }
.segment { border-top: 1px solid #ddd; padding-top: 8px; margin-top: 16px; }
.legend span { margin-right: 16px; } .swatch { display: inline-block; width: 14px;
  height: 3px; vertical-align: middle; margin-right: 4px; }
table.updates { border-collapse: collapse; font-size: 13px; }
.updates td { padding: 1px 10px 1px 0; vertical-align: top; }
.stable { color: #2060c0; } .tentative { color: #999; font-style: italic; }
.muted { color: #777; }
.numbers td { white-space: nowrap; }
.numbers td.why { color: #666; font-size: 12.5px; text-align: left; padding-left: 8px;
                  white-space: normal; }
.settings span { margin-right: 14px; white-space: nowrap; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr));
         gap: 10px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 10px; }
.card b { font-size: 20px; display: block; font-variant-numeric: tabular-nums; }
.card small { color: #666; display: block; }
details.segment { border-top: 1px solid #e4e4e4; padding: 3px 0; margin: 0; }
details.segment > summary { cursor: pointer; }
details.segment[open] { padding-bottom: 12px; }
.said { color: #333; } .translation { color: #2060c0; }
.badge { font-size: 12px; border-radius: 8px; padding: 0 6px; margin-left: 6px;
         background: #eee; color: #555; white-space: nowrap; }
.badge.bad { background: #fbe3e3; color: #a02020; }
"""

# One line per number of `StreamingReport.rows()`, shown beside it: what a person needs to
# read the table without the papers. Units are words (English, German) or characters
# (Chinese). tests/test_report_html.py fails on a row without one.
EXPLAIN: dict[str, str] = {
    "segments": "transcript segments in the log (one final each)",
    "updates": "translation updates sent to viewers",
    "source units": "units of the final source texts",
    "target units": "units of the final translations",
    "AL (displayed, units)": "Average Lagging: how many source units each displayed unit "
    "came behind an ideal simultaneous interpreter (lower: earlier)",
    "LAAL (displayed, units)": "Length-Adaptive AL: AL that does not reward a translation "
    "longer than the reference; the usual headline latency",
    "DAL (displayed, units)": "Differentiable AL: AL over every unit, each at least a "
    "unit's share after the one before",
    "AL (stable, units)": "AL of the stable text: when each unit was promised, never to change",
    "LAAL (stable, units)": "LAAL of the stable text",
    "DAL (stable, units)": "DAL of the stable text",
    "LAAL compute-aware (displayed, ms)": "LAAL in ms from the segment's audio start: waiting "
    "for speech, the recogniser and the engine together, what a viewer waits",
    "LAAL compute-aware (stable, ms)": "the same for the stable text",
    "YAAL (displayed / stable, units)": "Yet Another AL: LAAL of the units shown before the "
    "speech ended",
    "YAAL compute-aware (displayed, ms)": "YAAL in ms from the segment's audio start",
    "LongYAAL compute-aware (displayed / stable, ms)": "YAAL for long-form speech: a "
    "segment's output counts until the whole recording ends",
    "erased units": "units a viewer saw and then saw taken back",
    "normalized erasure": "erased units per unit of final translation (0: nothing shown was "
    "ever taken back)",
    "segments with stable text before final": "segments that committed text before their final",
    "finals revising stable text": "finals that did not extend the stable text shown before "
    "(a promise broken)",
    "stable retractions before final": "times the stable text itself changed before the final",
    "update latency p50 (ms)": "median time from a partial's emit to its update, on the "
    "log's clock (waiting behind earlier partials included)",
    "update latency p95 (ms)": "95th percentile of the same",
    "update latency max (ms)": "the slowest update",
    "compute (ms)": "encoder and decoder time spent, all updates together",
    "audio (ms)": "speech the segments cover",
    "real-time factor": "compute time per unit of audio time: below 1 keeps up with live speech",
    "BLEU": "corpus BLEU of the finals against the references, 0-100 (needs --references)",
    "chrF": "corpus chrF of the finals against the references, 0-100 (needs --references)",
}
SUMMARY: dict[str, str] = {
    "LAAL (stable, units)": "how far behind the speaker the committed subtitles were, in "
    "source units (words, or characters for Chinese)",
    "LAAL compute-aware (stable, ms)": "the same in ms from the start of speech: the "
    "recogniser, the engine and the waiting for words together",
    "normalized erasure": "text taken back from the viewer per unit of final translation "
    "(0: nothing shown was ever retracted)",
    "finals revising stable text": "segments whose final broke a promise: it did not "
    "extend the text already shown as stable",
    "update latency p95 (ms)": "95 in 100 updates came within this time of their partial",
    "BLEU": "how close the finals are to the references (0-100)",
}
"""The figures the summary shows first (how late, how steady, how fast, how right), each
with a line that stands alone (the table's lines lean on the rows above them)."""
UNDEFINED = "-"  # what `StreamingReport.rows()` writes for a number that is not defined
# Settings whose absence (None) still means something; other None settings are left out.
SETTING_DEFAULTS = {"max_new_tokens": "the model's length limit"}
SETTING_NAMES = {"beam_size": "beam", "max_new_tokens": "max new tokens"}


def _esc(text: object) -> str:
    return html.escape(str(text))


def _scale(value: float, lo: float, hi: float, out_lo: float, out_hi: float) -> float:
    if hi <= lo:
        return out_lo
    return out_lo + (value - lo) * (out_hi - out_lo) / (hi - lo)


def _steps(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points of a step line: each value holds until the next point's time."""
    out: list[tuple[float, float]] = []
    for i, (x, y) in enumerate(points):
        if i:
            out.append((x, points[i - 1][1]))
        out.append((x, y))
    return out


def _axes(width: int, height: int, x_max: float, y_max: float, x_label: str, y_label: str) -> str:
    left, bottom = PAD, height - PAD / 2
    parts = [
        f'<line x1="{left}" y1="{bottom}" x2="{width - 10}" y2="{bottom}" stroke="#999"/>',
        f'<line x1="{left}" y1="10" x2="{left}" y2="{bottom}" stroke="#999"/>',
        f'<text x="{width - 10}" y="{height - 2}" text-anchor="end" font-size="11" '
        f'fill="#555">{_esc(x_label)} (max {x_max:.0f})</text>',
        f'<text x="4" y="18" font-size="11" fill="#555">{_esc(y_label)} (max {y_max:.0f})</text>',
    ]
    return "".join(parts)


def latency_chart(updates: Sequence[tuple[float, float]]) -> str:
    """SVG scatter of (emit time ms, latency ms), with p50 and p95 lines."""
    if not updates:
        return '<p class="muted">no updates</p>'
    t_max = max(t for t, _ in updates) / 1000.0
    latencies = [lat for _, lat in updates]
    y_max = max(max(latencies), 1.0)
    bottom = HEIGHT - PAD / 2
    dots = "".join(
        f'<circle cx="{_scale(t / 1000.0, 0, t_max, PAD, WIDTH - 10):.1f}" '
        f'cy="{_scale(lat, 0, y_max, bottom, 10):.1f}" r="2" fill="{COLORS["latency"]}" '
        'fill-opacity="0.6"/>'
        for t, lat in updates
    )
    lines = ""
    for q, dash in ((50, "4 3"), (95, "1 3")):
        value = percentile(latencies, q) or 0.0
        y = _scale(value, 0, y_max, bottom, 10)
        lines += (
            f'<line x1="{PAD}" y1="{y:.1f}" x2="{WIDTH - 10}" y2="{y:.1f}" stroke="#c03030" '
            f'stroke-dasharray="{dash}"/><text x="{WIDTH - 12}" y="{y - 3:.1f}" '
            f'text-anchor="end" font-size="11" fill="#c03030">p{q} {value:.1f} ms</text>'
        )
    return (
        f'<svg class="latency" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="update latency over time">'
        f"{_axes(WIDTH, HEIGHT, t_max, y_max, 'log time (s)', 'latency (ms)')}{dots}{lines}</svg>"
    )


def _polyline(points: Sequence[tuple[float, float]], color: str, width: float = 2.0) -> str:
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="{width}"/>'


def segment_timeline(trace: SegmentTrace, source_lang: str | None, target_lang: str | None) -> str:
    """SVG step lines of source units heard, target units displayed and stable, over time."""
    ups = list(trace.updates)
    if not ups:
        return '<p class="muted">no updates</p>'
    start = trace.audio_start_ms
    times = [u.done_ms - start for u in ups]
    source = [len(split_units(u.source_text, source_lang)) for u in ups]
    shown = [len(split_units(u.text, target_lang)) for u in ups]
    stable = [len(split_units(u.stable_text, target_lang)) for u in ups]
    x_max = max(max(times), trace.audio_end_ms - start, 1.0)
    y_max = max(max(source), max(shown), 1)
    h = SEGMENT_HEIGHT
    bottom = h - PAD / 2

    def line(values: Sequence[int], color: str) -> str:
        points = [(0.0, 0.0), *zip(times, [float(v) for v in values], strict=True)]
        scaled = [
            (_scale(x, 0, x_max, PAD, WIDTH - 10), _scale(y, 0, y_max, bottom, 10))
            for x, y in _steps(points)
        ]
        return _polyline(scaled, color)

    end_x = _scale(trace.audio_end_ms - start, 0, x_max, PAD, WIDTH - 10)
    final_x = _scale(times[-1], 0, x_max, PAD, WIDTH - 10)
    # The label goes left of the line when right of it would run out of the chart (speech
    # often ends just before the final, at the right edge).
    label = (
        f'x="{end_x + 3:.1f}"'
        if end_x + 3 + SPEECH_ENDS_WIDTH <= WIDTH - 10
        else f'x="{end_x - 3:.1f}" text-anchor="end"'
    )
    marks = (
        f'<line x1="{end_x:.1f}" y1="10" x2="{end_x:.1f}" y2="{bottom}" stroke="#bbb" '
        'stroke-dasharray="3 3"/>'
        f'<text class="speech-ends" {label} y="20" font-size="11" fill="#888">speech ends</text>'
        f'<circle cx="{final_x:.1f}" cy="{_scale(shown[-1], 0, y_max, bottom, 10):.1f}" r="4" '
        f'fill="{COLORS["stable"]}"/>'
    )
    return (
        f'<svg class="timeline" width="{WIDTH}" height="{h}" role="img" '
        f'aria-label="segment timeline">{_axes(WIDTH, h, x_max, y_max, "ms", "units")}'
        f"{line(source, COLORS['source'])}{line(shown, COLORS['shown'])}"
        f"{line(stable, COLORS['stable'])}{marks}</svg>"
    )


def _updates_table(trace: SegmentTrace) -> str:
    rows = []
    for u in trace.updates:
        tail = u.text[len(u.stable_text) :] if u.text.startswith(u.stable_text) else u.text
        final = " <b>final</b>" if u.is_final else ""
        rows.append(
            f"<tr><td class='muted'>{u.done_ms - trace.audio_start_ms:.0f} ms</td>"
            f"<td>{_esc(u.source_text)}</td><td><span class='stable'>{_esc(u.stable_text)}"
            f"</span><span class='tentative'>{_esc(tail)}</span>{final}</td></tr>"
        )
    return f"<table class='updates'>{''.join(rows)}</table>"


def _settings(settings: Mapping[str, Any]) -> str:
    """The settings line: None ("does not apply": speed in fast mode) left out, or said
    in words where it means a default."""
    shown = []
    for key, value in settings.items():
        if value is None:
            if key not in SETTING_DEFAULTS:
                continue
            value = SETTING_DEFAULTS[key]
        name = SETTING_NAMES.get(key, key.replace("_", " "))
        shown.append(f"<span>{_esc(name)}: <b>{_esc(value)}</b></span>")
    return f"<p class='settings muted'>{' '.join(shown)}</p>"


def _value(value: str) -> str:
    return "n/a" if value == UNDEFINED else value


def _summary(report: StreamingReport) -> str:
    """The headline figures as cards, each with what it means."""
    values = dict(report.rows())
    out_of = {
        "finals revising stable text": report.segments,
        "segments with stable text before final": report.segments,
    }
    cards = []
    for name, meaning in SUMMARY.items():
        value = values.get(name, UNDEFINED)
        if value == UNDEFINED:  # BLEU without references: nothing to say first
            continue
        total = f" of {out_of[name]}" if name in out_of else ""
        cards.append(
            f"<div class='card'><small>{_esc(name)}</small><b>{_esc(value)}{total}</b>"
            f"<small>{_esc(meaning)}</small></div>"
        )
    return f"<div class='cards'>{''.join(cards)}</div>"


def _numbers(report: StreamingReport) -> str:
    rows = "".join(
        f"<tr><td>{_esc(name)}</td><td>{_esc(_value(value))}</td>"
        f"<td class='why'>{_esc(EXPLAIN.get(name, ''))}</td></tr>"
        for name, value in report.rows()
    )
    return f"<table class='numbers'>{rows}</table>"


def _segment_name(trace: SegmentTrace, several_streams: bool) -> str:
    """A segment named by what was said and what it became, not by its number."""
    last = trace.updates[-1] if trace.updates else None
    said = last.source_text if last is not None else ""
    text = last.text if last is not None else ""
    stream = f"<span class='muted'>{_esc(trace.stream_id)}</span> " if several_streams else ""
    return (
        f"{stream}<span class='said'>{_esc(said) or '(nothing heard)'}</span> → "
        f"<span class='translation'>{_esc(text) or '(nothing)'}</span>"
    )


def _segment(trace: SegmentTrace, seg: SegmentMetrics | None, several_streams: bool) -> str:
    """One segment: a line naming it with badges for what went wrong; opened, its numbers,
    timeline and updates."""
    badges = [f"<span class='badge'>{len(trace.updates)} updates</span>"]
    erasure = "n/a"
    if seg is not None:
        if seg.erased_units:
            badges.append(f"<span class='badge bad'>{seg.erased_units} units taken back</span>")
        if seg.revised_final:
            badges.append("<span class='badge bad'>final revised the stable text</span>")
        if not seg.early_stable:
            badges.append("<span class='badge'>nothing stable before the final</span>")
        if seg.normalized_erasure is not None:
            erasure = f"{seg.normalized_erasure:.3f}"
    lagging = ""
    if seg is not None and seg.laal_ms_stable is not None:
        lagging = f"; stable text lagged {seg.laal_ms_stable:.0f} ms (LAAL compute-aware)"
    erased = 0 if seg is None else seg.erased_units
    return (
        f"<details class='segment'><summary>{_segment_name(trace, several_streams)}"
        f"{''.join(badges)}</summary>"
        f"<p class='muted'>{_esc(trace.stream_id)}, segment {trace.segment_id}: "
        f"{len(trace.updates)} updates; erased units {erased} (normalized erasure {erasure})"
        f"{lagging}</p>"
        f"{segment_timeline(trace, trace.source_lang, trace.target_lang)}"
        f"{_updates_table(trace)}</details>"
    )


def render(
    report: StreamingReport,
    traces: Sequence[SegmentTrace],
    settings: Mapping[str, Any],
    *,
    updates: Sequence[tuple[float, float]] = (),
    title: str = "Replay report",
    max_segments: int = 100,
) -> str:
    """The whole page. ``updates``: (emit ms, arrival -> update latency ms) per update."""
    legend = "".join(
        f'<span><i class="swatch" style="background:{COLORS[key]}"></i>{label}</span>'
        for key, label in (
            ("source", "source units heard"),
            ("shown", "target units displayed"),
            ("stable", "target units stable"),
        )
    )
    by_key = {(s.stream_id, s.segment_id): s for s in report.per_segment}
    several = len({trace.stream_id for trace in traces}) > 1
    segments = [
        _segment(trace, by_key.get((trace.stream_id, trace.segment_id)), several)
        for trace in traces[:max_segments]
    ]
    more = len(traces) - max_segments
    tail = f"<p class='muted'>{more} more segments not shown</p>" if more > 0 else ""
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_esc(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{_esc(title)}</h1>{_settings(settings)}"
        f"<h2>Summary</h2>{_summary(report)}"
        f"<h2>Numbers</h2><p class='muted'>Units are words (characters for Chinese); "
        "latencies in units count source units read, in ms time on the log's clock. "
        "Lagging figures are means over segments.</p>"
        f"{_numbers(report)}"
        f"<h2>Update latency over time</h2><p class='muted'>Each dot is one update: when its "
        "partial was emitted (log time) and how long the engine took from the partial's "
        "arrival to the update; dashed lines: median and 95th percentile.</p>"
        f"{latency_chart(updates)}"
        f"<h2>Segments</h2><p class='muted'>What was said and its final translation; open "
        "one for its timeline from its audio start (a drop of the displayed line is text a "
        "viewer saw taken back; the dot is the final) and every update it got, stable part "
        "and <span class='tentative'>tentative tail</span>.</p>"
        f"<p class='legend'>{legend}</p>{''.join(segments)}{tail}"
        "</body></html>"
    )


def write_html(path: str | Path, page: str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
