"""Streaming metrics for re-translation output: latency, erasure, stability, speed, quality.

Pure functions on plain data (no I/O; of the engine only its language table) so that
replay tools, benchmarks and tests share one definition of every number they print.

Input model: a ``SegmentTrace`` per source segment holds the ``UpdatePoint``s shown to the
viewer in order, each with the source text it answered, the displayed target text
(stable + unstable), the stable part, and two times on the *emit clock* (the clock of the
ASR's ``emit_ms``): ``emit_ms`` of the partial it answers and ``done_ms`` when the update
was produced. When a replay runs faster than real time, ``done_ms`` must still be on the
emit clock; ``simulated_done_times`` derives it from measured compute times.

Units are words for English and characters for Chinese (``engine.evaluation.units``).

Latency (``d_i`` for unit ``i`` of the final output ``Y``): the number of source units read
at the first update from which on the displayed prefix ``Y[:i]`` never changed again. The
final update counts as having read the whole source ``|X|`` (units of the final's source
text). "Read" is cumulative (a running maximum over the segment's partials) and capped at
``|X|``, so an ASR revision that shortens a partial does not make later units look earlier.
The *stable* variant uses the stable text of each non-final update instead of the displayed
text (the final still counts in full), i.e. when the viewer was promised the unit.

``tau`` in AL/LAAL is the first ``i`` with ``d_i >= |X|`` (Ma et al. 2019 use ``=``; ``>=``
only matters for the millisecond variant where compute makes ``d_i`` overshoot ``|X|``),
or ``|Y|`` when no unit waited for the whole source.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from engine.evaluation.units import split_units
from engine.languages import text_lang, word_joiner


@dataclass(frozen=True)
class UpdatePoint:
    """One translation update as the viewer saw it, with the source it answered.

    ``text`` is the whole displayed target (stable + unstable, see ``display_text``);
    ``compute_ms`` is the engine's own busy time for this update when the caller measured
    it (otherwise it is inferred from the emit-clock times, see ``update_compute_ms``).
    """

    source_text: str
    text: str
    stable_text: str
    is_final: bool
    emit_ms: float
    done_ms: float
    compute_ms: float | None = None


@dataclass(frozen=True)
class SegmentTrace:
    """All updates of one segment plus its audio span on the emit clock.

    ``audio_start_ms``/``audio_end_ms``: see ``segment_audio_span`` for how to derive them
    from a transcript log. A language of ``None`` is guessed from the final texts.
    ``reference`` (optional) feeds LAAL's ``|Y*|`` and BLEU/chrF.
    """

    updates: Sequence[UpdatePoint]
    audio_start_ms: float
    audio_end_ms: float
    source_lang: str | None = None
    target_lang: str | None = None
    reference: str | None = None
    stream_id: str = ""
    segment_id: int = 0
    recording_end_ms: float | None = None  # end of the stream's audio (for LongYAAL)


@dataclass(frozen=True)
class QualityScores:
    """Corpus BLEU and chrF (sacrebleu, 0-100)."""

    bleu: float
    chrf: float


@dataclass(frozen=True)
class SegmentMetrics:
    """Every per-segment number; ``None`` where a metric is undefined (empty output/source)."""

    stream_id: str
    segment_id: int
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
    yaal: float | None
    yaal_stable: float | None
    yaal_ms: float | None
    long_yaal_ms: float | None
    long_yaal_ms_stable: float | None
    erased_units: int
    normalized_erasure: float | None
    early_stable: bool
    revised_final: bool
    stable_retractions: int
    audio_ms: float
    compute_ms: float
    update_latencies_ms: tuple[float, ...] = field(default=(), repr=False)
    hypothesis: str = field(default="", repr=False)
    # For peer scorers (SimulEval, OmniSTEval): the final source and, per final output
    # unit, the source units read and the emit-clock ms when it became stable.
    source_text: str = field(default="", repr=False)
    delays_stable: tuple[float, ...] = field(default=(), repr=False)
    delays_ms_stable: tuple[float, ...] = field(default=(), repr=False)


# ---------------------------------------------------------------------------------------
# Small building blocks


def display_text(stable_text: str, unstable_text: str, lang: str | None = None) -> str:
    """The text a viewer sees: stable followed by unstable.

    For languages written with spaces a space is inserted when neither side carries one, so
    that word counts do not glue the last stable and first unstable word together; Chinese
    is concatenated as is.
    """
    if not stable_text or not unstable_text:
        return stable_text + unstable_text
    joiner = word_joiner(text_lang(stable_text + unstable_text, lang))
    if stable_text[-1].isspace() or unstable_text[0].isspace():
        joiner = ""
    return stable_text + joiner + unstable_text


def lcp_len(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common prefix of two unit sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def first_stable_updates(outputs: Sequence[Sequence[str]]) -> list[int]:
    """For each unit ``i`` of the last output, the first update index from which on the prefix
    ``outputs[-1][:i+1]`` was shown unchanged in every later update.

    Unit ``i`` is settled from update ``t`` iff every ``outputs[t'] (t' >= t)`` shares at least
    ``i+1`` leading units with the last output, so a suffix minimum of those common-prefix
    lengths answers every unit in one pass.
    """
    if not outputs:
        return []
    final = outputs[-1]
    suffix_min = [0] * len(outputs)
    running = len(final)
    for t in range(len(outputs) - 1, -1, -1):
        running = min(running, lcp_len(outputs[t], final))
        suffix_min[t] = running
    result: list[int] = []
    t = 0
    for i in range(1, len(final) + 1):
        while suffix_min[t] < i:
            t += 1
        result.append(t)
    return result


def unit_delays(outputs: Sequence[Sequence[str]], reads: Sequence[float]) -> list[float]:
    """``d_i = reads[t_i]`` where ``t_i`` is the update from which unit ``i`` stayed shown.

    ``reads[t]`` is what had been consumed at update ``t``: source units, or ms on the emit
    clock for the compute-aware variant.
    """
    if len(outputs) != len(reads):
        raise ValueError(f"{len(outputs)} outputs but {len(reads)} read positions")
    return [float(reads[t]) for t in first_stable_updates(outputs)]


def _lagging(delays: Sequence[float], source_len: float, rate_len: float) -> float | None:
    if not delays or source_len <= 0 or rate_len <= 0:
        return None
    gamma = rate_len / source_len
    tau = len(delays)
    for i, d in enumerate(delays, start=1):
        if d >= source_len:
            tau = i
            break
    return sum(delays[i] - i / gamma for i in range(tau)) / tau


def average_lagging(
    delays: Sequence[float], source_len: float, target_len: int | None = None
) -> float | None:
    """AL (Ma et al. 2019): ``1/tau * sum_{i<=tau} (d_i - (i-1)/gamma)``, ``gamma = |Y|/|X|``.

    ``None`` for an empty output or source, where lagging has no meaning.
    """
    return _lagging(delays, source_len, len(delays) if target_len is None else target_len)


def length_adaptive_average_lagging(
    delays: Sequence[float], source_len: float, reference_len: int | None = None
) -> float | None:
    """LAAL (Papi et al. 2022): AL with ``gamma = max(|Y|, |Y*|)/|X|``.

    Using the longer of hypothesis and reference stops an over-generating system from
    earning a lower lag; without a reference ``|Y*| = |Y|`` and LAAL equals AL.
    """
    return _lagging(delays, source_len, max(len(delays), reference_len or 0))


def yet_another_average_lagging(
    delays: Sequence[float],
    source_len: float,
    reference_len: int | None = None,
    *,
    cutoff: float | None = None,
) -> float | None:
    """YAAL (Polák et al. 2025, "Better Late Than Never", arXiv 2509.17349), as OmniSTEval
    computes it: LAAL's ``gamma = max(|Y|, |Y*|)/|X|``, but only units emitted *before* the
    source ended count (LAAL also counts the first one after), and a segment whose first
    unit came after it is left out (``None``) rather than scored.

    LongYAAL (``cutoff``): for long-form speech the output of one segment may lawfully come
    while the next is spoken, so units count until ``cutoff`` (the end of the whole
    recording, measured from this segment's start) instead of until the segment's end.
    """
    if not delays or source_len <= 0:
        return None
    end = source_len if cutoff is None else cutoff
    if delays[0] >= end:
        return None
    gamma = max(len(delays), reference_len or 0) / source_len
    terms = []
    for i, d in enumerate(delays):
        if d >= end:
            break
        terms.append(d - i / gamma)
    return sum(terms) / len(terms)


def differentiable_average_lagging(delays: Sequence[float], source_len: float) -> float | None:
    """DAL (Cherry & Foster 2019): ``1/|Y| * sum_i (d'_i - (i-1)/gamma)`` over all units, with
    ``d'_1 = d_1``, ``d'_i = max(d_i, d'_{i-1} + 1/gamma)``, ``gamma = |Y|/|X|``.

    Unlike AL it has no cut-off and charges bursts of output (several units at one read)
    as if they had been spread at the ideal rate.
    """
    if not delays or source_len <= 0:
        return None
    gamma = len(delays) / source_len
    total = 0.0
    prev = -math.inf
    for i, d in enumerate(delays):
        cur = d if i == 0 else max(d, prev + 1.0 / gamma)
        total += cur - i / gamma
        prev = cur
    return total / len(delays)


def erased_units(outputs: Sequence[Sequence[str]]) -> int:
    """Units removed from the display over a segment: ``sum_t |o_{t-1}| - |LCP(o_{t-1}, o_t)|``."""
    return sum(len(prev) - lcp_len(prev, cur) for prev, cur in pairwise(outputs))


def normalized_erasure(outputs: Sequence[Sequence[str]]) -> float | None:
    """NE (Arivazhagan et al. 2020): erased units divided by the final output's units.

    ``None`` when the final output is empty (the ratio is undefined).
    """
    if not outputs or not outputs[-1]:
        return None
    return erased_units(outputs) / len(outputs[-1])


def real_time_factor(compute_ms: float, audio_ms: float) -> float | None:
    """Compute time per unit of audio; below 1 keeps up with live speech."""
    return compute_ms / audio_ms if audio_ms > 0 else None


def simulated_done_times(emit_ms: Sequence[float], compute_ms: Sequence[float]) -> list[float]:
    """Emit-clock completion times for a replay that ran faster (or slower) than real time.

    A single engine can start an update only once the partial has arrived and the previous
    update is finished: ``done_t = max(emit_t, done_{t-1}) + compute_t``.
    """
    if len(emit_ms) != len(compute_ms):
        raise ValueError(f"{len(emit_ms)} emit times but {len(compute_ms)} compute times")
    done: list[float] = []
    free_at = -math.inf
    for emit, compute in zip(emit_ms, compute_ms, strict=True):
        free_at = max(float(emit), free_at) + float(compute)
        done.append(free_at)
    return done


def update_compute_ms(updates: Sequence[UpdatePoint]) -> list[float]:
    """Per-update compute time: ``compute_ms`` if given, else ``done - max(emit, prev done)``.

    The fallback is exact for a single engine that processes partials in order (the model
    behind ``simulated_done_times``).
    """
    result: list[float] = []
    prev_done = -math.inf
    for u in updates:
        if u.compute_ms is not None:
            result.append(float(u.compute_ms))
        else:
            result.append(max(0.0, u.done_ms - max(u.emit_ms, prev_done)))
        prev_done = u.done_ms
    return result


def segment_audio_span(
    partials: Sequence[Mapping[str, Any]], *, same_clock: bool = True
) -> tuple[float, float]:
    """Audio ``(start_ms, end_ms)`` of a segment on the emit clock, from its transcript messages.

    - ``same_clock=True`` (transcript logs, where ``emit_ms = end_ms + ASR delay``): the last
      message's (the final's) ``start_ms``/``end_ms`` as they are, so ASR delay counts as
      latency, as the viewer experiences it.
    - ``same_clock=False`` (audio times on another clock): the start is the first partial's
      ``emit_ms`` minus the audio it had already covered (``end_ms - start_ms``), which
      assumes no ASR delay on that first partial; the duration is the final's.
    - Without audio times: the emit span, first ``emit_ms`` to last ``emit_ms``.
    """
    if not partials:
        raise ValueError("segment has no transcript messages")
    first, last = partials[0], partials[-1]
    has_times = all(
        isinstance(m.get("start_ms"), (int, float)) and isinstance(m.get("end_ms"), (int, float))
        for m in (first, last)
    )
    if not has_times:
        return float(first["emit_ms"]), float(last["emit_ms"])
    duration = float(last["end_ms"]) - float(last["start_ms"])
    if same_clock:
        start = float(last["start_ms"])
    else:
        start = float(first["emit_ms"]) - (float(first["end_ms"]) - float(first["start_ms"]))
    return start, start + duration


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100), as numpy's default; ``None`` if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def corpus_quality(
    hypotheses: Sequence[str], references: Sequence[str], target_lang: str | None = None
) -> QualityScores:
    """Corpus BLEU (``tokenize="zh"`` for Chinese targets, 13a otherwise) and chrF.

    sacrebleu is imported here so that the metrics module stays importable without it.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    import sacrebleu

    lang = text_lang(" ".join(references), target_lang)
    tokenize = "zh" if lang == "zh" else "13a"  # sacrebleu's tokenizer for Chinese
    bleu = sacrebleu.corpus_bleu(list(hypotheses), [list(references)], tokenize=tokenize)
    chrf = sacrebleu.corpus_chrf(list(hypotheses), [list(references)])
    return QualityScores(bleu=float(bleu.score), chrf=float(chrf.score))


# ---------------------------------------------------------------------------------------
# Per segment


def _prefix_of(a: Sequence[str], b: Sequence[str]) -> bool:
    return len(a) <= len(b) and lcp_len(a, b) == len(a)


def segment_metrics(trace: SegmentTrace, reference: str | None = None) -> SegmentMetrics:
    """All per-segment metrics of ``trace``; ``reference`` overrides ``trace.reference``.

    Compute-aware LAAL (``laal_ms``): ``d_i = done_ms(t_i) - audio_start_ms`` on the emit
    clock, ``|X| = audio_end_ms - audio_start_ms``, ``gamma = max(|Y|, |Y*|) / |X|`` in
    units per ms. It therefore includes waiting for speech, ASR delay (when the audio times
    share the emit clock) and engine compute/queueing, i.e. what the viewer experiences.

    The last update is taken as the final output even when it is not flagged final (a
    truncated stream), so a partial trace still gets numbers.
    """
    ups = list(trace.updates)
    ref = reference if reference is not None else trace.reference
    audio_ms = max(0.0, trace.audio_end_ms - trace.audio_start_ms)
    computes = update_compute_ms(ups)
    latencies = tuple(u.done_ms - u.emit_ms for u in ups)
    if not ups:
        return SegmentMetrics(
            stream_id=trace.stream_id, segment_id=trace.segment_id, updates=0,
            source_units=0, target_units=0, al=None, laal=None, dal=None, al_stable=None,
            laal_stable=None, dal_stable=None, laal_ms=None, laal_ms_stable=None, yaal=None,
            yaal_stable=None, yaal_ms=None, long_yaal_ms=None, long_yaal_ms_stable=None,
            erased_units=0, normalized_erasure=None, early_stable=False, revised_final=False,
            stable_retractions=0, audio_ms=audio_ms, compute_ms=0.0,
        )  # fmt: skip
    final = ups[-1]
    src_lang = text_lang(final.source_text, trace.source_lang or None)
    tgt_lang = text_lang(final.text, trace.target_lang or None)
    source_len = len(split_units(final.source_text, src_lang))
    shown = [split_units(u.text, tgt_lang) for u in ups]
    stable = [split_units(u.stable_text, tgt_lang) for u in ups]
    y = shown[-1]
    ref_len = len(split_units(ref, tgt_lang)) if ref is not None else None

    reads: list[float] = []
    read = 0
    for u in ups[:-1]:
        read = min(source_len, max(read, len(split_units(u.source_text, src_lang))))
        reads.append(float(read))
    reads.append(float(source_len))
    reads_ms = [u.done_ms - trace.audio_start_ms for u in ups]
    stable_outputs = [*stable[:-1], y]

    d_shown = unit_delays(shown, reads)
    d_stable = unit_delays(stable_outputs, reads)
    d_ms = unit_delays(shown, reads_ms)
    d_ms_stable = unit_delays(stable_outputs, reads_ms)
    # LongYAAL counts output until the recording ends (without end: all of it).
    end = trace.recording_end_ms
    recording = math.inf if end is None else end - trace.audio_start_ms

    non_final = stable[:-1]
    retractions = sum(1 for prev, cur in pairwise(non_final) if not _prefix_of(prev, cur))
    revised = bool(non_final) and not _prefix_of(non_final[-1], y)
    return SegmentMetrics(
        stream_id=trace.stream_id,
        segment_id=trace.segment_id,
        updates=len(ups),
        source_units=source_len,
        target_units=len(y),
        al=average_lagging(d_shown, source_len),
        laal=length_adaptive_average_lagging(d_shown, source_len, ref_len),
        dal=differentiable_average_lagging(d_shown, source_len),
        al_stable=average_lagging(d_stable, source_len),
        laal_stable=length_adaptive_average_lagging(d_stable, source_len, ref_len),
        dal_stable=differentiable_average_lagging(d_stable, source_len),
        laal_ms=length_adaptive_average_lagging(d_ms, audio_ms, ref_len),
        laal_ms_stable=length_adaptive_average_lagging(d_ms_stable, audio_ms, ref_len),
        yaal=yet_another_average_lagging(d_shown, source_len, ref_len),
        yaal_stable=yet_another_average_lagging(d_stable, source_len, ref_len),
        yaal_ms=yet_another_average_lagging(d_ms, audio_ms, ref_len),
        long_yaal_ms=yet_another_average_lagging(d_ms, audio_ms, ref_len, cutoff=recording),
        long_yaal_ms_stable=yet_another_average_lagging(
            d_ms_stable, audio_ms, ref_len, cutoff=recording
        ),
        erased_units=erased_units(shown),
        normalized_erasure=normalized_erasure(shown),
        early_stable=any(non_final),
        revised_final=revised,
        stable_retractions=retractions,
        audio_ms=audio_ms,
        compute_ms=sum(computes),
        update_latencies_ms=latencies,
        hypothesis=final.text,
        source_text=final.source_text,
        delays_stable=tuple(d_stable),
        delays_ms_stable=tuple(d_ms_stable),
    )


# ---------------------------------------------------------------------------------------
# Corpus report
