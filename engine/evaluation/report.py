"""One corpus's streaming report: the per-segment measures of `engine.evaluation.metrics`
gathered over every segment of a replay, in the form the CLI prints and writes as JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.evaluation.metrics import (
    SegmentMetrics,
    SegmentTrace,
    corpus_quality,
    percentile,
    real_time_factor,
    segment_metrics,
)


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


# Per-segment fields that hold raw sequences or texts rather than numbers.
_RAW_FIELDS = (
    "update_latencies_ms",
    "hypothesis",
    "source_text",
    "delays_stable",
    "delays_ms_stable",
)


@dataclass(frozen=True)
class StreamingReport:
    """Corpus-level streaming metrics.

    Lagging metrics are means over the segments where they are defined; erasure is the
    corpus ratio (sum erased / sum final units) so long segments weigh in proportion.
    ``update_latency_*`` is ``done_ms - emit_ms`` over all updates.
    """

    segments: int
    updates: int
    source_units: int
    target_units: int
    al: float | None
    laal: float | None
    dal: float | None
    al_stable: float | None
    laal_stable: float | None
    dal_stable: float | None
    laal_ms: float | None
    laal_ms_stable: float | None
    erased_units: int
    normalized_erasure: float | None
    segments_with_early_stable: int
    revised_finals: int
    stable_retractions: int
    update_latency_p50_ms: float | None
    update_latency_p95_ms: float | None
    update_latency_max_ms: float | None
    compute_ms: float
    audio_ms: float
    rtf: float | None
    bleu: float | None = None
    chrf: float | None = None
    yaal: float | None = None
    yaal_stable: float | None = None
    yaal_ms: float | None = None
    long_yaal_ms: float | None = None
    long_yaal_ms_stable: float | None = None
    per_segment: tuple[SegmentMetrics, ...] = field(default=(), repr=False)

    def to_dict(self, *, per_segment: bool = False) -> dict[str, Any]:
        """JSON-ready dict; per-segment rows (without raw latencies/texts) on request."""
        out = {k: v for k, v in asdict(self).items() if k != "per_segment"}
        if per_segment:
            rows = []
            for seg in self.per_segment:
                row = asdict(seg)
                for raw in _RAW_FIELDS:
                    row.pop(raw)
                rows.append(row)
            out["per_segment"] = rows
        return out

    def rows(self) -> list[tuple[str, str]]:
        """(name, formatted value) pairs, for people (``-`` for undefined values)."""

        def num(v: float | None, digits: int = 2) -> str:
            return "-" if v is None else f"{v:.{digits}f}"

        return [
            ("segments", str(self.segments)),
            ("updates", str(self.updates)),
            ("source units", str(self.source_units)),
            ("target units", str(self.target_units)),
            ("AL (displayed, units)", num(self.al)),
            ("LAAL (displayed, units)", num(self.laal)),
            ("DAL (displayed, units)", num(self.dal)),
            ("AL (stable, units)", num(self.al_stable)),
            ("LAAL (stable, units)", num(self.laal_stable)),
            ("DAL (stable, units)", num(self.dal_stable)),
            ("LAAL compute-aware (displayed, ms)", num(self.laal_ms, 0)),
            ("LAAL compute-aware (stable, ms)", num(self.laal_ms_stable, 0)),
            ("YAAL (displayed / stable, units)", f"{num(self.yaal)} / {num(self.yaal_stable)}"),
            ("YAAL compute-aware (displayed, ms)", num(self.yaal_ms, 0)),
            (
                "LongYAAL compute-aware (displayed / stable, ms)",
                f"{num(self.long_yaal_ms, 0)} / {num(self.long_yaal_ms_stable, 0)}",
            ),
            ("erased units", str(self.erased_units)),
            ("normalized erasure", num(self.normalized_erasure, 3)),
            ("segments with stable text before final", str(self.segments_with_early_stable)),
            ("finals revising stable text", str(self.revised_finals)),
            ("stable retractions before final", str(self.stable_retractions)),
            ("update latency p50 (ms)", num(self.update_latency_p50_ms, 1)),
            ("update latency p95 (ms)", num(self.update_latency_p95_ms, 1)),
            ("update latency max (ms)", num(self.update_latency_max_ms, 1)),
            ("compute (ms)", num(self.compute_ms, 0)),
            ("audio (ms)", num(self.audio_ms, 0)),
            ("real-time factor", num(self.rtf, 3)),
            ("BLEU", num(self.bleu)),
            ("chrF", num(self.chrf)),
        ]

    def format_table(self) -> str:
        """Human-readable two-column table."""
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        vwidth = max(len(value) for _, value in rows)
        return "\n".join(f"{name:<{width}}  {value:>{vwidth}}" for name, value in rows)


def build_report(
    traces: Sequence[SegmentTrace],
    references: Sequence[str] | None = None,
    *,
    target_lang: str | None = None,
) -> StreamingReport:
    """Aggregate ``traces`` into a ``StreamingReport``.

    ``references`` (one per trace, overriding ``trace.reference``) enable LAAL's ``|Y*|``
    and BLEU/chrF; quality is only scored when every segment has a reference, since a
    partial corpus score would not be comparable.
    """
    if references is not None and len(references) != len(traces):
        raise ValueError(f"{len(traces)} segments but {len(references)} references")
    refs: list[str | None] = (
        list(references) if references is not None else [t.reference for t in traces]
    )
    segs = tuple(segment_metrics(t, r) for t, r in zip(traces, refs, strict=True))
    latencies = [v for s in segs for v in s.update_latencies_ms]
    target_units = sum(s.target_units for s in segs)
    erased = sum(s.erased_units for s in segs)
    compute = sum(s.compute_ms for s in segs)
    audio = sum(s.audio_ms for s in segs)
    bleu = chrf = None
    if segs and all(r is not None for r in refs):
        lang = target_lang
        if lang is None:
            lang = next((t.target_lang for t in traces if t.target_lang), None)
        scores = corpus_quality([s.hypothesis for s in segs], [r or "" for r in refs], lang)
        bleu, chrf = scores.bleu, scores.chrf
    return StreamingReport(
        segments=len(segs),
        updates=sum(s.updates for s in segs),
        source_units=sum(s.source_units for s in segs),
        target_units=target_units,
        al=_mean([s.al for s in segs]),
        laal=_mean([s.laal for s in segs]),
        dal=_mean([s.dal for s in segs]),
        al_stable=_mean([s.al_stable for s in segs]),
        laal_stable=_mean([s.laal_stable for s in segs]),
        dal_stable=_mean([s.dal_stable for s in segs]),
        laal_ms=_mean([s.laal_ms for s in segs]),
        laal_ms_stable=_mean([s.laal_ms_stable for s in segs]),
        erased_units=erased,
        normalized_erasure=erased / target_units if target_units else None,
        segments_with_early_stable=sum(1 for s in segs if s.early_stable),
        revised_finals=sum(1 for s in segs if s.revised_final),
        stable_retractions=sum(s.stable_retractions for s in segs),
        update_latency_p50_ms=percentile(latencies, 50),
        update_latency_p95_ms=percentile(latencies, 95),
        update_latency_max_ms=max(latencies) if latencies else None,
        compute_ms=compute,
        audio_ms=audio,
        rtf=real_time_factor(compute, audio),
        bleu=bleu,
        chrf=chrf,
        yaal=_mean([s.yaal for s in segs]),
        yaal_stable=_mean([s.yaal_stable for s in segs]),
        yaal_ms=_mean([s.yaal_ms for s in segs]),
        long_yaal_ms=_mean([s.long_yaal_ms for s in segs]),
        long_yaal_ms_stable=_mean([s.long_yaal_ms_stable for s in segs]),
        per_segment=segs,
    )
