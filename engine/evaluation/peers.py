"""Replay output in the formats peer evaluation tools read, so their scorers run unchanged.

- SimulEval (``simuleval --score-only --output DIR``) reads ``DIR/instances.log``, one JSON
  object per segment, and ``DIR/config.yaml``. OmniSTEval reads the same file as its
  short-form JSONL input. SimulEval's model is an agent that never retracts what it wrote,
  so a segment's ``prediction`` is its final translation and each unit's delay is when it
  became *stable* (for this engine: committed, or the final): ``delays`` in source units
  read (words; characters for Chinese), ``elapsed`` in ms on the log's clock from the
  segment's audio start (compute included), ``source_length`` in source units. Its AL on
  these equals our "AL (stable)" with ``--no-use-ref-len`` (SimulEval scales by the
  reference length by default; that is our LAAL when the reference is longer).
- simulstream's log (read by its own scorers and by OmniSTEval's ``simulstream`` format)
  records what a viewer saw, retractions included: per update, the units added and the
  units deleted from the end, ``total_audio_processed`` (when the answered partial was
  emitted, from the segment's audio start: the audio it covers plus the recogniser's
  delay) and the update's compute time, in seconds. Units are written as
  sentencepiece-style tokens: ``▁word`` for words, one character per token for Chinese.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from engine.evaluation.metrics import SegmentTrace, lcp_len
from engine.evaluation.report import StreamingReport
from engine.evaluation.units import split_units
from engine.languages import text_lang, word_joiner, written_without_spaces

SIMULEVAL_LOG = "instances.log"
SIMULEVAL_CONFIG = "config.yaml"
WORD_MARK = "\u2581"


def _lang(lang: str | None, texts: Iterable[str]) -> str:
    """`lang` normalized, or (None or "") guessed from `texts`."""
    return text_lang(" ".join(texts), lang or None)


def simuleval_instances(
    report: StreamingReport,
    references: Sequence[str] | None = None,
    *,
    source_lang: str | None = None,
    target_lang: str | None = None,
) -> list[dict[str, Any]]:
    """One SimulEval ``instances.log`` entry per segment of ``report``, in report order."""
    if references is not None and len(references) != len(report.per_segment):
        raise ValueError(f"{len(report.per_segment)} segments but {len(references)} references")
    segs = report.per_segment
    src = _lang(source_lang, (s.source_text for s in segs))
    tgt = _lang(target_lang, (s.hypothesis for s in segs))
    out = []
    for index, seg in enumerate(segs):
        units = split_units(seg.hypothesis, tgt)
        entry: dict[str, Any] = {
            "index": index,
            "prediction": word_joiner(tgt).join(units),
            "delays": list(seg.delays_stable),
            "elapsed": list(seg.delays_ms_stable),
            "prediction_length": len(units),
            "source": seg.source_text,
            "source_length": len(split_units(seg.source_text, src)),
            "stream_id": seg.stream_id,
            "segment_id": seg.segment_id,
        }
        if references is not None:
            entry["reference"] = references[index]
        out.append(entry)
    return out


def write_simuleval(
    out_dir: str | Path,
    report: StreamingReport,
    references: Sequence[str] | None = None,
    *,
    source_lang: str | None = None,
    target_lang: str | None = None,
) -> Path:
    """Write ``instances.log`` and ``config.yaml`` into ``out_dir``; returns the log's path.

    Score with ``simuleval --score-only --output OUT_DIR`` (add ``--eval-latency-unit
    char`` for Chinese output).
    """
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    entries = simuleval_instances(
        report, references, source_lang=source_lang, target_lang=target_lang
    )
    log = directory / SIMULEVAL_LOG
    log.write_text(
        "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries), encoding="utf-8"
    )
    (directory / SIMULEVAL_CONFIG).write_text(
        "source_type: text\ntarget_type: text\n", encoding="utf-8"
    )
    return log


def _tokens(units: Sequence[str], lang: str) -> list[str]:
    return list(units) if written_without_spaces(lang) else [WORD_MARK + unit for unit in units]


def simulstream_lines(
    traces: Sequence[SegmentTrace], *, target_lang: str | None = None
) -> list[dict[str, Any]]:
    """simulstream log lines for ``traces`` (one instance per segment, ``id`` in order)."""
    tgt = _lang(target_lang, (u.text for t in traces for u in t.updates[-1:]))
    lines: list[dict[str, Any]] = []
    for index, trace in enumerate(traces):
        lines.append(
            {
                "id": index,
                "metadata": {
                    "wav_name": f"{trace.stream_id}/{trace.segment_id}",
                    "stream_id": trace.stream_id,
                    "segment_id": trace.segment_id,
                },
            }
        )
        shown: list[str] = []
        for update in trace.updates:
            units = split_units(update.text, tgt)
            keep = lcp_len(shown, units)
            compute = update.compute_ms if update.compute_ms is not None else 0.0
            lines.append(
                {
                    "id": index,
                    "total_audio_processed": max(0.0, update.emit_ms - trace.audio_start_ms)
                    / 1000.0,
                    "computation_time": compute / 1000.0,
                    "generated_tokens": _tokens(units[keep:], tgt),
                    "deleted_tokens": _tokens(shown[keep:], tgt),
                }
            )
            shown = units
    return lines


def write_simulstream(
    path: str | Path, traces: Sequence[SegmentTrace], *, target_lang: str | None = None
) -> Path:
    """Write a simulstream log of ``traces`` to ``path``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = simulstream_lines(traces, target_lang=target_lang)
    out.write_text(
        "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8"
    )
    return out
