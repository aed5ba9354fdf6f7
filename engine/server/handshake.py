"""What an HTTP request on the server's port asks for (`route`), and how a handshake is
refused (`Refusal`).

Decided from the request's path and headers alone, so that the handshake hook can answer
before any WebSocket exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlsplit

WS_PATH = "/ws"


class Route(Enum):
    """What an HTTP request on the server's port asks for."""

    WEBSOCKET = "ws"
    PAGE = "page"
    TRANSCRIPT = "transcript"
    SPEAK = "speak"
    INFO = "info"
    TERMS = "terms"
    STATIC = "static"
    HEALTHZ = "healthz"
    READYZ = "readyz"
    METRICS = "metrics"
    NOT_FOUND = "not_found"


_ROUTES = {
    WS_PATH: Route.WEBSOCKET,
    "/": Route.PAGE,
    "/index.html": Route.PAGE,
    "/transcript": Route.TRANSCRIPT,
    "/speak": Route.SPEAK,
    "/info": Route.INFO,
    "/terms": Route.TERMS,
    "/healthz": Route.HEALTHZ,
    "/readyz": Route.READYZ,
    "/metrics": Route.METRICS,
}

PAGES: dict[Route, str] = {
    Route.PAGE: "index.html",
    Route.TRANSCRIPT: "transcript.html",
    Route.SPEAK: "speak.html",
}
"""The HTML file in `static/` of each page route (served as text/html)."""

STATIC_FILES: dict[str, str] = {
    "/subtitles.css": "text/css; charset=utf-8",
    "/subtitles.js": "text/javascript; charset=utf-8",
    "/transcript.css": "text/css; charset=utf-8",
    "/transcript.js": "text/javascript; charset=utf-8",
    "/speak.css": "text/css; charset=utf-8",
    "/speak.js": "text/javascript; charset=utf-8",
    "/pcm-worklet.js": "text/javascript; charset=utf-8",
}
"""Assets the pages load, by path, with their content type (the pages are `PAGES`)."""


def route(path: str) -> Route:
    """Classify a request path (the query is ignored)."""
    bare = urlsplit(path).path
    if bare in STATIC_FILES:
        return Route.STATIC
    return _ROUTES.get(bare, Route.NOT_FOUND)


def request_path(path: str) -> str:
    """The path without its query, for logs: a query may carry the token."""
    return urlsplit(path).path


@dataclass(frozen=True)
class Refusal:
    """An HTTP refusal of a handshake: status, body and extra headers; `counted_as`: the
    reason `/metrics` counts it under among refused connections (caps), if any."""

    status: int
    reason: str
    headers: tuple[tuple[str, str], ...] = ()
    counted_as: str | None = None


# Headers the server decides on: a request carrying one of them twice is ambiguous (which
# token, which origin?), and proxies disagree on which copy wins, so it is refused.
SINGLE_HEADERS = ("Authorization", "Origin", "Accept")


def duplicate_headers(counts: Mapping[str, int]) -> Refusal | None:
    """A 400 when a header of `SINGLE_HEADERS` came more than once (`counts`: how many
    times each came), else `None`."""
    twice = [name for name in SINGLE_HEADERS if counts.get(name, 0) > 1]
    if not twice:
        return None
    return Refusal(400, f"Duplicate {', '.join(twice)} header: send it once.\n")
