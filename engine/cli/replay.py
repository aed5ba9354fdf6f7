"""`nmt-incremental replay`: a transcript log through the incremental translator.

Updates go to stdout (or `--out`) as JSON Lines, the metrics table to stderr, and on
request the metrics as JSON, the peer tools' formats, an HTML report and subtitle files.
The work is `engine.replay`; this module reads the options and writes the files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from engine import subtitles
from engine.cli.args import (
    add_decode_arguments,
    add_model_arguments,
    add_policy_argument,
    decode_options,
    load_translator,
    positive_float,
)
from engine.evaluation.html_report import render, write_html
from engine.evaluation.metrics import SegmentTrace
from engine.evaluation.peers import write_simuleval, write_simulstream
from engine.logs import check_references, read_log, read_references
from engine.replay import ReplayOptions, TimedUpdate, replay, timed_update_line
from engine.streaming import StreamingOptions, parse_policy


def add_replay_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rep = subparsers.add_parser(
        "replay",
        help="replay a transcript log and report streaming metrics",
        description=(
            "Push the partial transcripts of LOG (JSON Lines with emit_ms) through the "
            "incremental translator. Updates go to stdout (or --out) as JSON Lines (each "
            "with emit_ms and done_ms on the log's clock), the "
            "metrics table to stderr. By default every partial is translated and times are "
            "simulated on the log's clock; --realtime replays on the wall clock instead. "
            "Exits 1 when an event was refused or failed, or a final differed from the "
            "offline translation."
        ),
    )
    add_model_arguments(rep)
    add_decode_arguments(rep)
    rep.add_argument("log", help="transcript log (JSON Lines)")
    add_policy_argument(rep)
    rep.add_argument("--realtime", action="store_true", help="push events at their emit times")
    rep.add_argument("--speed", type=positive_float, default=1.0, help="realtime speed-up factor")
    rep.add_argument("--references", help="one reference per segment, in log order")
    rep.add_argument("--out", help="write updates here instead of stdout")
    rep.add_argument("--report", help="write the metrics as JSON here")
    rep.add_argument(
        "--simuleval",
        metavar="DIR",
        help="write SimulEval's instances.log and config.yaml here (simuleval --score-only "
        "--output DIR scores them; OmniSTEval reads instances.log too)",
    )
    rep.add_argument(
        "--vtt",
        metavar="FILE",
        help="write the finals as WebVTT subtitles (cue times from the log's audio times; "
        "one file per stream, named FILE.STREAM.vtt, when the log has several)",
    )
    rep.add_argument("--srt", metavar="FILE", help="the same as SubRip (.srt)")
    rep.add_argument(
        "--html",
        metavar="FILE",
        help="write a self-contained HTML report (numbers, latency over time, per-segment "
        "timelines) to open in a browser",
    )
    rep.add_argument(
        "--simulstream",
        metavar="FILE",
        help="write a simulstream log (what viewers saw, retractions included) here",
    )
    rep.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: on long logs when stderr is a terminal)",
    )


def run_replay(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """Replay a log: updates to --out or stdout, the table to stderr, JSON to --report.

    Inputs are read before the model is loaded, so a bad log fails fast.
    """
    lines = read_log(args.log)
    references = None
    if args.references:
        references = read_references(args.references)
        check_references(references, lines, references_path=args.references, log_path=args.log)
    options = ReplayOptions(
        streaming=StreamingOptions(
            policy=parse_policy(args.policy) if args.policy else None,
            decode=decode_options(args),
            forced_length_ratio=args.forced_length_ratio,
            source_agreement=args.source_agreement,
            settled_source=args.settled_source,
            drafts=args.drafts,
        ),
        realtime=args.realtime,
        speed=args.speed,
        progress=args.progress,
    )
    translator = load_translator(args)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(args.out, "w", encoding="utf-8")) if args.out else stdout

        def write(timed: TimedUpdate) -> None:
            out.write(timed_update_line(timed) + "\n")
            if args.realtime:
                out.flush()  # live: show each update as it comes

        result = replay(translator, lines, options, references=references, on_update=write)
        out.flush()
    print(result.format_table(), file=stderr)
    config = translator.config
    if args.simuleval:
        write_simuleval(
            args.simuleval,
            result.report,
            result.references,
            source_lang=config.source_lang,
            target_lang=config.target_lang,
        )
    if args.simulstream:
        write_simulstream(args.simulstream, result.traces, target_lang=config.target_lang)
    if args.html:
        page = render(
            result.report,
            result.traces,
            {"model": args.model, "log": args.log, **result.settings},
            updates=[(u.emit_ms, u.latency_ms) for u in result.updates],
            title=f"Replay of {Path(args.log).name}",
        )
        print(f"report: {write_html(args.html, page)}", file=stderr)
    for path, kind in ((args.vtt, "vtt"), (args.srt, "srt")):
        if path:
            for written in write_subtitles(path, kind, result.traces):
                print(f"subtitles: {written}", file=stderr)
    if args.report:
        data = result.to_dict()
        data["settings"] = {"model": args.model, "log": args.log, **data["settings"]}
        Path(args.report).write_text(
            json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
        )
    failed = result.refused or result.mismatches or result.counts["errors"]
    return 1 if failed else 0


def write_subtitles(path: str, kind: str, traces: Sequence[SegmentTrace]) -> list[Path]:
    """Subtitle files of the finals in ``traces``: ``path`` itself for one stream, else one
    per stream with the stream id before the suffix."""
    finals: dict[str, list[subtitles.Final]] = {}
    for trace in traces:
        last = trace.updates[-1] if trace.updates else None
        if last is not None and last.is_final:
            finals.setdefault(trace.stream_id, []).append(
                subtitles.Final(trace.audio_start_ms, trace.audio_end_ms, last.text)
            )
    target = Path(path)
    written = []
    for stream, segments in finals.items():
        out = target if len(finals) == 1 else target.with_suffix(f".{stream}{target.suffix}")
        written.append(subtitles.write(out, subtitles.layout(segments), kind))
    return written
