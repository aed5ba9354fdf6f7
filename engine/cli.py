"""`nmt-incremental` command line: a thin I/O layer over the engine."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from typing import BinaryIO, TextIO

from engine.decoding import DecodeOptions
from engine.errors import EngineError
from engine.translator import Translator


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return number


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every model-using command shares."""
    parser.add_argument("--model", required=True, help="model directory (Optimum ONNX layout)")
    parser.add_argument("--quantized", action="store_true", help="use the *_quantized ONNX files")
    parser.add_argument(
        "--no-cache", action="store_true", help="re-run the whole prefix every step (slow)"
    )
    parser.add_argument("--threads", type=_positive, default=None, help="ONNX Runtime threads")


def load_translator(args: argparse.Namespace) -> Translator:
    return Translator.from_dir(
        args.model,
        quantized=args.quantized,
        use_cache=not args.no_cache,
        intra_op_threads=args.threads,
    )


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
    translator = load_translator(args)
    options = DecodeOptions(beam_size=args.beam, max_new_tokens=args.max_new_tokens)
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
    translate.add_argument("--beam", type=_positive, default=1, help="beam size (1 = greedy)")
    translate.add_argument("--max-new-tokens", type=_positive, default=None)
    translate.add_argument("text", nargs="*", help="source text (default: read stdin lines)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "translate":
            return run_translate(args, sys.stdin.buffer, sys.stdout)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
