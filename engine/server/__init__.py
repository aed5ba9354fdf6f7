"""Live subtitles over WebSocket: the server behind `nmt-incremental serve` and its pages.

`connection` holds the per-connection rules (sans I/O), `app` the asyncio server built on
the `websockets` library, `metrics` the Prometheus metrics; the command line is
`engine.cli.serve`.
"""

from engine.server.app import ServerOptions, SubtitleServer
from engine.server.connection import Limits

__all__ = ["Limits", "ServerOptions", "SubtitleServer"]
