"""Evaluation of streaming translation: units, streaming metrics, how a log's source
changes, peer formats and the HTML report.

Transcript logs themselves (reading, writing, making them) are `engine.logs`.
"""

from engine.evaluation.metrics import (
    QualityScores,
    SegmentMetrics,
    SegmentTrace,
    UpdatePoint,
    average_lagging,
    corpus_quality,
    differentiable_average_lagging,
    display_text,
    erased_units,
    length_adaptive_average_lagging,
    normalized_erasure,
    segment_audio_span,
    segment_metrics,
    simulated_done_times,
)
from engine.evaluation.report import StreamingReport, build_report
from engine.evaluation.revisions import SourceRevisions, source_revisions
from engine.evaluation.units import count_units, guess_lang, normalize_lang, split_units

__all__ = [
    "QualityScores",
    "SegmentMetrics",
    "SegmentTrace",
    "SourceRevisions",
    "StreamingReport",
    "UpdatePoint",
    "average_lagging",
    "build_report",
    "corpus_quality",
    "count_units",
    "differentiable_average_lagging",
    "display_text",
    "erased_units",
    "guess_lang",
    "length_adaptive_average_lagging",
    "normalize_lang",
    "normalized_erasure",
    "segment_audio_span",
    "segment_metrics",
    "simulated_done_times",
    "source_revisions",
    "split_units",
]

