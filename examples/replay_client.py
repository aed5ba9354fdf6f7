"""Replay a transcript log into a running `nmt-incremental serve`, in real time: the same
as `nmt-incremental send` (engine/cli/send.py, engine/sender.py), kept under this name for
the scripts and benchmarks that import it.

    python examples/replay_client.py examples/logs/fixture_en_zh.jsonl --stream-id mic-1
    python examples/replay_client.py LOG --url ws://host:8765/ws --token SECRET --quiet

It prints the subtitle page of each stream first, then every update as it comes back, and
a summary; a lost connection is made again and every unanswered final resent.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from engine.cli.parser import Parser
from engine.cli.send import add_send_arguments, run_send
from engine.sender import (
    LogLine,
    ReplayResult,
    format_message,
    page_url,
    percentile,
    read_log,
    renamer,
    replay,
    summary,
    waiting_note,
)

__all__ = [
    "LogLine",
    "ReplayResult",
    "format_message",
    "main",
    "page_url",
    "percentile",
    "read_log",
    "renamer",
    "replay",
    "summary",
    "waiting_note",
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="replay_client.py", description=__doc__.splitlines()[0])
    add_send_arguments(parser)
    return run_send(parser.parse_args(argv), sys.stdout, sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
