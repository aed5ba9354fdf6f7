"""`serve --workers 2`: two processes on one port sharing a private redis-server.

- a writer on one worker and viewers on both see every update of the stream once and in
  order (which worker a connection reached is read from /proc: the socket's owner);
- SIGTERM stops every worker, each final sent before it answered once, and the private
  Redis with them;
- CLI mistakes get one line and exit 2.

Skipped without Debian's redis-server or the redis package.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from engine.cli.main import main
from tests.conftest import FIXTURE_DIR, FIXTURE_MODEL, ROOT, needs_fixture
from tests.redis_server import free_port, needs_redis

SENTENCES = [line.split("\t")[0] for line in (FIXTURE_DIR / "heldout.tsv").read_text().splitlines()]
STREAM = "talk"


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if match := re.fullmatch(r"socket:\[(\d+)\]", target):
            inodes.add(int(match.group(1)))
    return inodes


def server_side_inode(port: int, client_port: int) -> int | None:
    """The inode of the accepted socket whose peer is our `client_port`."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = fields[1], fields[2]
            if int(local.rsplit(":", 1)[1], 16) == port and (
                int(remote.rsplit(":", 1)[1], 16) == client_port
            ):
                return int(fields[9])
    return None


class Workers:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.log = tmp / "serve.log"
        command = [
            sys.executable, "-m", "engine.cli", "serve", "--model", str(FIXTURE_MODEL),
            "--workers", "2", "--port", str(self.port), "--shutdown-timeout", "10",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )
        deadline = time.monotonic() + 60
        while "ready: 2 workers" not in self.text():
            assert self.process.poll() is None, self.text()
            assert time.monotonic() < deadline, self.text()
            time.sleep(0.1)
        kids = children(self.process.pid)
        self.workers = [pid for pid in kids if "spawn_main" in cmdline(pid)]
        self.redis = [pid for pid in kids if "redis-server" in cmdline(pid)]
        assert len(self.workers) == 2 and len(self.redis) == 1, [cmdline(p) for p in kids]

    def text(self) -> str:
        return self.log.read_text()

    def owner(self, ws: ClientConnection) -> int:
        """The worker that accepted this connection."""
        inode = server_side_inode(self.port, ws.local_address[1])
        owners = [pid for pid in self.workers if inode in socket_inodes(pid)]
        assert len(owners) == 1, (inode, owners)
        return owners[0]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in self.workers + self.redis:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    needs_fixture()
    needs_redis()
    w = Workers(tmp_path)
    try:
        yield w
    finally:
        w.stop()


def key(update: dict[str, object]) -> tuple[object, ...]:
    return (
        update["segment_id"],
        update["seq"],
        update["is_final"],
        update["stable_text"],
        update["unstable_text"],
    )


def partials(segment: int, first_seq: int) -> list[dict[str, object]]:
    words = SENTENCES[segment].split()
    return [
        {
            "type": "partial_transcript",
            "stream_id": STREAM,
            "segment_id": segment,
            "seq": first_seq + i,
            "text": " ".join(words[: i + 1]),
            "is_final": i == len(words) - 1,
        }
        for i in range(len(words))
    ]


@pytest.mark.anyio
async def test_viewers_on_both_workers_see_every_update_once_in_order_and_sigterm_drains(
    workers: Workers,
) -> None:
    url = f"ws://127.0.0.1:{workers.port}/ws"
    viewers: dict[ClientConnection, int] = {}
    for _ in range(64):  # the kernel spreads connections by their address: open until both
        ws = await connect(url)
        viewers[ws] = workers.owner(ws)
        if len(set(viewers.values())) == 2 and len(viewers) >= 4:
            break
    assert set(viewers.values()) == set(workers.workers)
    for ws in viewers:
        await ws.send(json.dumps({"type": "subscribe", "stream_id": STREAM, "after": "0-0"}))

    segments = 4
    writer = await connect(url)
    writer_pid = workers.owner(writer)
    seen: dict[ClientConnection, list[dict[str, object]]] = {ws: [] for ws in [*viewers, writer]}

    async def read(ws: ClientConnection, finals: int) -> None:
        while sum(1 for u in seen[ws] if u["is_final"]) < finals:
            message = json.loads(await ws.recv())
            assert message["type"] == "translation_update", message
            seen[ws].append(message)

    seq = 1
    messages = []
    for segment in range(segments):
        batch = partials(segment, seq)
        messages += batch
        seq += len(batch)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for ws in seen:
                tg.start_soon(read, ws, segments)
            for message in messages:
                await writer.send(json.dumps(message))
                await anyio.sleep(0.02)

    wrote = [key(u) for u in seen[writer]]
    finals = [u for u in seen[writer] if u["is_final"]]
    assert [u["segment_id"] for u in finals] == list(range(segments))
    assert all(u["stable_text"] for u in finals)
    for ws, pid in viewers.items():
        got = [key(u) for u in seen[ws]]
        assert got == wrote, f"viewer on worker {pid} (writer on {writer_pid})"
        cursors = [u["cursor"] for u in seen[ws]]
        assert len(set(cursors)) == len(cursors)

    # SIGTERM while finals are owed: each answered once, then every process gone.
    owed = []
    for segment in range(segments, segments + 3):
        final = partials(segment, 1)[-1]
        owed.append({**final, "seq": seq})
        seq += 1
    for message in owed:
        await writer.send(json.dumps(message))
    workers.process.send_signal(signal.SIGTERM)
    answered: list[int] = []
    with anyio.fail_after(30), contextlib.suppress(ConnectionClosed):
        async for data in writer:
            message = json.loads(data)
            assert message["type"] == "translation_update", message
            if message["is_final"]:
                assert message["stable_text"]
                answered.append(int(message["segment_id"]))
    assert sorted(answered) == [m["segment_id"] for m in owed]
    assert writer.close_code == 1012  # a node draining: reconnect elsewhere
    assert workers.process.wait(timeout=30) == 0, workers.text()
    for pid in workers.workers + workers.redis:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in (
            Path(f"/proc/{pid}/status").read_text()
        ), pid
    assert workers.text().count("delivered") == 2  # both drained their own way
    bus = re.search(r"unix://(\S+)/redis\.sock", workers.text())
    assert bus is not None and not Path(bus.group(1)).exists()  # the private Redis's directory
    for ws in viewers:
        await ws.close()


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    try:
        status: object = main(argv)
    except SystemExit as exit:
        status = exit.code
    return status, capsys.readouterr().err


def one_error(status: object, err: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert status == 2, err
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_workers_zero_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    status, err = run(["serve", "--model", str(FIXTURE_MODEL), "--workers", "0"], capsys)
    assert "argument --workers: must be >= 1" in one_error(status, err)


def test_workers_without_a_bus_or_redis_server_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on it
    monkeypatch.delenv("NMT_INCREMENTAL_BUS", raising=False)
    pytest.importorskip("redis")
    status, err = run(["serve", "--model", str(FIXTURE_MODEL), "--workers", "2"], capsys)
    assert "--workers needs a bus: --bus redis://" in one_error(status, err)


def test_workers_with_a_bus_that_is_not_redis_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("redis")
    argv = ["serve", "--model", str(FIXTURE_MODEL), "--workers", "2", "--bus", "http://x"]
    status, err = run(argv, capsys)
    assert "--bus 'http://x': expected redis://HOST:PORT/DB" in one_error(status, err)


def test_workers_with_a_bus_out_of_reach_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("redis")
    bus = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    argv = ["serve", "--model", str(FIXTURE_MODEL), "--workers", "2", "--bus", bus]
    status, err = run(argv, capsys)
    assert f"cannot reach Redis at {bus}" in one_error(status, err)


def test_workers_with_a_model_that_is_not_there_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("redis")
    missing = str(tmp_path / "nope")
    status, err = run(["serve", "--model", missing, "--workers", "2"], capsys)
    assert f"cannot load model {missing!r}" in one_error(status, err)
