"""A real `SubtitleServer` on loopback for tests, and the client side of talking to it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import InvalidStatus

from engine.decoding.search import DecodeOptions
from engine.decoding.translator import Translator
from engine.server.app import ServerOptions, SubtitleServer
from engine.server.limits import Limits
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.session import StreamingOptions
from tests.conftest import partial_message

SENTENCE = "I will meet Tom at three"
PREFIXES = ["I", "I will", "I will meet", "I will meet Tom", "I will meet Tom at"]
# Bounded decodes keep these tests quick whatever the model; the fixture's translations
# are far shorter than this.
STREAMING = StreamingOptions(decode=DecodeOptions(max_new_tokens=32))


@asynccontextmanager
async def serving(
    translator: Translator, *, max_streams: int = 64, **options: Any
) -> AsyncIterator[SubtitleServer]:
    options.setdefault("limits", Limits(rate_limit=None))
    options.setdefault("port", 0)
    async with (
        IncrementalTranslator(translator, STREAMING, max_streams=max_streams) as nmt,
        SubtitleServer(nmt, ServerOptions(**options)) as server,
    ):
        yield server


def ws_url(server: SubtitleServer, query: str = "") -> str:
    return f"ws://127.0.0.1:{server.port}/ws{query}"


async def recv(ws: ClientConnection, timeout: float = 20.0) -> dict[str, Any]:
    with anyio.fail_after(timeout):
        data = await ws.recv()
    assert isinstance(data, str)
    message: dict[str, Any] = json.loads(data)
    return message


async def until_final(ws: ClientConnection, stream: str = "s1") -> list[dict[str, Any]]:
    """Messages received until the final update of `stream` (errors included)."""
    seen = []
    while True:
        message = await recv(ws)
        seen.append(message)
        is_update = message["type"] == "translation_update"
        if is_update and message["stream_id"] == stream and message["is_final"]:
            return seen


async def send_sentence(ws: ClientConnection, stream: str = "s1", seq0: int = 0) -> None:
    for i, text in enumerate([*PREFIXES, SENTENCE]):
        await ws.send(partial_message(stream, seq0 + i, text, final=text == SENTENCE))


@dataclass
class HttpResult:
    status: int
    headers: dict[str, str]
    body: str


async def http_get(server: SubtitleServer, path: str, **headers: str) -> HttpResult:
    def fetch() -> HttpResult:
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return HttpResult(response.status, dict(response.headers), response.read().decode())
        except urllib.error.HTTPError as exc:
            return HttpResult(exc.code, dict(exc.headers), exc.read().decode())

    return await anyio.to_thread.run_sync(fetch)


@contextmanager
def refused_with(status: int) -> Iterator[None]:
    with pytest.raises(InvalidStatus) as info:
        yield
    assert info.value.response.status_code == status


def open_streams(server: SubtitleServer) -> list[str]:
    """Streams in the server's engine, closing ones included."""
    return server.engine.streams if server.engine is not None else []
