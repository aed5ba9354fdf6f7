"""Live subtitles over WebSocket: `nmt-incremental serve` and the subtitle page.

`connection` holds the per-connection rules (sans I/O), `app` the asyncio server built on
the `websockets` library, `metrics` the Prometheus metrics, `cli` the command line.
"""

from engine.server.app import ServerOptions, SubtitleServer
from engine.server.cli import add_serve_parser, run_serve
from engine.server.connection import Limits

__all__ = ["Limits", "ServerOptions", "SubtitleServer", "add_serve_parser", "run_serve"]
