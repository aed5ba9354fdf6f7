"""Replay of transcript logs through the incremental translator, with streaming metrics.

A transcript log (``engine.logs``) holds ``partial_transcript`` messages plus the
``emit_ms`` at which the ASR emitted each. Two ways to replay it:

- fast (default, deterministic): every event is pushed in log order and the engine is left
  to finish it before the next, so every partial is translated. Update times are then put
  on the emit clock with ``simulated_done_times`` per stream (an update starts at
  ``max(emit, previous update's end)`` and takes its measured ``compute_ms``), i.e. as if a
  real-time engine never had to skip a partial.
- realtime: events are pushed when their ``emit_ms`` comes round on the wall clock (sped up
  by ``speed``), all streams into one controller, so latest-wins skipping happens as it
  would live. Wall times are mapped back onto the emit clock; at ``speed > 1`` the engine
  therefore looks ``speed`` times slower relative to the speech.

Either way the result carries the updates, a ``StreamingReport`` and a check that every
final equals the offline translation of its final transcript.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
from tqdm import tqdm  # type: ignore[import-untyped]

from engine.decoding.translator import Translator
from engine.evaluation.metrics import (
    SegmentTrace,
    UpdatePoint,
    display_text,
    percentile,
    segment_audio_span,
    simulated_done_times,
)
from engine.evaluation.report import StreamingReport, build_report
from engine.evaluation.revisions import SourceRevisions, source_revisions
from engine.evaluation.terms import TermAccuracy, term_accuracy
from engine.languages import in_other_script
from engine.logs.format import (
    PathLike,
    SegmentKey,
    check_references,
    event_of,
    read_log,
    read_references,
    segment_order,
)
from engine.logs.updates import TimedUpdate
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.session import StreamingOptions
from protocol import (
    ErrorCode,
    ErrorMessage,
    InvalidEvent,
    InvalidMessage,
    PartialTranscript,
    TranslationUpdate,
)

PROGRESS_MIN_EVENTS = 200
"""With progress left on automatic, logs shorter than this replay without a bar."""


@dataclass(frozen=True)
class ReplayOptions:
    """How a log is replayed.

    ``progress``: ``None`` shows a bar on stderr only for long logs and when stderr is a
    terminal, so pipelines and CI logs stay clean; ``True``/``False`` force it.
    ``max_streams`` and ``decode_slots``: the engine's (`IncrementalTranslator`), for logs
    of more streams than a server takes by default. ``check_finals``: compare every
    final with the offline translation of its transcript afterwards (one at a time: a
    capacity run of thousands of streams leaves it out).
    """

    streaming: StreamingOptions = field(default_factory=StreamingOptions)
    realtime: bool = False
    speed: float = 1.0
    progress: bool | None = None
    max_streams: int = 256
    decode_slots: int | None = None
    check_finals: bool = True

    def __post_init__(self) -> None:
        if not self.speed > 0 or self.speed == float("inf"):
            raise ValueError(f"speed must be a positive finite number, got {self.speed}")


@dataclass(frozen=True)
class RefusedEvent:
    """A log event the engine would not take; ``event`` is its 1-based position in the log."""

    event: int
    stream_id: str
    seq: int
    code: str
    message: str


@dataclass(frozen=True)
class FinalMismatch:
    """A segment whose streamed final differs from the offline translation (a bug)."""

    stream_id: str
    segment_id: int
    source: str
    streamed: str | None
    offline: str


@dataclass(frozen=True)
class ReplayResult:
    """Everything a replay measured.

    ``final_exact_match`` is over the segments whose final event the engine accepted; a
    final that never produced an update counts as a mismatch. ``None`` when there are none.
    ``wall_rtf`` is wall time over the log's emit span (how much faster than live it ran);
    ``report.rtf`` is engine compute over audio.
    """

    updates: tuple[TimedUpdate, ...]
    report: StreamingReport
    final_exact_match: float | None
    finals_checked: int
    mismatches: tuple[FinalMismatch, ...]
    refused: tuple[RefusedEvent, ...]
    counts: Mapping[str, int]
    wall_s: float
    emit_span_ms: float
    settings: Mapping[str, Any]
    source: SourceRevisions | None = None  # how the log's partials changed (the input side)
    # Streams whose finals are mostly in another script than the model's source language.
    other_script: tuple[str, ...] = ()
    traces: tuple[SegmentTrace, ...] = field(default=(), repr=False)  # what the report used
    references: tuple[str, ...] | None = field(default=None, repr=False)
    terms: TermAccuracy | None = None  # with a glossary (the translator's)

    @property
    def latencies_ms(self) -> list[float]:
        """Arrival -> update latency of every update, in update order."""
        return [u.latency_ms for u in self.updates]

    @property
    def latency_p50_ms(self) -> float | None:
        return percentile(self.latencies_ms, 50)

    @property
    def latency_p95_ms(self) -> float | None:
        return percentile(self.latencies_ms, 95)

    @property
    def latency_max_ms(self) -> float | None:
        return max(self.latencies_ms, default=None)

    @property
    def wall_rtf(self) -> float | None:
        return self.wall_s * 1000.0 / self.emit_span_ms if self.emit_span_ms > 0 else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (the updates themselves go to their own JSON Lines output)."""
        return {
            "settings": dict(self.settings),
            "counts": dict(self.counts),
            "final_exact_match": self.final_exact_match,
            "finals_checked": self.finals_checked,
            "final_mismatches": [asdict(m) for m in self.mismatches],
            "latency_ms": {
                "p50": self.latency_p50_ms,
                "p95": self.latency_p95_ms,
                "max": self.latency_max_ms,
            },
            "wall_s": self.wall_s,
            "emit_span_ms": self.emit_span_ms,
            "wall_rtf": self.wall_rtf,
            "refused": [asdict(r) for r in self.refused],
            "source": None if self.source is None else asdict(self.source),
            "other_script": list(self.other_script),
            "report": self.report.to_dict(per_segment=True),
            "terms": None if self.terms is None else self.terms.to_dict(),
        }

    def format_table(self) -> str:
        """Settings, the streaming report table and the replay's own numbers, for people."""

        def num(v: float | None, digits: int) -> str:
            return "-" if v is None else f"{v:.{digits}f}"

        s = self.settings
        mode = f"realtime x{s['speed']:g}" if s["mode"] == "realtime" else "fast"
        header = (
            f"policy {s['policy']}, beam {s['beam_size']}, "
            f"max new tokens {s['max_new_tokens'] or '-'}, {mode}"
        )
        c = self.counts
        match = num(self.final_exact_match, 3)
        if self.final_exact_match is not None:
            good = self.finals_checked - len(self.mismatches)
            match += f" ({good}/{self.finals_checked})"
        rows = [
            ("final exact match", match),
            ("arrival->update latency p50 (ms)", num(self.latency_p50_ms, 1)),
            ("arrival->update latency p95 (ms)", num(self.latency_p95_ms, 1)),
            ("arrival->update latency max (ms)", num(self.latency_max_ms, 1)),
            ("events / refused", f"{c['events']} / {c['refused']}"),
            ("updates / unchanged", f"{c['updates']} / {c['unchanged']}"),
            ("cancelled / superseded", f"{c['cancelled']} / {c['superseded']}"),
            ("errors / dropped", f"{c['errors']} / {c['dropped']}"),
            (
                "decoder steps / prefill calls",
                f"{c.get('decoder_steps', 0)} / {c.get('prefill_calls', 0)}",
            ),
            (
                "draft tokens accepted / offered",
                f"{c.get('draft_accepted', 0)} / {c.get('draft_offered', 0)}",
            ),
            (
                "lookahead tokens accepted / offered",
                f"{c.get('lookahead_accepted', 0)} / {c.get('lookahead_offered', 0)}",
            ),
            ("wall time (s)", num(self.wall_s, 2)),
            ("wall time / emit span", num(self.wall_rtf, 3)),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [header, "", self.report.format_table(), ""]
        lines += [f"{name:<{width}}  {value}" for name, value in rows]
        if self.source is not None:
            lines.append(f"{'source (the log)':<{width}}  {self.source.format()}")
        if self.terms is not None:
            lines.append(f"{'glossary terms placed':<{width}}  {self.terms.format()}")
        for stream in self.other_script:
            lang = self.settings.get("source_lang") or "?"
            lines.append(
                f"notice: stream {stream}: its finals are mostly in another script than the "
                f"model's source language ({lang}): is it the right model?"
            )
        for r in self.refused[:10]:
            lines.append(f"refused event {r.event} ({r.stream_id} seq {r.seq}): {r.message}")
        if len(self.refused) > 10:
            lines.append(f"... and {len(self.refused) - 10} more refused events")
        for m in self.mismatches[:5]:
            lines.append(
                f"final mismatch {m.stream_id}/{m.segment_id}: "
                f"streamed {_clip(m.streamed)} offline {_clip(m.offline)}"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Pure helpers


def _other_script(lines: Sequence[Mapping[str, Any]], source_lang: str | None) -> tuple[str, ...]:
    """The streams of a log whose finals, together, are mostly in another script than
    `source_lang` (`engine.languages.in_other_script`)."""
    finals: dict[str, list[str]] = {}
    for line in lines:
        if line.get("is_final"):
            finals.setdefault(str(line.get("stream_id")), []).append(str(line.get("text", "")))
    return tuple(
        stream for stream, texts in finals.items() if in_other_script(" ".join(texts), source_lang)
    )


def _show_progress(option: bool | None, total: int) -> bool:
    if option is not None:
        return option
    return total >= PROGRESS_MIN_EVENTS and sys.stderr.isatty()


def _settings(options: ReplayOptions, translator: Translator) -> dict[str, Any]:
    decode = options.streaming.decode
    return {
        "mode": "realtime" if options.realtime else "fast",
        "speed": options.speed if options.realtime else None,
        "policy": options.streaming.policy_for(translator.config).name,
        "beam_size": decode.beam_size,
        "max_new_tokens": decode.max_new_tokens,
        "min_new_tokens": decode.min_new_tokens,
        "length_penalty": decode.length_penalty,
        "history": options.streaming.history,
        "source_lang": translator.config.source_lang,
    }


# ---------------------------------------------------------------------------------------
# Running the engine


@dataclass
class _Run:
    """What the async part collects; turned into a ``ReplayResult`` afterwards."""

    received: list[tuple[TranslationUpdate, float]] = field(default_factory=list)
    accepted: dict[tuple[str, int], Mapping[str, Any]] = field(default_factory=dict)
    refused: list[RefusedEvent] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)
    decoding: Counter[str] = field(default_factory=Counter)
    dropped: int = 0
    t0: float = 0.0
    emit0: float = 0.0
    wall_s: float = 0.0


async def _push(
    nmt: IncrementalTranslator, run: _Run, number: int, line: Mapping[str, Any]
) -> PartialTranscript | None:
    """Push one log line; a refusal is recorded and the replay goes on."""
    try:
        event = event_of(line)
        await nmt.push(event)
    except InvalidMessage as exc:
        error = ErrorMessage(ErrorCode.INVALID_MESSAGE, str(exc), exc.field)
    except InvalidEvent as exc:
        error = exc.error
    else:
        run.accepted[(event.stream_id, event.seq)] = line
        return event
    run.refused.append(
        RefusedEvent(number, str(line["stream_id"]), int(line["seq"]), error.code, error.message)
    )
    return None


async def _drive(
    translator: Translator,
    lines: Sequence[Mapping[str, Any]],
    options: ReplayOptions,
    on_update: Callable[[TimedUpdate], None] | None,
) -> _Run:
    run = _Run()
    before = translator.scheduler.stats
    show = _show_progress(options.progress, len(lines))
    bar = tqdm(total=len(lines), disable=not show, file=sys.stderr, unit="ev", leave=False)
    try:
        async with IncrementalTranslator(
            translator,
            options.streaming,
            max_streams=options.max_streams,
            decode_slots=options.decode_slots,
        ) as nmt:
            sub = nmt.updates()  # subscribe before the first push so nothing is missed

            async def collect() -> None:
                async for update in sub:
                    if isinstance(update, ErrorMessage):  # a final that failed: counted
                        continue  # in nmt.stats["errors"], and its final is a mismatch
                    wall = time.perf_counter()
                    run.received.append((update, wall))
                    if on_update is not None and options.realtime:
                        on_update(_timed(run, options, update, wall))

            async with anyio.create_task_group() as group:
                group.start_soon(collect)
                run.t0 = time.perf_counter()
                if options.realtime:
                    # Stable sort: ties keep log order, so a stream's own order is kept.
                    ordered = sorted(
                        enumerate(lines, start=1), key=lambda item: float(item[1]["emit_ms"])
                    )
                    run.emit0 = float(ordered[0][1]["emit_ms"]) if ordered else 0.0
                    for number, line in ordered:
                        offset_s = (float(line["emit_ms"]) - run.emit0) / 1000.0
                        due = run.t0 + offset_s / options.speed
                        await anyio.sleep(max(0.0, due - time.perf_counter()))
                        await _push(nmt, run, number, line)
                        bar.update(1)
                    await nmt.wait_idle()
                else:
                    for number, line in enumerate(lines, start=1):
                        event = await _push(nmt, run, number, line)
                        if event is not None:
                            await nmt.wait_idle(event.stream_id)
                        bar.update(1)
                await nmt.aclose()  # delivers every pending final, then ends `sub`
            run.wall_s = time.perf_counter() - run.t0
            run.stats = Counter(nmt.stats)
            run.dropped = sub.dropped
            # The decode scheduler's work for this replay (the final check runs later).
            run.decoding = translator.scheduler.stats - before
    finally:
        bar.close()
    return run


def _timed(
    run: _Run, options: ReplayOptions, update: TranslationUpdate, wall: float
) -> TimedUpdate:
    """A realtime update on the log's clock: the wall clock mapped back (and scaled by
    the speed-up), as `_timed_updates` does for the report, so the two agree exactly."""
    emit = float(run.accepted[(update.stream_id, update.seq)]["emit_ms"])
    return TimedUpdate(update, emit, run.emit0 + (wall - run.t0) * 1000.0 * options.speed)


def _timed_updates(run: _Run, options: ReplayOptions) -> list[TimedUpdate]:
    if options.realtime:
        return [_timed(run, options, u, wall) for u, wall in run.received]
    emits = [float(run.accepted[(u.stream_id, u.seq)]["emit_ms"]) for u, _ in run.received]
    done = [0.0] * len(run.received)
    per_stream: dict[str, list[int]] = defaultdict(list)
    for i, (u, _) in enumerate(run.received):
        per_stream[u.stream_id].append(i)
    for indices in per_stream.values():
        sim = simulated_done_times(
            [emits[i] for i in indices], [run.received[i][0].compute_ms for i in indices]
        )
        for i, t in zip(indices, sim, strict=True):
            done[i] = t
    return [TimedUpdate(u, e, d) for (u, _), e, d in zip(run.received, emits, done, strict=True)]


def _traces(
    lines: Sequence[Mapping[str, Any]], updates: Sequence[TimedUpdate], translator: Translator
) -> list[SegmentTrace]:
    src_lang, tgt_lang = translator.config.source_lang, translator.config.target_lang
    partials: dict[SegmentKey, list[Mapping[str, Any]]] = defaultdict(list)
    for line in lines:
        partials[(line["stream_id"], line["segment_id"])].append(line)
    points: dict[SegmentKey, list[UpdatePoint]] = defaultdict(list)
    for t in updates:
        u = t.update
        points[(u.stream_id, u.segment_id)].append(
            UpdatePoint(
                source_text=u.source_text if u.source_text is not None else "",
                text=display_text(u.stable_text, u.unstable_text, tgt_lang),
                stable_text=u.stable_text,
                is_final=u.is_final,
                emit_ms=t.emit_ms,
                done_ms=t.done_ms,
                compute_ms=u.compute_ms,
            )
        )
    spans = {key: segment_audio_span(partials[key]) for key in segment_order(lines)}
    recording_end: dict[str, float] = {}  # a stream's recording ends with its last segment
    for (stream, _), (_, end) in spans.items():
        recording_end[stream] = max(end, recording_end.get(stream, end))
    return [
        SegmentTrace(
            updates=points.get(key, []),
            audio_start_ms=start,
            audio_end_ms=end,
            source_lang=src_lang,
            target_lang=tgt_lang,
            stream_id=key[0],
            segment_id=key[1],
            recording_end_ms=recording_end[key[0]],
        )
        for key, (start, end) in spans.items()
    ]


def _check_finals(
    translator: Translator,
    run: _Run,
    updates: Sequence[TimedUpdate],
    options: ReplayOptions,
    show: bool,
) -> tuple[int, list[FinalMismatch]]:
    """Compare each streamed final with ``Translator.translate`` of its final transcript.

    Sources are translated one at a time, as the engine does, so that batch padding cannot
    make the comparison flaky.
    """
    finals = {
        (u.update.stream_id, u.update.segment_id): u.update for u in updates if u.update.is_final
    }
    expected = [line for line in run.accepted.values() if line["is_final"]]
    mismatches = []
    for line in tqdm(expected, disable=not show, file=sys.stderr, desc="finals", leave=False):
        # Same options as the stream's final (a forced length depends on the source length).
        source = options.streaming.clean(line["text"], translator.config.source_lang)
        decode = options.streaming.decode_for(len(translator.source_ids(source)))
        offline = translator.translate([source], decode)[0].text
        streamed = finals.get((line["stream_id"], line["segment_id"]))
        got = streamed.stable_text if streamed is not None else None
        if got != offline:
            mismatches.append(
                FinalMismatch(line["stream_id"], line["segment_id"], line["text"], got, offline)
            )
    return len(expected), mismatches


async def replay_async(
    translator: Translator,
    lines: Sequence[Mapping[str, Any]],
    options: ReplayOptions | None = None,
    *,
    references: Sequence[str] | None = None,
    on_update: Callable[[TimedUpdate], None] | None = None,
) -> ReplayResult:
    """Replay validated log lines (``read_log``); see the module docstring for the modes.

    ``references``: one per segment in order of first appearance (``segment_order``).
    ``on_update`` sees every update with its times on the log's clock: in realtime mode as
    it is delivered (to stream them out), in fast mode once the replay is over (its times
    are simulated from the measured compute then).
    """
    options = options or ReplayOptions()
    if references is not None:
        check_references(references, lines)
    run = await _drive(translator, lines, options, on_update)
    updates = _timed_updates(run, options)
    if on_update is not None and not options.realtime:
        for timed in updates:
            on_update(timed)
    show = _show_progress(options.progress, len(lines))
    checked, mismatches = 0, list[FinalMismatch]()
    if options.check_finals:
        checked, mismatches = await anyio.to_thread.run_sync(
            _check_finals, translator, run, updates, options, show
        )
    traces = _traces(lines, updates, translator)
    report = build_report(traces, references, target_lang=translator.config.target_lang)
    counts = {"events": len(lines), "accepted": run.stats["events"], "refused": len(run.refused)}
    for key in ("updates", "unchanged", "cancelled", "superseded", "errors"):
        counts[key] = run.stats[key]
    counts["dropped"] = run.dropped
    for key in (
        "decoder_steps",
        "prefill_calls",
        "draft_offered",
        "draft_accepted",
        "lookahead_offered",
        "lookahead_accepted",
    ):
        counts[key] = run.decoding[key]
    emits = [float(line["emit_ms"]) for line in lines]
    return ReplayResult(
        updates=tuple(updates),
        report=report,
        final_exact_match=(checked - len(mismatches)) / checked if checked else None,
        finals_checked=checked,
        mismatches=tuple(mismatches),
        refused=tuple(run.refused),
        counts=counts,
        wall_s=run.wall_s,
        emit_span_ms=max(emits) - min(emits) if emits else 0.0,
        settings=_settings(options, translator),
        source=source_revisions(lines, translator.config.source_lang) if lines else None,
        other_script=_other_script(lines, translator.config.source_lang),
        traces=tuple(traces),
        references=None if references is None else tuple(references),
        terms=None
        if translator.glossary is None
        else term_accuracy(
            (t.update for t in updates), translator.glossary, translator.config.target_lang
        ),
    )


def replay(
    translator: Translator,
    lines: Sequence[Mapping[str, Any]],
    options: ReplayOptions | None = None,
    *,
    references: Sequence[str] | None = None,
    on_update: Callable[[TimedUpdate], None] | None = None,
) -> ReplayResult:
    """Blocking ``replay_async`` for scripts and the CLI."""

    async def main() -> ReplayResult:
        return await replay_async(
            translator, lines, options, references=references, on_update=on_update
        )

    return anyio.run(main)


def replay_file(
    translator: Translator,
    log_path: PathLike,
    options: ReplayOptions | None = None,
    *,
    references_path: PathLike | None = None,
    on_update: Callable[[TimedUpdate], None] | None = None,
) -> ReplayResult:
    """Read a log (and references) and replay it; raises ``TranscriptLogError`` naming the
    line of a malformed log."""
    lines = read_log(log_path)
    refs = read_references(references_path) if references_path is not None else None
    return replay(translator, lines, options, references=refs, on_update=on_update)


def _clip(text: str | None, limit: int = 80) -> str:
    """A text for a one-line message: repr, cut to `limit` characters."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."
