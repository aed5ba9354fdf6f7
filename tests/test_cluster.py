"""Three `serve --bus redis://` nodes behind HAProxy, as `examples/deploy/cluster.py`
starts them (real redis-server, haproxy and server processes on loopback), with the
project's own writer (`engine.remote.RemoteTranslator`, which resends unanswered finals)
going through HAProxy and viewers connected straight to each node (each moving to the next
node, with its last cursor, when its node goes away).

- every viewer gets every update of its language, in order, once;
- kill -9 of the stream's owner, again and again: every final answered exactly once as the
  writer sees it, with the offline translation; viewers get every final once, in order;
- SIGSTOP of the owner past its lease, SIGCONT: nothing of its old life reaches a viewer;
- SIGTERM drain of a node holding 8 writers: no final lost, the writers move on;
- Redis killed and restarted mid-talk: no final lost, everything recovers.

Recovery times are printed (pytest -s shows them). Skipped without redis-server/haproxy.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import statistics
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from engine.decoding.translator import Translator
from engine.remote import RemoteTranslator
from protocol import ErrorMessage, PartialTranscript, TranslationUpdate
from tests.conftest import FIXTURE_DIR, FIXTURE_MODEL, ROOT, needs_fixture

sys.path.insert(0, str(ROOT / "examples" / "deploy"))
from cluster import Cluster, MissingDependency, free_ports

pytestmark = pytest.mark.anyio

LEASE_MS = 1000
KILLS = int(os.environ.get("NMT_CLUSTER_KILLS", "20"))
SENTENCES = [line.split("\t")[0] for line in (FIXTURE_DIR / "heldout.tsv").read_text().splitlines()]


def test_the_ports_of_one_cluster_are_distinct() -> None:
    # Chosen one at a time, the kernel once gave a node Redis's port (bind: address in use).
    for _ in range(20):
        ports = free_ports(40)
        assert len(set(ports)) == 40


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    needs_fixture()
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis package is not installed (pip install -e '.[cluster]')")
    try:
        c = Cluster(3, FIXTURE_MODEL, ["--lease-ms", str(LEASE_MS)], shutdown_timeout=5)
    except MissingDependency as exc:
        pytest.skip(str(exc))
    with c:
        yield c


@pytest.fixture(scope="module")
def offline() -> Translator:
    needs_fixture()
    return Translator.from_dir(FIXTURE_MODEL)


@dataclass
class Viewer:
    """A subtitle screen on node `index`: subscribes to the stream, and when its node goes
    away, moves to the next one, resuming after the last cursor it had."""

    cluster: Cluster
    index: int
    stream: str
    seen: list[TranslationUpdate] = field(default_factory=list)
    moves: int = 0

    @property
    def cursor(self) -> str | None:
        return self.seen[-1].cursor if self.seen else None

    async def run(self) -> None:
        node = self.index
        while True:
            url = self.cluster.node(node).ws_url
            try:
                async with connect(url, open_timeout=3) as ws:
                    subscribe = {"type": "subscribe", "stream_id": self.stream, "lang": "zh"}
                    if self.cursor:
                        subscribe["after"] = self.cursor
                    await ws.send(json.dumps(subscribe))
                    async for raw in ws:
                        message = json.loads(raw)
                        if message["type"] == "translation_update":
                            message.pop("type")
                            self.seen.append(TranslationUpdate(**message))
            except (OSError, ConnectionClosed, InvalidHandshake, TimeoutError):
                pass
            node = (node + 1) % len(self.cluster.node_ports)
            self.moves += 1
            await anyio.sleep(0.05)

    def finals(self) -> list[int]:
        return [u.seq for u in self.seen if u.is_final]

    def check_order(self, *, finals_by_seq: bool = True) -> None:
        """Every update once (cursors strictly increase) and a final once per seq; the
        finals in seq order too unless `finals_by_seq` is False: across a Redis outage a
        final whose append failed is answered `unavailable` and sent again by its writer
        (docs/protocol.md, the writer's rule), so it may land in the history after
        finals that went through meanwhile; it is still there once, in history order."""
        cursors = [tuple(map(int, u.cursor.split("-"))) for u in self.seen if u.cursor]
        assert len(cursors) == len(self.seen)
        assert cursors == sorted(set(cursors)), f"viewer {self.index}: repeated or out of order"
        finals = self.finals()
        assert len(finals) == len(set(finals)), f"viewer {self.index}: finals {finals}"
        if finals_by_seq:
            assert finals == sorted(finals), f"viewer {self.index}: finals {finals}"


class Talk:
    """A writer through HAProxy: sentences word by word (a partial per word), each ending
    with its final, until stopped."""

    def __init__(self, nmt: RemoteTranslator, stream: str, word_s: float = 0.08) -> None:
        self.nmt = nmt
        self.stream = stream
        self.word_s = word_s
        self.finals: dict[int, str] = {}  # seq -> text
        self.stop = anyio.Event()
        self.done = anyio.Event()
        self.sent = 0

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.done.set()

    async def _run(self) -> None:
        seq = 0
        for segment in range(10_000):
            words = SENTENCES[segment % len(SENTENCES)].split()
            for n in range(1, len(words) + 1):
                final = n == len(words)
                text = " ".join(words[:n])
                await self.nmt.push(PartialTranscript(self.stream, segment, seq, text, final))
                if final:
                    self.finals[seq] = text
                seq += 1
                self.sent += 1
                await anyio.sleep(self.word_s)
            if self.stop.is_set():
                return


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "metrics", timeout=2) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def owner_of(cluster: Cluster) -> int | None:
    """The node holding a writer's stream now (its open streams, from /metrics)."""
    for node in cluster.nodes:
        if node.pid is None:
            continue
        try:
            if metric(node.url, "nmt_server_open_streams") > 0:
                return node.index
        except OSError:
            continue
    return None


async def wait_owner(cluster: Cluster, timeout: float = 20) -> int:
    with anyio.fail_after(timeout):
        while (owner := await anyio.to_thread.run_sync(owner_of, cluster)) is None:
            await anyio.sleep(0.1)
    return owner


async def next_update(viewers: list[Viewer], after: float, skip: int | None) -> float:
    """Seconds from `after` until a viewer (not on node `skip`) got an update."""
    counts = {v.index: len(v.seen) for v in viewers}
    with anyio.fail_after(30):
        while True:
            for v in viewers:
                if v.index != skip and len(v.seen) > counts[v.index]:
                    return time.monotonic() - after
            await anyio.sleep(0.005)


async def finish(
    nmt: RemoteTranslator, talk: Talk, updates: list[TranslationUpdate | ErrorMessage]
) -> None:
    talk.stop.set()
    with anyio.fail_after(60):
        await talk.done.wait()
        while not all(
            any(isinstance(u, TranslationUpdate) and u.is_final and u.seq == seq for u in updates)
            for seq in talk.finals
        ):
            await anyio.sleep(0.05)


def check_writer(
    talk: Talk, updates: list[TranslationUpdate | ErrorMessage], offline: Translator
) -> None:
    """Every final answered exactly once, by its offline translation; no error."""
    assert not [u for u in updates if isinstance(u, ErrorMessage)]
    finals = [u for u in updates if isinstance(u, TranslationUpdate) and u.is_final]
    assert sorted(u.seq for u in finals) == sorted(talk.finals)
    for update in finals:
        assert update.stable_text == offline.translate([talk.finals[update.seq]])[0].text


def check_viewers(viewers: list[Viewer], talk: Talk) -> None:
    for viewer in viewers:
        viewer.check_order()
        assert set(viewer.finals()) == set(talk.finals), f"viewer {viewer.index} missed finals"


@contextlib.asynccontextmanager
async def writing(
    cluster: Cluster, stream: str, into: list[TranslationUpdate | ErrorMessage]
) -> AsyncIterator[tuple[RemoteTranslator, Talk]]:
    """A writer through HAProxy talking on `stream`, its replies collected `into`."""
    async with (
        RemoteTranslator(cluster.lb_url, reconnect_for=60) as nmt,
        anyio.create_task_group() as work,
    ):
        work.start_soon(collect, nmt, stream, into)
        talk = Talk(nmt, stream)
        work.start_soon(talk.run)
        yield nmt, talk
        work.cancel_scope.cancel()


async def collect(
    nmt: RemoteTranslator, stream: str, into: list[TranslationUpdate | ErrorMessage]
) -> None:
    async for reply in nmt.updates(stream):
        into.append(reply)


async def test_every_viewer_on_every_node_gets_every_update_once_in_order(
    cluster: Cluster, offline: Translator
) -> None:
    viewers = [Viewer(cluster, i, "talk") for i in range(3)]
    updates: list[TranslationUpdate | ErrorMessage] = []
    async with anyio.create_task_group() as tg:
        for viewer in viewers:
            tg.start_soon(viewer.run)
        await anyio.sleep(0.5)
        async with writing(cluster, "talk", updates) as (nmt, talk):
            await anyio.sleep(4)
            await finish(nmt, talk, updates)
            await anyio.sleep(0.5)
        tg.cancel_scope.cancel()
    check_writer(talk, updates, offline)
    written = [u for u in updates if isinstance(u, TranslationUpdate)]
    for viewer in viewers:
        # The same updates as the writer, in its order: what the writer saw, everyone saw.
        assert [u.cursor for u in viewer.seen] == [u.cursor for u in written]
        assert viewer.moves == 0


async def test_killing_the_owner_again_and_again_loses_no_final(
    cluster: Cluster, offline: Translator
) -> None:
    viewers = [Viewer(cluster, i, "talk") for i in range(3)]
    updates: list[TranslationUpdate | ErrorMessage] = []
    recovery: list[float] = []
    async with anyio.create_task_group() as tg:
        for viewer in viewers:
            tg.start_soon(viewer.run)
        await anyio.sleep(0.5)
        async with writing(cluster, "talk", updates) as (nmt, talk):
            for kill in range(KILLS):
                await anyio.sleep(random.uniform(0.5, 1.5))
                owner = await wait_owner(cluster)
                if kill % 2:  # every other kill right after a final went out: mid-answer
                    finals = len(talk.finals)
                    while len(talk.finals) == finals:
                        await anyio.sleep(0.001)
                killed = time.monotonic()
                cluster.kill_node(owner, signal.SIGKILL)
                recovery.append(await next_update(viewers, killed, owner))
                await anyio.to_thread.run_sync(cluster.start_node, owner)
            await finish(nmt, talk, updates)
            await anyio.sleep(0.5)
        tg.cancel_scope.cancel()
    stats = nmt.stats
    p95 = sorted(recovery)[int(0.95 * len(recovery))]
    print(
        f"\n{KILLS} kills: recovery (kill -> next update at a viewer) p50 "
        f"{statistics.median(recovery):.2f} s, p95 {p95:.2f} s, max {max(recovery):.2f} s; "
        f"writer reconnects {stats.reconnects}, finals resent "
        f"{stats.resent}, duplicates {stats.duplicates}; {len(talk.finals)} finals"
    )
    check_writer(talk, updates, offline)
    assert stats.duplicates == 0
    check_viewers(viewers, talk)


async def test_a_paused_owner_never_reaches_a_viewer_after_its_lease(
    cluster: Cluster, offline: Translator
) -> None:
    viewers = [Viewer(cluster, i, "talk") for i in range(3)]
    updates: list[TranslationUpdate | ErrorMessage] = []
    async with anyio.create_task_group() as tg:
        for viewer in viewers:
            tg.start_soon(viewer.run)
        await anyio.sleep(0.5)
        async with writing(cluster, "talk", updates) as (nmt, talk):
            await anyio.sleep(1.5)
            owner = await wait_owner(cluster)
            old_epoch = max(u.epoch or 0 for u in updates if isinstance(u, TranslationUpdate))
            cluster.kill_node(owner, signal.SIGSTOP, wait=False)
            stopped = time.monotonic()
            # The writer moves (HAProxy cuts its tunnel once the node fails its checks).
            with anyio.fail_after(30):
                while not any(
                    isinstance(u, TranslationUpdate) and (u.epoch or 0) > old_epoch for u in updates
                ):
                    await anyio.sleep(0.02)
            moved = time.monotonic() - stopped
            cluster.kill_node(owner, signal.SIGCONT, wait=False)
            await anyio.sleep(3 * LEASE_MS / 1000)  # the woken node runs its queued work
            await finish(nmt, talk, updates)
            await anyio.sleep(0.5)
        tg.cancel_scope.cancel()
    print(f"\nSIGSTOP: the writer's stream went on on another node after {moved:.2f} s")
    check_writer(talk, updates, offline)
    for viewer in viewers:
        if viewer.index == owner:
            continue
        epochs = [u.epoch or 0 for u in viewer.seen]
        # Once the new life began, nothing of the old one arrived.
        assert epochs == sorted(epochs), f"viewer {viewer.index}: a stale update arrived"
        viewer.check_order()


def haproxy(cluster: Cluster, command: str) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(cluster.haproxy_socket))
        s.sendall(command.encode() + b"\n")
        return s.recv(65536).decode()


async def test_draining_a_node_with_8_writers_moves_them_and_loses_no_final(
    cluster: Cluster, offline: Translator
) -> None:
    # Every writer on node 0: the others are in maintenance while the writers connect.
    for i in (2, 3):
        haproxy(cluster, f"set server nmt/nmt{i} state maint")
    streams = [f"talk{i}" for i in range(8)]
    updates: dict[str, list[TranslationUpdate | ErrorMessage]] = {s: [] for s in streams}
    async with contextlib.AsyncExitStack() as stack:
        writers = [
            await stack.enter_async_context(RemoteTranslator(cluster.lb_url, reconnect_for=60))
            for _ in streams
        ]
        async with anyio.create_task_group() as work:
            talks = []
            for nmt, stream in zip(writers, streams, strict=True):
                work.start_soon(collect, nmt, stream, updates[stream])
                talk = Talk(nmt, stream, word_s=0.15)
                talks.append(talk)
                work.start_soon(talk.run)
            await anyio.sleep(1.5)
            held = await anyio.to_thread.run_sync(
                metric, cluster.node(0).url, "nmt_server_open_streams"
            )
            for i in (2, 3):
                haproxy(cluster, f"set server nmt/nmt{i} state ready")
            await anyio.sleep(1.5)  # HAProxy checks them back up
            cluster.kill_node(0, signal.SIGTERM, wait=False)
            drained = time.monotonic()
            code = await anyio.to_thread.run_sync(cluster.wait_exit, 0)
            took = time.monotonic() - drained
            for nmt, talk, stream in zip(writers, talks, streams, strict=True):
                await finish(nmt, talk, updates[stream])
            moved = 0.0
            for i in (1, 2):
                moved += await anyio.to_thread.run_sync(
                    metric, cluster.node(i).url, "nmt_server_open_streams"
                )
            work.cancel_scope.cancel()
    print(f"\ndrain with 8 writers: node exited {code} after {took:.2f} s")
    assert held == 8 and code == 0
    assert moved == 8
    for talk, stream in zip(talks, streams, strict=True):
        check_writer(talk, updates[stream], offline)


async def test_redis_dying_mid_talk_loses_no_final_and_everything_recovers(
    cluster: Cluster, offline: Translator
) -> None:
    viewers = [Viewer(cluster, i, "talk") for i in range(3)]
    updates: list[TranslationUpdate | ErrorMessage] = []
    async with anyio.create_task_group() as tg:
        for viewer in viewers:
            tg.start_soon(viewer.run)
        await anyio.sleep(0.5)
        async with writing(cluster, "talk", updates) as (nmt, talk):
            await anyio.sleep(2)
            cluster.kill_redis()
            await anyio.sleep(2)
            ready = [metric(n.url, "nmt_bus_ready") for n in cluster.nodes]
            back = time.monotonic()
            cluster.start_redis()
            recovered = await next_update(viewers, back, None)
            await anyio.sleep(2)
            await finish(nmt, talk, updates)
            await anyio.sleep(0.5)
        tg.cancel_scope.cancel()
    print(f"\nRedis restart: Redis up -> next update at a viewer {recovered:.2f} s")
    assert ready == [0.0, 0.0, 0.0]  # every node said so while Redis was gone
    check_writer(talk, updates, offline)
    for viewer in viewers:
        viewer.check_order(finals_by_seq=False)


def test_a_node_without_its_redis_exits_2() -> None:
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    needs_fixture()
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis package is not installed")
    done = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--model", str(FIXTURE_MODEL),
         "--port", "0", "--bus", f"redis://127.0.0.1:{port}/0"],
        capture_output=True, text=True, timeout=60, cwd=Path(ROOT),
    )  # fmt: skip
    assert done.returncode == 2
    assert "cannot reach Redis" in done.stderr
