"""Sending a WebSocket message at once, from whichever task has it, without waking the
connection's sender task.

`websockets`' `send` is a coroutine that, on an open connection whose write buffer is
empty, writes its frame and returns without ever suspending: the usual way (queue the
message, wake the sender task, which awaits `send`) costs a task wake-up and an event per
message for nothing. `send_now` runs that coroutine by hand; should it suspend after all
(the transport paused, or an error closing the connection), what is left of it is
returned as an awaitable (`Unfinished`) for the sender task to finish before it sends
anything else, so that the order of messages holds.
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.protocol import State


def idle_and_open(ws: ServerConnection) -> bool:
    """Whether a message to `ws` may be sent at once: the connection is open, nothing
    waits in its transport's buffer (so the socket takes the frame now and `send` does not
    wait for it to drain), and it is not closing."""
    transport = ws.transport
    return (
        ws.protocol.state is State.OPEN
        and not transport.is_closing()
        and transport.get_write_buffer_size() == 0
    )


def send_now(ws: ServerConnection, data: str) -> Unfinished | None:
    """Send `data` as a text frame from the calling task: None once sent, else the rest of
    the send, which the caller must await (in order, before any other message) to finish
    it. Raises what `send` raises before its first suspension (`ConnectionClosed`)."""
    coro = ws.send(data)
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
