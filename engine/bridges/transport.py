"""The recogniser's side of a bridge as connections: opening them, reading what the
recogniser says, and relaying a session both ways.

Whatever the kind, a connection's messages go to one `Feed` (map and push); the kinds
differ only in what they send, which `runner` keeps apart from the bytes moving here.
"""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
from anyio.abc import SocketStream
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from engine.bridges.errors import BridgeError
from engine.bridges.whisper_streaming import LineSplitter

MAX_MESSAGE = 2**24  # recogniser messages: WhisperLive repeats its last n segments
_READ_BYTES = 65536

Feed = Callable[[str | bytes], Awaitable[bool]]
"""Map and push one message of the recogniser; whether it meant something."""

Send = Callable[[list[float], anyio.Event], Awaitable[bool]]
"""A kind's sending beside the receiving: given when the recogniser last spoke and an
event set once the connection closed; whether it got to the end of the input."""


def tcp_address(url: str) -> tuple[str, int]:
    """`host:port` or `tcp://host:port`."""
    parsed = urllib.parse.urlsplit(url if "://" in url else f"tcp://{url}")
    if parsed.hostname is None or parsed.port is None:
        raise BridgeError(f"{url!r}: give the whisper_streaming server as HOST:PORT")
    return parsed.hostname, parsed.port


def close_reason(ws: ClientConnection | ServerConnection) -> str:
    code = ws.close_code
    if code is None or code == 1006:
        return "connection dropped"
    return f"close {code} {ws.close_reason or ''}".rstrip()


async def open_ws(url: str, *, close_timeout: float = 10.0) -> ClientConnection:
    """A WebSocket to the recogniser, taking its largest messages."""
    return await connect(url, max_size=MAX_MESSAGE, open_timeout=10.0, close_timeout=close_timeout)


async def open_tcp(url: str) -> SocketStream:
    """A TCP connection to a whisper_streaming server at `host:port`."""
    host, port = tcp_address(url)
    with anyio.fail_after(10.0):
        return await anyio.connect_tcp(host, port)


@dataclass
class Link:
    """How a bridge reads its recogniser: every message goes to `feed`; `on_idle` hears a
    pause of `idle` seconds on a TCP session; `end_wait` is how long the recogniser may go
    quiet after the input before the bridge ends the session."""

    feed: Feed
    on_idle: Callable[[], Awaitable[None]]
    idle: float
    end_wait: float

    async def receive(self, ws: ClientConnection, heard: list[bool], last: list[float]) -> None:
        """Map text messages until the connection ends."""
        with contextlib.suppress(ConnectionClosed):
            async for message in ws:
                last[0] = time.monotonic()
                if isinstance(message, str) and await self.feed(message):
                    heard[0] = True

    async def duplex(self, ws: ClientConnection, heard: list[bool], send: Send) -> bool:
        """`send` beside the receiving, until the connection ends; returns whether `send`
        got to the end of the input first."""
        over = False
        closed = anyio.Event()
        last = [time.monotonic()]
        async with anyio.create_task_group() as tg:

            async def sending() -> None:
                nonlocal over
                with contextlib.suppress(ConnectionClosed):
                    over = await send(last, closed)
                    with anyio.move_on_after(self.end_wait):
                        await closed.wait()  # the server closes once it has answered
                    await ws.close()

            tg.start_soon(sending)
            await self.receive(ws, heard, last)
            closed.set()
            if not over:
                tg.cancel_scope.cancel()
        return over

    async def quiet(self, last: list[float]) -> None:
        """Wait until the recogniser has said nothing for `end_wait` seconds."""
        while (left := last[0] + self.end_wait - time.monotonic()) > 0:
            await anyio.sleep(min(left, 0.1))

    async def tcp_lines(
        self,
        stream: SocketStream,
        heard: list[bool],
        relay: SocketStream | None = None,
    ) -> str:
        """Map the server's lines until it closes (and copy its bytes to `relay`);
        returns why it ended. A pause of `idle` seconds is told to `on_idle`."""
        splitter = LineSplitter()
        why = "connection closed by the server"
        while True:
            with anyio.move_on_after(self.idle) as waited:
                try:
                    data = await stream.receive(_READ_BYTES)
                except anyio.EndOfStream:
                    break
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    why = "connection dropped"
                    break
            if waited.cancelled_caught:
                await self.on_idle()
                continue
            if relay is not None:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await relay.send(data)
            for line in splitter.feed(data):
                heard[0] = await self.feed(line) or heard[0]
        for line in splitter.close():
            await self.feed(line)
        return why

    async def relay_ws(self, client: ServerConnection, upstream: ClientConnection) -> None:
        """Relay a session between the user's client and the recogniser, unchanged, mapping
        what the recogniser says, until either side ends it."""
        async with upstream, anyio.create_task_group() as tg:

            async def up() -> None:
                with contextlib.suppress(ConnectionClosed):
                    async for message in client:
                        await upstream.send(message)
                await upstream.close()

            tg.start_soon(up)
            with contextlib.suppress(ConnectionClosed):
                async for message in upstream:
                    await client.send(message)
                    if isinstance(message, str):
                        await self.feed(message)
            tg.cancel_scope.cancel()

    async def relay_tcp(self, client: SocketStream, upstream: SocketStream) -> str:
        """`relay_ws` for whisper_streaming's TCP; returns why the session ended."""
        async with client, upstream, anyio.create_task_group() as tg:

            async def up() -> None:
                with contextlib.suppress(
                    anyio.EndOfStream,
                    anyio.BrokenResourceError,
                    anyio.ClosedResourceError,
                ):
                    while True:
                        await upstream.send(await client.receive(_READ_BYTES))
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await upstream.send_eof()

            tg.start_soon(up)
            why = await self.tcp_lines(upstream, [False], relay=client)
            tg.cancel_scope.cancel()
        return why
