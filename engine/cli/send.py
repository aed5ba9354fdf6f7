"""`nmt-incremental send`: a transcript log into a running server, in real time, as a
recogniser would send it (`engine.sender`), printing every update that comes back.

The installed writer: with a wheel and no checkout, `send fixture_en_zh` plays the log the
package ships. `examples/replay_client.py` is this command under its older name.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import TextIO

from websockets.exceptions import InvalidHandshake

from engine.cli.numbers import non_negative_float, positive_float
from engine.distribution import LOGS, packaged_log
from engine.sender import format_message, page_url, read_log, renamer, replay, summary
from protocol import ErrorMessage, TranslationUpdate

DEFAULT_URL = "ws://127.0.0.1:8765/ws"


def add_send_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    send = subparsers.add_parser(
        "send",
        help="play a transcript log into a running server, in real time",
        description="Send a transcript log's partials and finals to a running `serve` on "
        "their schedule (emit_ms), as a recogniser would, and print every update that "
        "comes back; a lost connection is made again and unanswered finals are resent.",
    )
    add_send_arguments(send)


def add_send_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `send` (and of `examples/replay_client.py`)."""
    shipped = ", ".join(LOGS)
    parser.add_argument(
        "log",
        metavar="LOG",
        help=f"transcript log (JSON Lines with emit_ms), or a log the package ships: {shipped}",
    )
    parser.add_argument(
        "--to",
        "--url",
        dest="url",
        default=DEFAULT_URL,
        metavar="URL",
        help="the server's WebSocket URL, or a load balancer's in front of several nodes: "
        "a lost connection is made again to this URL (default %(default)s)",
    )
    parser.add_argument(
        "--stream-id",
        default="demo",
        metavar="ID",
        help="send the log's stream as ID (several streams: ID-NAME each); default "
        "%(default)s, the stream the server's banner and the subtitle page show without "
        "?stream=; an empty ID (--stream-id=) keeps the log's own ids",
    )
    parser.add_argument("--token", default=None, help="the server's --token (the writer's)")
    parser.add_argument(
        "--viewer-token",
        default=None,
        help="the server's --viewer-token, for the page URL printed (never the writer's)",
    )
    parser.add_argument(
        "--speed", type=positive_float, default=1.0, help="2 = twice real time (default 1)"
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="print only the summary (and, when no server answers yet, that it waits)",
    )
    parser.add_argument(
        "--reconnect-for",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="when the connection is lost, keep trying to reconnect (and resend the finals "
        "not yet answered) for this long before giving up (default %(default)g; 0: never)",
    )


def log_path(name: str) -> Path:
    """A log file given by path, else one the package ships by name; the path as given
    otherwise (reading it says what is wrong)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    return packaged_log(name) or path


def run_send(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Play the log; 0 when every final was answered, 1 when some were not, 2 when no
    server could be reached."""
    path = log_path(args.log)
    lines = read_log(path)
    if args.stream_id:
        lines = read_log(path, renamer(lines, args.stream_id))
    for stream in sorted({line.event.stream_id for line in lines}):
        print(f"subtitle page: {page_url(args.url, stream, args.viewer_token)}", file=err)
    notices = None if args.quiet else (lambda line: print(line, file=err))
    color = out.isatty()  # a file or a pipe gets plain text

    def show(message: TranslationUpdate | ErrorMessage) -> None:
        print(format_message(message, color=color), file=out, flush=True)

    began = time.monotonic()
    try:
        result = asyncio.run(
            replay(
                args.url,
                lines,
                speed=args.speed,
                token=args.token,
                on_message=None if args.quiet else show,
                reconnect_for=args.reconnect_for,
                on_event=notices,
                on_wait=lambda line: print(line, file=err, flush=True),
            )
        )
    except (OSError, InvalidHandshake) as exc:
        tried = time.monotonic() - began
        waited = f" (tried for {tried:.0f} s)" if args.reconnect_for else ""
        print(f"error: cannot connect to {args.url}: {exc}{waited}", file=err)
        return 2
    print(summary(result), file=err)
    return 0 if not result.lost_finals else 1
