"""`nmt-incremental` command line: the parser, assembled from one module per subcommand
group, and the dispatch that turns the engine's errors into `error: ...` lines and exit
status 2 instead of tracebacks."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import cast

from engine.bridges.errors import BridgeError
from engine.cli.bridge import add_bridge_parser, run_bridge
from engine.cli.listen import add_listen_parser, run_listen
from engine.cli.logs import add_logs_parser, run_logs
from engine.cli.models import add_models_parser, run_models
from engine.cli.parser import Parser
from engine.cli.replay import add_replay_parser, run_replay
from engine.cli.send import add_send_parser, run_send
from engine.cli.serve import run_serve
from engine.cli.serve_args import add_serve_parser
from engine.cli.translate import add_translate_parser, run_translate
from engine.errors import EngineError, unwrapped
from engine.logs.format import TranscriptLogError


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


def version() -> str:
    """The installed package's version (its metadata: one source for it)."""
    try:
        return importlib.metadata.version("nmt-incremental")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="nmt-incremental", description="Live incremental machine translation (OPUS-MT, ONNX)."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    # Typed as the plain parser's: every add_*_parser takes any subparsers action.
    commands = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True),
    )
    add_translate_parser(commands)
    add_replay_parser(commands)
    add_logs_parser(commands)
    add_serve_parser(commands)
    add_send_parser(commands)
    add_models_parser(commands)
    add_listen_parser(commands)
    add_bridge_parser(commands)
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
        with unwrapped():
            return _dispatch(args)
    except (EngineError, TranscriptLogError, BridgeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {_describe_os_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "translate":
        return run_translate(args, sys.stdin.buffer, sys.stdout)
    if args.command == "replay":
        return run_replay(args, sys.stdout, sys.stderr)
    if args.command == "logs":
        return run_logs(args, sys.stderr)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "send":
        return run_send(args, sys.stdout, sys.stderr)
    if args.command == "models":
        return run_models(args)
    if args.command == "bridge":
        return run_bridge(args)
    if args.command == "listen":
        return run_listen(args, sys.stdin.buffer, sys.stdout, sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
