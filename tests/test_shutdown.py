"""The shutdown window: every final answered, no error logged, the exit on time.

- A final that reaches the server before its close frame gets exactly one reply, even one
  read after the connection's outbox ended.
- Connections closing after a shutdown past its timeout log no `LifecycleError` (an
  aborted stream is not closed again when its owner leaves).
- A client that never answers the close frame cannot hold the exit past
  `--shutdown-timeout` (websockets alone would wait for its own close timeout).

The clients here are raw: a plain socket driven by websockets' sans-I/O protocol, so that
they can do what a library client never does (stay silent after a close frame, send after
one) and so that a frame can be put on the wire at an exact moment of the server's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from engine.decoding.translator import Translator
from engine.server import shutdown
from engine.server.outbox import Outbox
from engine.streaming.lifecycle import Owner, StreamLifecycle, StreamTable
from protocol import PartialTranscript
from tests.conftest import (
    FIXTURE_MODEL,
    ROOT,
    needs_fixture,
    partial_message,
    slow_decodes,
    wait_for,
)
from tests.live_server import serving


@dataclass
class RawClient:
    """A WebSocket client over a plain stream: frames are sent as they are, whatever the
    protocol's state, and the server's close frame is answered only when told to."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    protocol: ClientProtocol
    replies: list[dict[str, Any]] = field(default_factory=list)
    close_code: int | None = None  # the server's close frame, once seen
    eof: bool = False

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/ws"))
        protocol.send_request(protocol.connect())
        client = cls(reader, writer, protocol)
        client._flush()
        while not isinstance(protocol.handshake_exc, Exception):
            data = await reader.read(65536)
            assert data, "connection closed during the handshake"
            protocol.receive_data(data)
            if any(isinstance(e, Response) for e in protocol.events_received()):
                break
        assert protocol.handshake_exc is None, protocol.handshake_exc
        return client

    def _flush(self) -> None:
        for data in self.protocol.data_to_send():
            if data:
                self.writer.write(data)

    def send(self, text: str) -> None:
        """Put a text frame on the wire now (synchronously), in any state."""
        self.writer.write(Frame(Opcode.TEXT, text.encode()).serialize(mask=True))

    async def read(self, timeout: float) -> bool:
        """Read what comes within `timeout` seconds; False once the connection is over."""
        if self.eof:
            return False
        try:
            with anyio.fail_after(timeout):
                data = await self.reader.read(65536)
        except TimeoutError:
            return True
        except ConnectionError:
            data = b""
        if not data:  # the server closed TCP: so does a client, once the close is done
            self.eof = True
            if self.protocol.close_sent is not None:
                self.writer.transport.close()
            return False
        self.protocol.receive_data(data)
        for event in self.protocol.events_received():
            assert isinstance(event, Frame)
            if event.opcode is Opcode.TEXT:
                self.replies.append(json.loads(bytes(event.data)))
            elif event.opcode is Opcode.CLOSE and self.close_code is None:
                self.close_code = int.from_bytes(event.data[:2], "big")
        return True

    async def until(self, done: Any, timeout: float = 20.0) -> None:
        with anyio.fail_after(timeout):
            while not done() and await self.read(timeout):
                pass

    def answer_close(self) -> None:
        self._flush()  # the protocol queued its close frame when the server's came
        if self.eof:
            self.writer.transport.close()

    def about(self, seq: int) -> list[dict[str, Any]]:
        """The replies about a final's `seq`: its final update or an error."""
        return [
            r
            for r in self.replies
            if r.get("seq") == seq and (r["type"] == "error" or r.get("is_final"))
        ]

    def close(self) -> None:
        self.writer.transport.abort()


@asynccontextmanager
async def raw(port: int) -> AsyncIterator[RawClient]:
    client = await RawClient.connect(port)
    try:
        yield client
    finally:
        client.close()


async def open_segment(client: RawClient, stream: str) -> None:
    """A writer with an open segment and nothing in flight."""
    client.send(partial_message(stream, 0, "I will meet"))
    await client.until(lambda: any(r.get("seq") == 0 for r in client.replies))


# -- a final that reaches the server before its close frame is answered -----------------


@pytest.mark.anyio
async def test_a_final_arriving_as_the_outbox_ends_is_answered_before_the_close(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worst moment: the final goes on the wire the instant the writer's outbox ends
    (the engine has drained; the close frame is next). Every message read before the
    close frame is answered first, even when the outbox takes nothing more: a writer must
    not see its final vanish into a 1001."""
    injected: list[RawClient] = []
    real_end = Outbox.end

    def end(self: Outbox) -> None:
        real_end(self)
        if injected and not self.__dict__.get("_injected"):
            self.__dict__["_injected"] = True
            injected[0].send(partial_message("w", 1, "I will meet Tom", final=True))

    async with serving(translator, shutdown_timeout=5) as server, raw(server.port) as writer:
        await open_segment(writer, "w")
        injected.append(writer)
        monkeypatch.setattr(Outbox, "end", end)
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.shutdown)
            await writer.until(lambda: writer.close_code is not None)
            writer.answer_close()
    assert writer.close_code == 1001
    replies = writer.about(1)
    assert len(replies) == 1, writer.replies
    assert replies[0]["code"] == "unavailable"


@pytest.mark.anyio
async def test_finals_sent_at_every_point_of_a_shutdown_get_one_reply_or_a_close_first(
    translator: Translator, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers with an open segment send a final 0-40 ms into a shutdown that drains
    another writer's slow finals. Each final gets exactly one reply (its update or
    `unavailable`), or it reached the server after the close frame, which the server
    logs: none is lost in between."""
    slow_decodes(monkeypatch, 0.01)
    caplog.set_level(logging.INFO, logger="engine.server")
    outcomes: list[str] = []
    async with serving(translator, shutdown_timeout=5) as server, raw(server.port) as busy:
        writers = [await RawClient.connect(server.port) for _ in range(8)]
        try:
            for i, writer in enumerate(writers):
                await open_segment(writer, f"w{i}")
            for seg in range(3):  # the drain: finals being translated
                busy.send(partial_message("busy", seg, "Tom will play tennis", True, segment=seg))

            async def final_at(i: int, writer: RawClient) -> None:
                await anyio.sleep(i * 0.005)
                await writer.read(0)  # what has come so far
                if writer.close_code is not None or writer.eof:
                    outcomes.append("closed before sending")
                    return
                writer.send(partial_message(f"w{i}", 1, "I will meet Tom", final=True))
                await writer.until(lambda: writer.close_code is not None or writer.eof)
                writer.answer_close()
                outcomes.append(f"{len(writer.about(1))} replies")

            async with anyio.create_task_group() as tg:
                tg.start_soon(server.shutdown)
                for i, writer in enumerate(writers):
                    tg.start_soon(final_at, i, writer)
                await busy.until(lambda: busy.close_code is not None)
                busy.answer_close()
        finally:
            for writer in writers:
                writer.close()
    unanswered = outcomes.count("0 replies")
    logged = sum(
        int(r.getMessage().split(": ")[1].split()[0])
        for r in caplog.records
        if "after the server's close frame" in r.getMessage()
    )
    assert set(outcomes) <= {"1 replies", "0 replies", "closed before sending"}, outcomes
    assert unanswered == logged, (outcomes, caplog.text)
    assert outcomes.count("1 replies") >= 1, outcomes


# -- no LifecycleError when connections close after an aborted shutdown -----------------


def test_an_aborted_stream_is_not_closed_again_when_its_owner_leaves() -> None:
    table: StreamTable[Any] = StreamTable()
    owner = Owner("connection 1")
    event = PartialTranscript("s", 0, 0, "I will", True)
    table.open(_Held(StreamLifecycle("s", owner, 1)), event)
    table.shutdown()
    assert [owed for _, owed in table.abort()] == [1]
    assert table.owner_left(owner) == []  # raised LifecycleError: owner_left not allowed


@dataclass
class _Held:
    life: StreamLifecycle


@pytest.mark.anyio
async def test_connections_closing_after_the_shutdown_timeout_log_no_traceback(
    translator: Translator, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Translations slowed to 0.5 s, shutdown timeout 0.1 s: the finals are answered
    `unavailable` while their translations still run, and the writers' connections close
    before those return. Each final gets one reply and nothing is logged as an error."""
    slow_decodes(monkeypatch, 0.5)
    caplog.set_level(logging.INFO)
    async with serving(translator, shutdown_timeout=0.1) as server:
        writers = [await RawClient.connect(server.port) for _ in range(3)]
        try:
            for i, writer in enumerate(writers):
                for seg in range(2):
                    writer.send(
                        partial_message(f"w{i}", seg, "Tom reads a book", True, segment=seg)
                    )
            await wait_for(lambda: len(server.engine.streams) == 3)  # type: ignore[union-attr]
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.shutdown)
                for writer in writers:
                    await writer.until(lambda w=writer: w.close_code is not None)
                    writer.answer_close()
            for writer in writers:
                assert [len(writer.about(seq)) for seq in (0, 1)] == [1, 1], writer.replies
        finally:
            for writer in writers:
                writer.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, caplog.text
    assert "LifecycleError" not in caplog.text


# -- a client that never answers the close cannot hold the exit ------------------------


@pytest.mark.anyio
async def test_a_client_that_never_answers_the_close_is_cut_within_the_grace(
    translator: Translator,
) -> None:
    """Its connection is cut within the abort grace after the shutdown's timeout, not kept
    open for websockets' own close timeout (which would hold the process's exit as long)."""
    async with serving(translator, shutdown_timeout=0.5) as server, raw(server.port) as silent:
        await open_segment(silent, "mute")
        started = time.monotonic()
        await server.shutdown()
        returned = time.monotonic() - started
        await silent.until(lambda: silent.eof, timeout=8)  # never answers the close
        gone = time.monotonic() - started
    bound = 0.5 + shutdown.ABORT_GRACE
    assert silent.close_code == 1001
    assert returned <= bound + 0.5 and gone <= bound + 0.5, (returned, gone)


def test_serve_exits_within_its_shutdown_timeout_when_a_client_never_answers_the_close() -> None:
    """The whole process: `serve --shutdown-timeout 1`, one writer that never answers the
    close frame, SIGTERM: the process exits within its timeout and grace."""
    needs_fixture()
    command = [
        sys.executable, "-m", "engine.server", "--model", str(FIXTURE_MODEL), "--port", "0",
        "--shutdown-timeout", "1", "--log-level", "info",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        port = 0
        for line in proc.stderr:
            if "websocket: ws://" in line:
                port = int(line.split("ws://127.0.0.1:")[1].split("/")[0])
            if line.rstrip().endswith("ready"):
                break
        assert port, "the server did not start"

        async def silent_writer() -> float:
            async with raw(port) as silent:
                await open_segment(silent, "mute")
                started = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                await silent.until(lambda: silent.eof, timeout=15)
                assert silent.close_code == 1001
                return started

        started = anyio.run(silent_writer)
        status = proc.wait(timeout=15)
        took = time.monotonic() - started
        rest = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 0, rest
    assert took <= 1 + shutdown.ABORT_GRACE + 1.5, (took, rest)
    assert "Traceback" not in rest, rest
