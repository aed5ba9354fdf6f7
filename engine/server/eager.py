"""Sending a WebSocket message at once, from whichever task has it, without waking the
connection's sender task.

`websockets`' `send` is a coroutine that, on an open connection whose write buffer is
empty, writes its frame and returns without ever suspending: the usual way (queue the
message, wake the sender task, which awaits `send`) costs a task wake-up and an event per
message for nothing. `send_now` does what that coroutine does there, by hand: the frame
made by the connection's protocol and written to its transport (`send_data`), then its
flow control (`drain`), which only waits when the transport paused. Its coroutine and
its `send_context` (a context manager around a generator, for the errors and the closing
handshake it never meets on an open connection) were a third of the send's Python
(docs/performance.md, "The loop's thread hop and its own Python"). Should the drain
suspend (the transport paused), what is left of it is returned as an awaitable
(`Unfinished`) for the sender task to finish before it sends anything else, so that the
order of messages and the flow control hold.
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosedError
from websockets.protocol import State

BY_HAND = ("send_in_progress", "set_connection_exc", "paused", "send_data", "drain")
"""What the by-hand send reads of a connection beyond `send`: websockets' own, not its
documented API (all there from 17.0; 16.0 lacks `set_connection_exc`, 13-15
`send_in_progress`). A connection without them has its `send` run by hand as it is."""

_by_hand: dict[type, bool] = {}


def by_hand(ws: ServerConnection) -> bool:
    """Whether `ws`'s class has everything the by-hand send reads (`BY_HAND`)."""
    kind = type(ws)
    known = _by_hand.get(kind)
    if known is None:
        known = _by_hand[kind] = all(hasattr(ws, name) for name in BY_HAND)
    return known


def idle_and_open(ws: ServerConnection) -> bool:
    """Whether a message to `ws` may be sent at once: the connection is open, nothing
    waits in its transport's buffer (so the socket takes the frame now and `send` does not
    wait for it to drain), and it is not closing."""
    transport = ws.transport
    return (
        ws.protocol.state is State.OPEN
        and getattr(ws, "send_in_progress", None) is None  # no fragmented message being sent
        and not transport.is_closing()
        and transport.get_write_buffer_size() == 0
    )


def send_now(ws: ServerConnection, data: str) -> Unfinished | None:
    """Send `data` as a text frame from the calling task, on a connection that is idle and
    open (`idle_and_open`): None once sent, else the rest of the send, which the caller
    must await (in order, before any other message) to finish it. Raises what `send`
    raises before its first suspension (`ConnectionClosed`)."""
    coro: Coroutine[Any, Any, None]
    if not by_hand(ws) or ws.protocol.state is not State.OPEN or ws.send_in_progress is not None:
        coro = ws.send(data)  # `send` as it is, by hand (not idle and open after all)
    else:
        try:
            ws.protocol.send_text(data.encode())
            ws.send_data()
        except Exception as exc:  # `send_context`'s net for a bug: the connection ends
            ws.logger.error("unexpected internal error", exc_info=True)
            ws.set_connection_exc(exc)
            ws.transport.abort()
            raise ConnectionClosedError(None, None) from exc
        if not ws.paused:  # the drain would not wait
            return None
        coro = ws.drain()
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return Unfinished(coro, waiting)


class Unfinished:
    """The rest of a coroutine that was started by hand and suspended on `waiting` (what it
    yielded to its event loop): awaiting this resumes it, in the awaiting task, where it
    stopped; a cancellation of that task is thrown into it."""

    def __init__(self, coro: Coroutine[Any, Any, None], waiting: Any) -> None:
        self.coro = coro
        self.waiting = waiting

    def __await__(self) -> Generator[Any, Any, None]:
        coro, value = self.coro, self.waiting
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation: the coroutine's to handle
                try:
                    value = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    value = coro.send(sent)
                except StopIteration:
                    return

    def close(self) -> None:
        """Give up on the rest (the connection is gone)."""
        self.coro.close()
