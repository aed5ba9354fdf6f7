"""A server's shutdown: drain what was accepted, within a deadline, then give up on the rest.

Kept apart from the server's other duties because its order is the reply contract: the
engine finishes every accepted final before the outboxes end, and past the deadline each
final still owed is answered `unavailable` before the sockets close, so every final a
client sent gets exactly one reply. Each connection then sends its own close frame (1001)
once every message it read has been answered (`Client._close_going_away`): a final that
reaches the server before its close frame is answered, one that crosses it is the
client's to send again after reconnecting (docs/protocol.md says so).

Speakers come first, because they cannot send again: every audio stream ends as
`end_audio` would (its queued audio recognized, its recognizer flushed, the finals pushed
while the engine still translates), and those still recognizing after `AUDIO_SHARE` of
the timeout are cut (`AudioFeed.cut`: the utterance in progress ends with the words shown
last, the speaker is told of the audio left unrecognized), so that the engine has the
rest of the timeout to translate their finals, and past it answers them `unavailable`
like any other.

The whole of it is bounded: `timeout` for the audio and the engine, then `ABORT_GRACE` for
the last replies and the close handshakes; a connection that has not finished its close
handshake by then (a client that never answers the close frame) is cut.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import anyio
from websockets.asyncio.server import Server

from engine.server.client import Client
from engine.streaming.controller import IncrementalTranslator

log = logging.getLogger(__name__)

ABORT_GRACE = 2.0
"""Seconds past the shutdown timeout for the `unavailable` replies to reach their clients
and for the close handshakes: nothing in a shutdown lasts longer than timeout + this."""

CLOSE_GRACE = 1.0
"""Seconds a client has to answer the server's close frame once its last reply went out
(within `ABORT_GRACE` past the timeout); then its connection is cut."""

CUT_WAIT = 0.5
"""Seconds for the handlers of cut connections to return."""

AUDIO_SHARE = 0.5
"""Share of the shutdown timeout in which audio streams may still recognize what they
hold; then they are cut, and the rest is left to translate their last finals."""

ABORT_REASON = "the server shut down before this final transcript could be translated"


async def shut_down(
    engine: IncrementalTranslator | None,
    clients: Collection[Client],
    server: Server | None,
    timeout: float,
) -> None:
    """The whole shutdown after the server stopped taking work: `drain`, then
    `close_listener`, within `timeout` + `ABORT_GRACE` seconds in all."""
    limit = anyio.current_time() + timeout + ABORT_GRACE
    try:
        await drain(engine, clients, timeout, limit)
    finally:
        until = min(limit, anyio.current_time() + CLOSE_GRACE)
        await close_listener(server, clients, until)


async def drain(
    engine: IncrementalTranslator | None,
    clients: Collection[Client],
    timeout: float,
    limit: float | None = None,
) -> None:
    """Shut the engine down and send every connection what it is owed, within `timeout`
    seconds; past it, abort the engine and give its `unavailable` replies until `limit`
    (default: `ABORT_GRACE` past the timeout)."""
    if limit is None:
        limit = anyio.current_time() + timeout + ABORT_GRACE
    with anyio.move_on_after(timeout) as deadline:
        await end_audio(clients, timeout * AUDIO_SHARE)
        if engine is not None:
            # Every stream closes; its accepted finals are translated and delivered, then
            # every subscription (writers' and viewers') ends.
            await engine.aclose()
        await flush(clients)
    if deadline.cancelled_caught:
        if engine is not None:
            answered = engine.abort(ABORT_REASON)
            log.info("shutdown timeout: %d finals answered as unavailable", answered)
        with anyio.move_on_at(limit):
            await flush(clients)


async def end_audio(clients: Collection[Client], cut_after: float) -> None:
    """End every connection's audio streams at once and return when their last finals are
    pushed; those still recognizing after `cut_after` seconds are cut."""
    cut: list[int] = []

    async def finish(client: Client) -> None:
        cut.append(await client.finish_audio(cut_after))

    async with anyio.create_task_group() as group:
        for client in list(clients):
            if client.feeds:
                group.start_soon(finish, client)
    if sum(cut):
        log.info("shutdown: %d audio streams cut short after %.1f s", sum(cut), cut_after)


async def flush(clients: Collection[Client]) -> None:
    """End every outbox once its subscriptions have ended; wait until all is sent and
    each connection has sent its close frame."""
    for client in list(clients):
        client.end_when_forwarded()
    for client in list(clients):
        await client.wait_sent()


async def close_listener(
    server: Server | None, clients: Collection[Client] = (), until: float | None = None
) -> None:
    """Close the listening socket and every connection (code 1001, going away); wait for
    the close handshakes until `until` (default: `CLOSE_GRACE` from now), then cut the
    connections still open, so that a client that never answers cannot hold the exit."""
    if server is None:
        return
    if until is None:
        until = anyio.current_time() + CLOSE_GRACE
    server.close()
    with anyio.move_on_at(until):
        await server.wait_closed()
        return
    cut = 0
    for client in list(clients):
        if not client.ws.transport.is_closing():
            cut += 1
        client.ws.transport.abort()
    # Connections past their handshake that are not (yet) a client: the same.
    for connection in list(getattr(server, "all_connections", ())):
        connection.transport.abort()
    if cut:
        log.info("shutdown: cut %d connections that did not finish the close handshake", cut)
    with anyio.move_on_after(CUT_WAIT):  # their handlers return at once now
        await server.wait_closed()
