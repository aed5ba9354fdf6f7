"""How a connection's replies reach its socket: a writer's own replies and a viewer's handed
over as they are published (no forwarder task), an update written at once while the sender is idle,
and the order kept when such a write has to wait. No model: the engine and the socket are
stand-ins with the few methods `Client` calls."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.protocol import State

from engine.replies import ReplyQueue
from engine.server.client import Client
from engine.server.connection import ConnectionCore
from engine.server.eager import Unfinished, by_hand, idle_and_open, send_now
from engine.server.limits import Limits
from engine.server.metrics import ServerMetrics
from engine.server.outbox import Outbox
from engine.server.state import ServerState
from engine.streaming.lifecycle import Owner
from engine.streaming.subscriptions import Subscription
from protocol import ErrorMessage, PartialTranscript, TranslationUpdate
from tests.conftest import partial_message, wait_for

pytestmark = pytest.mark.anyio


def _update(seq: int, final: bool = False) -> TranslationUpdate:
    return TranslationUpdate("s", 0, seq, "x", "" if final else "y", final, 1.0, 1.0)


# --- an attached reply queue ------------------------------------------------------------


def test_an_attached_queue_hands_over_what_it_holds_then_each_reply_and_ends_once() -> None:
    queue = ReplyQueue(8)
    queue.put(_update(0))
    got: list[Any] = []
    ends: list[int] = []
    queue.attach(got.append, lambda: ends.append(1))
    assert [u.seq for u in got] == [0] and len(queue) == 0
    queue.put(_update(1))
    queue.put(ErrorMessage("internal", "failed", stream_id="s", seq=2))
    assert [getattr(r, "seq", None) for r in got] == [0, 1, 2]
    queue.end()
    queue.end()
    queue.put(_update(3))  # ended: nothing
    assert ends == [1] and len(got) == 3


def test_a_queue_attached_after_it_ended_reports_the_end_at_once() -> None:
    queue = ReplyQueue(8)
    queue.put(_update(0, final=True))
    queue.end()
    got: list[Any] = []
    ends: list[int] = []
    queue.attach(got.append, lambda: ends.append(1))
    assert [u.seq for u in got] == [0] and ends == [1]


def test_a_failing_consumer_loses_its_reply_and_the_publisher_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = ReplyQueue(8)
    got: list[Any] = []

    def deliver(reply: Any) -> None:
        if reply.seq == 1:
            raise RuntimeError("a bug")
        got.append(reply)

    queue.attach(deliver, lambda: None)
    with caplog.at_level(logging.ERROR):
        for seq in range(3):
            queue.put(_update(seq))
    assert [u.seq for u in got] == [0, 2]
    assert "consumer failed" in caplog.text


# --- sending at once -----------------------------------------------------------------------


async def test_send_now_writes_a_frame_on_an_idle_connection_without_suspending() -> None:
    sent: list[object] = []

    async def handler(ws: ServerConnection) -> None:
        sent.append(send_now(ws, "hello"))
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}") as client:
            with anyio.fail_after(5):
                assert await client.recv() == "hello"
    assert sent == [None]


async def test_send_now_hands_back_its_drain_when_the_transport_pauses() -> None:
    """A frame the socket does not take leaves the transport paused: `send_now` has
    written it and returns the drain, which ends once the client reads; every message
    arrives, in order."""
    big = "x" * 400_000
    unfinished: list[object] = []
    count = 0

    async def handler(ws: ServerConnection) -> None:
        nonlocal count
        while count < 200:
            count += 1
            rest = send_now(ws, f"{count} {big}")
            if rest is not None:
                unfinished.append(rest)
                await rest  # the client reads meanwhile
                break
        await ws.send("end")
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0, write_limit=1024, compression=None) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", max_size=None) as client:
            with anyio.fail_after(20):
                await anyio.sleep(0.2)  # the server fills the socket meanwhile
                got = []
                while (message := await client.recv()) != "end":
                    got.append(int(str(message).split(" ", 1)[0]))
    assert len(unfinished) == 1 and count < 200
    assert got == list(range(1, count + 1))


async def _job(gate: asyncio.Event, log: list[str]) -> str:
    try:
        await gate.wait()
        log.append("done")
        return "ok"
    finally:
        log.append("exit")


async def test_an_unfinished_coroutine_is_resumed_by_the_task_that_awaits_it() -> None:
    gate, log = asyncio.Event(), []
    coro = _job(gate, log)
    rest = Unfinished(coro, coro.send(None))  # suspended on the gate

    async def finish() -> None:
        await rest

    async with anyio.create_task_group() as group:
        group.start_soon(finish)
        await anyio.sleep(0.01)
        assert log == []
        gate.set()
    assert log == ["done", "exit"]


async def test_a_cancelled_awaiter_cancels_the_unfinished_coroutine() -> None:
    gate, log = asyncio.Event(), []
    coro = _job(gate, log)
    rest = Unfinished(coro, coro.send(None))

    async def finish() -> None:
        await rest

    with anyio.move_on_after(0.05):
        await finish()
    assert log == ["exit"]  # cancelled inside the coroutine, which cleaned up


# --- a connection's sender ---------------------------------------------------------------


class _OlderConnection:
    """A connection of websockets 13-16, which lack some of what the by-hand send reads:
    `send` is all it has for sending."""

    def __init__(self) -> None:
        self.transport = _Transport()
        self.protocol = _Protocol()
        self.sent: list[str] = []

    async def send(self, data: str) -> None:
        self.sent.append(data)


def test_send_now_runs_send_by_hand_on_a_connection_of_an_older_websockets() -> None:
    ws: Any = _OlderConnection()
    current: Any = _Socket()
    assert not by_hand(ws) and by_hand(current)
    assert idle_and_open(ws)
    assert send_now(ws, "hello") is None
    assert ws.sent == ["hello"] and ws.protocol.frames == []  # through `send`, at once


class _Transport:
    def __init__(self) -> None:
        self.buffered = 0

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return self.buffered


class _Protocol:
    state = State.OPEN

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send_text(self, data: bytes) -> None:
        self.frames.append(data)


class _Socket:
    """What `Client` uses of a `ServerConnection`: frames in from `feed`, frames out into
    `sent`; while `hold` is set a send writes its frame, then waits (a full socket): in
    `send`, or in `drain` for a frame sent by hand (`send_now`), the transport paused."""

    send_in_progress = None

    def set_connection_exc(self, exc: BaseException | None) -> None:
        raise AssertionError("no frame fails here")

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.hold: anyio.Event | None = None
        self.transport = _Transport()
        self.protocol = _Protocol()
        self.incoming, self._frames = anyio.create_memory_object_stream[str](16)

    @property
    def paused(self) -> bool:
        return self.hold is not None

    def send_data(self) -> None:
        self.sent.extend(json.loads(frame) for frame in self.protocol.frames)
        self.protocol.frames.clear()

    async def drain(self) -> None:
        if self.hold is not None:
            await self.hold.wait()

    def __aiter__(self) -> Any:
        return self._frames.__aiter__()

    async def send(self, data: str) -> None:
        self.sent.append(json.loads(data))
        if self.hold is not None:
            await self.hold.wait()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.incoming.close()


class _Engine:
    """An engine that only subscribes: the test publishes into `writes` (a writer's) or
    `views` (a viewer's, each follow-up subscription appended) itself."""

    def __init__(self) -> None:
        self.writes: Subscription | None = None
        self.views: list[tuple[Subscription, str | None]] = []  # with its `after`
        self.pushed: list[PartialTranscript] = []
        self.streams: set[str] = {"s"}

    def updates(
        self,
        stream_id: str | None = None,
        *,
        owner: Owner | None = None,
        lang: str | None = None,
        after: str | None = None,
    ) -> Subscription:
        if owner is not None:
            self.writes = Subscription(None, 256, owner)
            return self.writes
        self.views.append((Subscription(stream_id, 256, lang=lang), after))
        return self.views[-1][0]

    async def push(self, event: PartialTranscript, owner: Owner) -> None:
        self.pushed.append(event)

    def owner_left(self, owner: Owner) -> None:
        pass

    def unsubscribe(self, sub: Subscription) -> None:
        sub.end()


def _seqs(ws: _Socket) -> list[tuple[str, int | None]]:
    return [(m["type"], m.get("seq")) for m in ws.sent]


async def test_updates_go_out_at_once_and_in_order_when_a_write_has_to_wait() -> None:
    ws, engine, state = _Socket(), _Engine(), ServerState()
    core = ConnectionCore(1, Limits(rate_limit=None), state)
    metrics = ServerMetrics(lambda: 0, lambda: None)
    client = Client(ws, core, Outbox(), engine, state, metrics)  # type: ignore[arg-type]
    async with anyio.create_task_group() as group:
        group.start_soon(client.serve)
        await ws.incoming.send(partial_message("s", 0))
        await wait_for(lambda: engine.pushed)
        writes = engine.writes
        assert writes is not None and client.pumps == 1
        await anyio.sleep(0.01)  # the sender waits for the outbox

        writes.put(_update(0))  # written by the publisher itself, before `put` returns
        assert _seqs(ws) == [("translation_update", 0)]

        ws.hold = anyio.Event()  # the socket is full: the next write waits to drain
        writes.put(_update(1))
        assert _seqs(ws)[-1] == ("translation_update", 1)
        writes.put(_update(2))  # behind the write that waits, as is what follows
        writes.put(ErrorMessage("internal", "failed", stream_id="s", seq=3))
        ws.transport.buffered = 100
        writes.put(_update(4, final=True))
        await anyio.sleep(0.05)
        assert len(ws.sent) == 2  # nothing more while the write waits
        ws.hold.set()
        ws.hold = None
        ws.transport.buffered = 0
        await wait_for(lambda: len(ws.sent) == 5)
        assert _seqs(ws) == [
            ("translation_update", 0),
            ("translation_update", 1),
            ("translation_update", 2),
            ("error", 3),
            ("translation_update", 4),
        ]
        await anyio.sleep(0.01)
        writes.put(_update(5))  # the sender is idle again: at once
        assert len(ws.sent) == 6
        counted = metrics.registry.get_sample_value(
            "nmt_server_messages_sent_total", {"type": "translation_update"}
        )
        assert counted == 5  # each counted once, waited for or not
        ws.incoming.close()
    assert client.pumps == 0 and writes.ended  # the writer's subscription ended with it


async def test_a_stopping_server_ends_the_outbox_when_the_writers_subscription_ends() -> None:
    ws, engine, state = _Socket(), _Engine(), ServerState()
    core = ConnectionCore(1, Limits(rate_limit=None), state)
    client = Client(
        ws,  # type: ignore[arg-type]
        core,
        Outbox(),
        engine,  # type: ignore[arg-type]
        state,
        ServerMetrics(lambda: 0, lambda: None),
    )
    async with anyio.create_task_group() as group:
        group.start_soon(client.serve)
        await ws.incoming.send(partial_message("s", 0, final=True))
        await wait_for(lambda: engine.pushed)
        writes = engine.writes
        assert writes is not None
        state.stop()
        client.end_when_forwarded()
        assert not client.outbox.ended  # its subscription may still deliver finals
        writes.put(_update(0, final=True))
        writes.end()  # the engine has closed: the last reply is in
        assert client.outbox.ended
        with anyio.fail_after(5):
            await client.wait_sent()
        assert _seqs(ws) == [("translation_update", 0)]
        ws.incoming.close()


def _viewer() -> tuple[_Socket, _Engine, ServerState, Client]:
    ws, engine, state = _Socket(), _Engine(), ServerState()
    core = ConnectionCore(1, Limits(rate_limit=None), state)
    metrics = ServerMetrics(lambda: 0, lambda: None)
    return ws, engine, state, Client(ws, core, Outbox(), engine, state, metrics)  # type: ignore[arg-type]


async def _subscribed(ws: _Socket, engine: _Engine) -> tuple[Subscription, str | None]:
    """The viewer's first subscription (and the `after` it asked for), once it subscribed."""
    await ws.incoming.send(json.dumps({"type": "subscribe", "stream_id": "s"}))
    await wait_for(lambda: engine.views)
    return engine.views[0]


async def test_a_viewers_updates_are_written_by_the_publisher_then_it_follows_on() -> None:
    """A viewer's subscription is attached like a writer's: the publisher writes the
    update before `put` returns (no task of the viewer's runs per update); when the
    subscription ends (the stream's life ended), the viewer follows on after its cursor."""
    ws, engine, _state, client = _viewer()
    async with anyio.create_task_group() as group:
        group.start_soon(client.serve)
        sub, after = await _subscribed(ws, engine)
        assert after is None and client.pumps == 1
        await anyio.sleep(0.01)  # the sender waits for the outbox
        sub.put(_update(0), "5-0")
        assert _seqs(ws) == [("translation_update", 0)]
        sub.put(ErrorMessage("internal", "failed", stream_id="s", seq=1))  # a writer's
        sub.put(_update(2, final=True), "6-0")
        assert _seqs(ws) == [("translation_update", 0), ("translation_update", 2)]
        sub.end()  # the stream's life ended: a follow-up subscription, after the last
        await wait_for(lambda: len(engine.views) == 2)
        follow, after = engine.views[1]
        assert after == "6-0" and client.pumps == 1 and sub not in client.subscriptions
        await anyio.sleep(0.01)
        follow.put(_update(3), "7-0")
        assert _seqs(ws)[-1] == ("translation_update", 3)
        ws.incoming.close()
    assert client.pumps == 0 and follow.ended  # the connection left: unsubscribed


async def test_a_stopping_server_ends_a_viewers_outbox_when_its_subscription_ends() -> None:
    ws, engine, state, client = _viewer()
    async with anyio.create_task_group() as group:
        group.start_soon(client.serve)
        sub, _after = await _subscribed(ws, engine)
        state.stop()
        client.end_when_forwarded()
        assert not client.outbox.ended  # the stream's last finals are still to come
        sub.put(_update(0, final=True), "5-0")
        sub.end()  # the engine has closed
        with anyio.fail_after(5):
            await client.wait_sent()
        assert client.outbox.ended and len(engine.views) == 1  # no follow-up when stopping
        assert _seqs(ws) == [("translation_update", 0)]
        ws.incoming.close()
