"""`nmt-incremental serve`'s command line: its options and their defaults.

Apart from `engine.cli.serve`, which runs what they ask for.
"""

from __future__ import annotations

import argparse
import os

import protocol
from engine.cli.args import (
    add_length_arguments,
    add_model_arguments,
    add_policy_argument,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from engine.cli.serve_audio import add_audio_arguments
from engine.server.admission import DEFAULT_HANDSHAKE_TIMEOUT, ConnectionCaps, descriptor_limit
from engine.streaming.redis_bus import LEASE_MS

LOG_LEVELS = ("debug", "info", "warning", "error")

TOKEN_ENV = "NMT_INCREMENTAL_TOKEN"
VIEWER_TOKEN_ENV = "NMT_INCREMENTAL_VIEWER_TOKEN"
METRICS_TOKEN_ENV = "NMT_INCREMENTAL_METRICS_TOKEN"
BUS_ENV = "NMT_INCREMENTAL_BUS"
#: `--coalesce-ms`'s default (docs/performance.md, "The loop's wake-ups coalesced").
COALESCE_MS = 5.0
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def _port(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError("must be between 0 and 65535")
    return number


def _stream_key(value: str) -> tuple[str, str]:
    stream, sep, key = value.partition("=")
    if not sep or not stream or not key:
        raise argparse.ArgumentTypeError("must be STREAM=SECRET")
    return stream, key


def add_serve_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `serve` subcommand to `nmt-incremental`'s subparsers."""
    p = subparsers.add_parser(
        "serve",
        help="serve live subtitles over WebSocket (with a subtitle page)",
        description=(
            "Translate partial transcripts sent to ws://HOST:PORT/ws and show them on the "
            "subtitle page http://HOST:PORT/?stream=ID (&lang=LANG with several models). "
            "Also serves /healthz, /readyz and /metrics. Stops gracefully on "
            "SIGINT/SIGTERM, delivering pending finals."
        ),
    )
    add_model_arguments(p, several=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument(
        "--port", type=_port, default=8765, help="port (0: any free port; default %(default)s)"
    )
    p.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help="the writers' secret, sent as 'Authorization: Bearer' or ?token=: it writes, "
        "closes and takes over any stream, and reads /metrics unless --metrics-token is "
        f"set; never put it in a page shown to viewers (default: ${TOKEN_ENV}; none: "
        "anyone may write)",
    )
    p.add_argument(
        "--viewer-token",
        default=os.environ.get(VIEWER_TOKEN_ENV),
        metavar="SECRET",
        help="the viewers' secret (the subtitle page's ?token=): it watches streams and can "
        f"never write, close or take one over (default: ${VIEWER_TOKEN_ENV}; none: anyone "
        "may watch)",
    )
    p.add_argument(
        "--stream-key",
        action="append",
        type=_stream_key,
        default=[],
        metavar="STREAM=SECRET",
        help="a writer key for one stream (repeatable): it writes that stream alone, and "
        "only it or --token may write that stream",
    )
    p.add_argument(
        "--metrics-token",
        default=os.environ.get(METRICS_TOKEN_ENV),
        metavar="SECRET",
        help=f"the secret /metrics needs (default: ${METRICS_TOKEN_ENV}; none: --token's)",
    )
    add_policy_argument(p)
    add_length_arguments(p)
    p.add_argument(
        "--allow-origin",
        action="extend",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="browser origins allowed to connect, e.g. http://localhost:8765 (default: any)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=positive_int,
        metavar="N",
        default=protocol.codec.MAX_MESSAGE_BYTES,
        help="larger messages get a too_large error (default %(default)s)",
    )
    p.add_argument(
        "--max-streams-per-connection",
        type=positive_int,
        metavar="N",
        default=16,
        help="streams one connection may write or view (default %(default)s)",
    )
    p.add_argument(
        "--max-streams",
        type=positive_int,
        default=256,
        metavar="N",
        help="open streams in total (default %(default)s)",
    )
    p.add_argument(
        "--glossary",
        action="append",
        default=[],
        metavar="FILE",
        help="terms every stream's translations place, one file per target language "
        "(TSV naming its languages first: docs/glossaries.md); repeat for each language",
    )
    p.add_argument(
        "--rate-limit",
        type=non_negative_float,
        default=50.0,
        metavar="MSGS_PER_SEC",
        help="messages per second per connection, bursts of one second (0: off; default "
        "%(default)s)",
    )
    caps = ConnectionCaps.derive()
    limit = descriptor_limit()
    p.add_argument(
        "--max-connections",
        type=positive_int,
        metavar="N",
        help="WebSocket connections held at once; more are answered 503 (default: derived "
        f"from the descriptor limit, `ulimit -n`: {caps.max_connections} at its {limit} "
        "here, leaving room for pending handshakes and files)",
    )
    p.add_argument(
        "--max-connections-per-address",
        type=non_negative_int,
        metavar="N",
        help="WebSocket connections from one client address (an IPv6 one by its /64); more "
        "are answered 429 (0: no cap, e.g. behind a reverse proxy; default: half of "
        "--max-connections)",
    )
    p.add_argument(
        "--handshake-timeout",
        type=positive_float,
        metavar="SECONDS",
        default=DEFAULT_HANDSHAKE_TIMEOUT,
        help="seconds a new connection may take to send its HTTP request before it is "
        "dropped (its descriptor freed); past the pending room the oldest goes first "
        "(default %(default)s)",
    )
    p.add_argument(
        "--record",
        metavar="DIR",
        help="write every stream's finals to subtitle files in DIR as they arrive "
        "(STREAM.RUN.EPOCH.vtt, RUN the server's start time: a restart never writes over "
        "earlier files; a crash loses at most the final being written). DIR is created if "
        "missing and checked before serving",
    )
    p.add_argument(
        "--record-format",
        choices=("vtt", "srt"),
        default="vtt",
        help="subtitle format for --record (default %(default)s)",
    )
    p.add_argument(
        "--bus",
        default=os.environ.get(BUS_ENV) or None,
        metavar="redis://HOST:PORT/DB",
        help="share streams with other serve nodes through this Redis (>= 7): run several "
        "identical nodes behind any load balancer; a writer may reconnect to any node, a "
        "viewer watch from any node, a node may die without losing a final (needs the "
        f"[cluster] extra; default: ${BUS_ENV}; none: this process alone)",
    )
    p.add_argument(
        "--lease-ms",
        type=positive_int,
        default=LEASE_MS,
        metavar="MS",
        help="with --bus: how long a stream stays this node's without renewal; a node "
        "that dies holds its streams this long at most (default %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="serve from N processes on one port (SO_REUSEPORT), each with its own model and "
        "an equal share of the cores, sharing streams through --bus, or through a private "
        "redis-server on a unix socket when --bus is not given (needs the [cluster] extra); "
        "SIGTERM drains them all (default %(default)s: this process alone, no Redis)",
    )
    # Set in each worker of `--workers` by engine/cli/workers.py, never on a command line.
    p.set_defaults(reuse_port=False, worker_ready=None, worker_cores=None)
    add_audio_arguments(p)
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="what to log on stderr (default %(default)s: the URLs, ready, shutdown summary)",
    )
    p.add_argument(
        "--coalesce-ms",
        type=non_negative_float,
        default=COALESCE_MS,
        metavar="MS",
        help="under load, the event loop wakes at most every MS ms and handles what arrived "
        "meanwhile together, so the model's calls fill too: less CPU per update for up to "
        "MS ms of latency a hop; a lone stream is never held (0: every event at once; "
        "default %(default)s)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        metavar="SECONDS",
        default=10.0,
        help="seconds to finish pending finals at shutdown; the last replies and the "
        "close handshakes get 2 s more, then the process exits (default %(default)s)",
    )
