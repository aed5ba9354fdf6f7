"""`nmt-incremental` command line: a thin I/O layer over the engine."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, TextIO

import protocol
from engine.cli.args import (
    add_model_arguments,
    add_policy_argument,
    load_translator,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
)
from engine.cli.models import add_models_parser, run_models
from engine.cli.serve import add_serve_parser, run_serve
from engine.decoding.search import DecodeOptions
from engine.errors import EngineError
from engine.evaluation.metrics import SegmentTrace
from engine.evaluation.translogs import (
    AsrStyle,
    TranscriptLogError,
    make_log_files,
    read_log,
    read_references,
    references_output_path,
    source_revisions,
    write_log,
)


def _stream_id(value: str) -> str:
    try:
        return protocol.CloseStream(value).stream_id  # the protocol's own stream-id rules
    except protocol.InvalidMessage as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _stdin_lines(stream: BinaryIO) -> Iterator[tuple[int, str | None]]:
    """Numbered stdin lines; None for a line that is not valid UTF-8."""
    for number, raw in enumerate(stream, start=1):
        try:
            yield number, raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as exc:
            print(
                f"error: line {number}: invalid UTF-8 ({exc.reason} at byte {exc.start})",
                file=sys.stderr,
            )
            yield number, None


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--beam", type=positive_int, default=1, metavar="N", help="beam size (default 1: greedy)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="stop every decode after N tokens (default: the model's length limit)",
    )


def decode_options(args: argparse.Namespace) -> DecodeOptions:
    return DecodeOptions(beam_size=args.beam, max_new_tokens=args.max_new_tokens)


def run_translate(args: argparse.Namespace, stdin: BinaryIO, stdout: TextIO) -> int:
    translator = load_translator(args)
    options = decode_options(args)
    status = 0
    lines: Iterator[tuple[int, str | None]] = (
        iter(enumerate(args.text, start=1)) if args.text else _stdin_lines(stdin)
    )
    for number, text in lines:
        if text is None:
            stdout.write("\n")  # keep output lines aligned with input lines
            status = 1
            continue
        try:
            result = translator.translate_long(text, options)
        except EngineError as exc:
            print(f"error: line {number}: {exc}", file=sys.stderr)
            stdout.write("\n")
            status = 1
            continue
        stdout.write(result.text + "\n")
        stdout.flush()
    return status


def run_replay(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """Replay a log: updates to --out or stdout, the table to stderr, JSON to --report.

    Inputs are read before the model is loaded, so a bad log fails fast.
    """
    # Imported here so that `translate` does not pay for the anyio/tqdm imports.
    from engine.evaluation.peers import write_simuleval, write_simulstream
    from engine.replay import (
        ReplayOptions,
        TimedUpdate,
        replay,
        segment_order,
        timed_update_line,
    )
    from engine.streaming import StreamingOptions, parse_policy

    lines = read_log(args.log)
    references = None
    if args.references:
        references = read_references(args.references)
        segments = len(segment_order(lines))
        if len(references) != segments:
            raise TranscriptLogError(
                f"{args.references}: {len(references)} references for {segments} "
                f"segments in {args.log}"
            )
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
        from engine.evaluation.html_report import render, write_html

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
    from engine import subtitles

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


def run_logs_make(args: argparse.Namespace, stderr: TextIO) -> int:
    style = AsrStyle.realistic() if args.realistic else AsrStyle()
    style = replace(
        style,
        rewrite_rate=style.rewrite_rate if args.rewrite_rate is None else args.rewrite_rate,
        lowercase=style.lowercase or args.lowercase,
        punctuation=style.punctuation and not args.no_punctuation,
    )
    segments = make_log_files(
        args.source,
        args.out,
        args.lang,
        references_path=args.references,
        limit=args.limit,
        seed=args.seed,
        style=style,
    )
    lines = read_log(args.out)
    if lines and lines[0]["stream_id"] != args.stream_id:  # make_log_files writes "s1"
        write_log(args.out, [{**line, "stream_id": args.stream_id} for line in lines])
    refs = f", references in {references_output_path(args.out)}" if args.references else ""
    print(f"{args.out}: {segments} segments, {len(lines)} events{refs}", file=stderr)
    print(f"  {source_revisions(lines, args.lang).format()}", file=stderr)
    return 0


def run_logs_hint(args: argparse.Namespace, stderr: TextIO) -> int:
    from engine.evaluation.translogs import with_stability_hints

    lines = with_stability_hints(read_log(args.log), lag=args.lag)
    write_log(args.out, lines)
    hinted = [line for line in lines if "stable_chars" in line]
    share = sum(line["stable_chars"] for line in hinted) / max(
        sum(len(line["text"]) for line in hinted), 1
    )
    print(
        f"{args.out}: {len(lines)} events, {len(hinted)} partials with stable_chars "
        f"(lag {args.lag}); {share:.0%} of their characters settled",
        file=stderr,
    )
    return 0


def run_logs_merge(args: argparse.Namespace, stderr: TextIO) -> int:
    from engine.replay import interleave_logs

    try:
        merged = interleave_logs(*(read_log(path) for path in args.logs))
    except ValueError as exc:
        if isinstance(exc, TranscriptLogError):
            raise
        raise TranscriptLogError(str(exc)) from None
    write_log(args.out, merged)
    print(f"{args.out}: {len(merged)} events from {len(args.logs)} logs", file=stderr)
    return 0


class _BriefFormatter(logging.Formatter):
    """Log records on one line: the CLI counts failed events, it does not dump tracebacks."""

    def formatException(
        self,
        ei: tuple[type[BaseException], BaseException, TracebackType | None]
        | tuple[None, None, None],
    ) -> str:
        if ei[0] is None:
            return ""
        return "  " + traceback.format_exception_only(ei[0], ei[1])[-1].strip()


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_BriefFormatter("%(levelname)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nmt-incremental", description="Live incremental machine translation (OPUS-MT, ONNX)."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    translate = commands.add_parser(
        "translate",
        help="translate text, one translation per line",
        description="Translate TEXT arguments, or stdin lines when none are given.",
    )
    add_model_arguments(translate)
    add_decode_arguments(translate)
    translate.add_argument("text", nargs="*", help="source text (default: read stdin lines)")

    rep = commands.add_parser(
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

    logs = commands.add_parser(
        "logs",
        help="make, hint and merge transcript logs",
        description="Transcript logs are what replay reads: partial_transcript messages with "
        "the time the recogniser emitted each. `make` synthesises one from parallel text, "
        "`hint` adds recogniser stability hints, `merge` interleaves logs of several streams.",
    )
    log_commands = logs.add_subparsers(dest="logs_command", required=True)
    make = log_commands.add_parser(
        "make",
        help="simulate ASR partials for the lines of a text file",
        description=(
            "Write a synthetic transcript log for the lines of SOURCE_FILE (one segment "
            "each), revealed word by word (en) or 1-3 characters at a time (zh) with "
            "occasional corrected mistakes. With --references, the matching references go "
            "next to the log as <name>.ref.txt."
        ),
    )
    make.add_argument("source", metavar="SOURCE_FILE", help="one source sentence per line")
    make.add_argument("--lang", required=True, choices=["en", "zh"], help="source language")
    make.add_argument("--out", required=True, help="log to write (JSON Lines)")
    make.add_argument("--references", help="references aligned line by line with the sources")
    make.add_argument("--limit", type=non_negative_int, default=None, help="first N lines only")
    make.add_argument(
        "--seed", type=int, default=0, help="the same seed gives the same log (default 0)"
    )
    make.add_argument(
        "--stream-id", type=_stream_id, default="s1", help="stream id (default %(default)s)"
    )
    make.add_argument(
        "--realistic",
        action="store_true",
        help="like a real streaming recogniser: rewrites words it already showed (about 40%% "
        "of changes), finals that differ from the last partial, lowercase, no punctuation",
    )
    make.add_argument(
        "--rewrite-rate",
        type=probability,
        default=None,
        metavar="P",
        help="chance per partial that shown words are rewritten (--realistic: 0.3)",
    )
    make.add_argument("--lowercase", action="store_true", help="lowercase text")
    make.add_argument("--no-punctuation", action="store_true", help="drop punctuation")
    hint = log_commands.add_parser(
        "hint",
        help="add recogniser stability hints (stable_chars) to a log",
        description="Write LOG with stable_chars on every partial: the characters no later "
        "message of its segment changes, less the last --lag units. Truthful by "
        "construction: what a recogniser that reports its settled text could send.",
    )
    hint.add_argument("log", metavar="LOG", help="transcript log to read")
    hint.add_argument("--out", required=True, help="log to write (JSON Lines)")
    hint.add_argument(
        "--lag",
        type=non_negative_int,
        default=0,
        help="units a recogniser takes to confirm a word (default %(default)s)",
    )
    merge = log_commands.add_parser(
        "merge",
        help="interleave logs of different streams by emit time",
        description="Merge logs (each with its own stream ids) into one, ordered by emit_ms.",
    )
    merge.add_argument("logs", nargs="+", metavar="LOG", help="logs to merge")
    merge.add_argument("--out", required=True, help="merged log to write")

    add_serve_parser(commands)
    add_models_parser(commands)
    return parser


def _describe_os_error(exc: OSError) -> str:
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "serve":  # serve logs at its own --log-level, with timestamps
        _setup_logging()
    try:
        if args.command == "translate":
            return run_translate(args, sys.stdin.buffer, sys.stdout)
        if args.command == "replay":
            return run_replay(args, sys.stdout, sys.stderr)
        if args.command == "logs" and args.logs_command == "make":
            return run_logs_make(args, sys.stderr)
        if args.command == "logs" and args.logs_command == "hint":
            return run_logs_hint(args, sys.stderr)
        if args.command == "logs" and args.logs_command == "merge":
            return run_logs_merge(args, sys.stderr)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "models":
            return run_models(args)
    except (EngineError, TranscriptLogError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {_describe_os_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
