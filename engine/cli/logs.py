"""`nmt-incremental logs {make,hint,merge}`: make the transcript logs that `replay` reads.

The work is `engine.logs`; each command writes a log and says on stderr what it holds.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TextIO

import protocol
from engine.cli.args import non_negative_int, probability
from engine.evaluation.revisions import source_revisions
from engine.languages import UNIT_LANGS
from engine.logs.format import TranscriptLogError, read_log, references_output_path, write_log
from engine.logs.hints import with_stability_hints
from engine.logs.make import DEFAULT_STREAM_ID, AsrStyle, make_log_files
from engine.logs.merge import SharedStreamId, interleave_logs


def _stream_id(value: str) -> str:
    try:
        return protocol.CloseStream(value).stream_id  # the protocol's own stream-id rules
    except protocol.InvalidMessage as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_logs_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    logs = subparsers.add_parser(
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
    make.add_argument("--lang", required=True, choices=UNIT_LANGS, help="source language")
    make.add_argument("--out", required=True, help="log to write (JSON Lines)")
    make.add_argument("--references", help="references aligned line by line with the sources")
    make.add_argument("--limit", type=non_negative_int, default=None, help="first N lines only")
    make.add_argument(
        "--seed", type=int, default=0, help="the same seed gives the same log (default 0)"
    )
    make.add_argument(
        "--stream-id",
        type=_stream_id,
        default=DEFAULT_STREAM_ID,
        help="stream id (default %(default)s)",
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


def run_logs(args: argparse.Namespace, stderr: TextIO) -> int:
    """Run a `logs` subcommand."""
    if args.logs_command == "make":
        return run_logs_make(args, stderr)
    if args.logs_command == "hint":
        return run_logs_hint(args, stderr)
    return run_logs_merge(args, stderr)


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
        stream_id=args.stream_id,
    )
    lines = read_log(args.out)
    refs = f", references in {references_output_path(args.out)}" if args.references else ""
    print(f"{args.out}: {segments} segments, {len(lines)} events{refs}", file=stderr)
    print(f"  {source_revisions(lines, args.lang).format()}", file=stderr)
    return 0


def run_logs_hint(args: argparse.Namespace, stderr: TextIO) -> int:
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
    try:
        merged = interleave_logs(*(read_log(path) for path in args.logs))
    except SharedStreamId as exc:
        raise TranscriptLogError(
            f"stream {exc.stream_id!r} is in both {args.logs[exc.first]} and "
            f"{args.logs[exc.second]}: logs to merge need their own stream ids (make one "
            "again with `nmt-incremental logs make ... --stream-id OTHER`)"
        ) from None
    except ValueError as exc:
        if isinstance(exc, TranscriptLogError):
            raise
        raise TranscriptLogError(str(exc)) from None
    write_log(args.out, merged)
    print(f"{args.out}: {len(merged)} events from {len(args.logs)} logs", file=stderr)
    return 0
