"""A replay as one self-contained HTML page: numbers, latency over time, per-segment timelines.

Meant to be opened in a browser and looked at, so it needs nothing else: no script, no
external style or font, charts drawn as inline SVG. What it shows:

- the settings and the streaming report's table (the same numbers as ``replay``'s stderr);
- arrival -> update latency of every update against the log's clock, with p50 and p95;
- per segment, a timeline of units against time from the segment's audio start: source
  units heard (as each answered partial arrived), target units displayed and target units
  stable, as step lines; where the displayed line drops, the viewer saw text retracted
  (that is the erasure); a marker where the final came. Below it, every update's text with
  its stable part and tentative tail.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.evaluation.metrics import SegmentTrace, StreamingReport, percentile
from engine.evaluation.units import split_units

WIDTH, HEIGHT, PAD = 860, 220, 40
SEGMENT_HEIGHT = 150
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
"""


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
    marks = (
        f'<line x1="{end_x:.1f}" y1="10" x2="{end_x:.1f}" y2="{bottom}" stroke="#bbb" '
        'stroke-dasharray="3 3"/>'
        f'<text x="{end_x + 3:.1f}" y="20" font-size="11" fill="#888">speech ends</text>'
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
    numbers = "".join(
        f"<tr><td>{_esc(name)}</td><td>{_esc(value)}</td></tr>" for name, value in report.rows()
    )
    setting_text = ", ".join(f"{k} {v}" for k, v in settings.items())
    legend = "".join(
        f'<span><i class="swatch" style="background:{COLORS[key]}"></i>{label}</span>'
        for key, label in (
            ("source", "source units heard"),
            ("shown", "target units displayed"),
            ("stable", "target units stable"),
        )
    )
    segments = []
    for trace in traces[:max_segments]:
        seg = next(
            (
                s
                for s in report.per_segment
                if (s.stream_id, s.segment_id) == (trace.stream_id, trace.segment_id)
            ),
            None,
        )
        erasure = (
            "-"
            if seg is None or seg.normalized_erasure is None
            else (f"{seg.normalized_erasure:.3f}")
        )
        erased = 0 if seg is None else seg.erased_units
        segments.append(
            f'<div class="segment"><h3>{_esc(trace.stream_id)} / segment '
            f"{trace.segment_id}</h3><p class='muted'>{len(trace.updates)} updates; "
            f"erased units {erased} (normalized erasure {erasure})</p>"
            f"{segment_timeline(trace, trace.source_lang, trace.target_lang)}"
            f"<details><summary>updates</summary>{_updates_table(trace)}</details></div>"
        )
    more = len(traces) - max_segments
    tail = f"<p class='muted'>{more} more segments not shown</p>" if more > 0 else ""
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_esc(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{_esc(title)}</h1><p class='muted'>{_esc(setting_text)}</p>"
        f"<h2>Numbers</h2><table class='numbers'>{numbers}</table>"
        f"<h2>Update latency over time</h2>{latency_chart(updates)}"
        f"<h2>Segments</h2><p class='legend'>{legend}</p>{''.join(segments)}{tail}"
        "</body></html>"
    )


def write_html(path: str | Path, page: str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
