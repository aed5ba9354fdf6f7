"""A bridge whose server answers `rate_limited` forever still stops (issue 53, finding
5): one Ctrl-C ends it within `stop_timeout` and a few seconds, with the summary naming
each final never answered (and `--unanswered FILE` holding them); a second Ctrl-C quits at
once. Neither prints a traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from websockets.asyncio.server import ServerConnection, serve

import protocol
from engine.bridges.cloud import Dialect
from engine.bridges.kinds import Kind
from engine.bridges.options import BridgeOptions
from engine.bridges.runner import Bridge
from protocol import ErrorCode, ErrorMessage, PartialTranscript
from tests.conftest import ROOT

SPOKEN = ["hello there", "Tom reads a book", "I will meet Tom at three"]


def _google(text: str, *, final: bool = False) -> str:
    result: dict[str, object] = {"alternatives": [{"transcript": text}]}
    if final:
        result["isFinal"] = True
    return json.dumps({"results": [result]})


async def _refusing(ws: ServerConnection) -> None:
    """Our server, refusing every event as `rate_limited`, forever."""
    async for data in ws:
        message = protocol.parse(data)
        if isinstance(message, PartialTranscript):
            refusal = ErrorMessage(
                ErrorCode.RATE_LIMITED, "slow down", None, message.stream_id, message.seq
            )
            await ws.send(protocol.serialize(refusal))


async def _forwarder(ws: ServerConnection) -> None:
    """A cloud forwarder that says three sentences, then stays connected."""
    for text in SPOKEN:
        await ws.send(_google(text))
        await ws.send(_google(text, final=True))
        await anyio.sleep(0.1)
    await ws.wait_closed()


@asynccontextmanager
async def servers() -> AsyncIterator[tuple[int, int]]:
    async with serve(_refusing, "127.0.0.1", 0) as ours, serve(_forwarder, "127.0.0.1", 0) as rec:
        yield ours.sockets[0].getsockname()[1], rec.sockets[0].getsockname()[1]


@pytest.mark.anyio
@pytest.mark.parametrize("interrupts", [1, 2], ids=["ctrl-c", "ctrl-c-twice"])
async def test_ctrl_c_stops_a_bridge_whose_server_refuses_forever(
    interrupts: int, tmp_path: Path
) -> None:
    saved = tmp_path / "unanswered.jsonl"
    async with servers() as (ours, recogniser):
        bridge = subprocess.Popen(
            [
                sys.executable, "-m", "engine.cli", "bridge", "cloud",
                f"ws://127.0.0.1:{recogniser}", "--dialect", "google", "--stream-id",
                "mic-1", "--to", f"ws://127.0.0.1:{ours}/ws", "--reconnect-for", "600",
                "--unanswered", str(saved),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        try:
            await anyio.sleep(4)  # connected, the finals pushed and refused over and over
            assert bridge.poll() is None
            began = time.monotonic()
            bridge.send_signal(signal.SIGINT)
            if interrupts == 2:
                await anyio.sleep(0.3)
                bridge.send_signal(signal.SIGINT)
            while bridge.poll() is None and time.monotonic() - began < 30:
                await anyio.sleep(0.05)
            took = time.monotonic() - began
        finally:
            if bridge.poll() is None:
                bridge.kill()
            _, err = bridge.communicate()
    assert "Traceback" not in err, err
    assert took < (9 if interrupts == 1 else 3), err
    assert bridge.returncode == (1 if interrupts == 1 else 130), err
    assert "3 finals sent, 0 translated, 0 refused, 3 unanswered" in err
    for n, text in enumerate(SPOKEN):
        assert f"unanswered: segment {n} seq {2 * n + 1}: {text}" in err
    written = [protocol.parse(line) for line in saved.read_text().splitlines()]
    assert [(e.text, e.is_final) for e in written if isinstance(e, PartialTranscript)] == [
        (text, True) for text in SPOKEN
    ]


@pytest.mark.anyio
async def test_a_stopped_bridge_gives_up_its_finals_after_stop_timeout() -> None:
    async with servers() as (ours, recogniser):
        options = BridgeOptions(
            kind=Kind.CLOUD,
            url=f"ws://127.0.0.1:{recogniser}",
            stream_id="mic-1",
            to=f"ws://127.0.0.1:{ours}/ws",
            dialect=Dialect.GOOGLE,
            reconnect_for=600.0,
            stop_timeout=0.5,
        )
        stop = anyio.Event()
        bridge = Bridge(options)
        async with anyio.create_task_group() as tg:

            async def stop_soon() -> None:
                while len(bridge.result.finals) < len(SPOKEN):
                    await anyio.sleep(0.05)
                stop.set()

            tg.start_soon(stop_soon)
            with anyio.fail_after(15):
                began = time.monotonic()
                result = await bridge.run(stop)
    assert time.monotonic() - began < 10
    assert [e.text for e in result.unanswered] == SPOKEN
    codes = {r.code for r in result.replies if isinstance(r, ErrorMessage)}
    assert codes == {"unavailable"}  # each answered once, locally: never lost silently
