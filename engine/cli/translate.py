"""`nmt-incremental translate`: one translation per line, for TEXT arguments or stdin lines.

A line that cannot be read or translated gets an empty output line and an error on stderr,
so that output lines stay aligned with input lines and the other lines are translated.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import BinaryIO, TextIO

from engine.cli.args import (
    add_decode_arguments,
    add_model_arguments,
    decode_options,
    load_translator,
    read_glossary,
)
from engine.errors import EngineError


def add_translate_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    translate = subparsers.add_parser(
        "translate",
        help="translate text, one translation per line",
        description="Translate TEXT arguments, or stdin lines when none are given.",
    )
    add_model_arguments(translate)
    add_decode_arguments(translate)
    translate.add_argument("text", nargs="*", help="source text (default: read stdin lines)")


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


def run_translate(args: argparse.Namespace, stdin: BinaryIO, stdout: TextIO) -> int:
    glossary = read_glossary(args)
    options = decode_options(args)
    translator = load_translator(args, glossary)
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
