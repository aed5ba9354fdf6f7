"""A server's shutdown: drain what was accepted, within a deadline, then give up on the rest.

Kept apart from the server's other duties because its order is the reply contract: the
engine finishes every accepted final before the outboxes end, and past the deadline each
final still owed is answered `unavailable` before the sockets close, so every final a
client sent gets exactly one reply.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import anyio
from websockets.asyncio.server import Server

from engine.server.client import Client
from engine.streaming import IncrementalTranslator

log = logging.getLogger(__name__)

ABORT_GRACE = 2.0
"""Seconds past the shutdown timeout for the `unavailable` replies to reach their clients."""

ABORT_REASON = "the server shut down before this final transcript could be translated"


async def drain(
    engine: IncrementalTranslator | None, clients: Collection[Client], timeout: float
) -> None:
    """Shut the engine down and send every connection what it is owed, within `timeout`
    seconds; past it, abort the engine and give its `unavailable` replies `ABORT_GRACE`."""
    with anyio.move_on_after(timeout) as deadline:
        if engine is not None:
            # Every stream closes; its accepted finals are translated and delivered, then
            # every subscription (writers' and viewers') ends.
            await engine.aclose()
        await flush(clients)
    if deadline.cancelled_caught and engine is not None:
        answered = engine.abort(ABORT_REASON)
        log.info("shutdown timeout: %d finals answered as unavailable", answered)
        with anyio.move_on_after(ABORT_GRACE):
            await flush(clients)


async def flush(clients: Collection[Client]) -> None:
    """End every outbox once its subscriptions have ended; wait until all is sent."""
    for client in list(clients):
        client.end_when_forwarded()
    for client in list(clients):
        await client.wait_sent()


async def close_listener(server: Server | None, timeout: float) -> None:
    """Close the listening socket and every connection (code 1001, going away)."""
    if server is None:
        return
    server.close()
    with anyio.move_on_after(timeout):
        await server.wait_closed()
