"""The Redis bus under load and faults that leave Redis up (`engine.streaming.redis_viewers`,
`engine.streaming.redis_health`), against a real `redis-server`: a crowd of viewers
joining next to a live one, streams refused after their claim, and Redis out of memory."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anyio
import pytest

import protocol
from engine.decoding.translator import Translator
from engine.streaming.bus import subscribe
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.lifecycle import Owner
from engine.streaming.redis_bus import RedisBus
from engine.streaming.redis_store import KIND_REPLY
from engine.streaming.subscriptions import Subscription
from protocol import ErrorMessage, InvalidEvent, PartialTranscript, TranslationUpdate
from tests.redis_server import RedisServer, redis_server
from tests.test_redis_bus import node, read_until, read_until_error

pytestmark = pytest.mark.anyio


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def client(redis: RedisServer):  # type: ignore[no-untyped-def]
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(redis.url, decode_responses=True)


def entry(stream_id: str, seq: int, text: str) -> dict[str, str]:
    """A final update as the bus stores it in a history."""
    update = TranslationUpdate(stream_id, seq, seq, text, "", True, 1.0, 1.0, lang="zh")
    return {"k": KIND_REPLY, "e": "1", "m": protocol.serialize(update)}


async def first(sub: Subscription, timeout: float = 30) -> None:
    with anyio.fail_after(timeout):
        while not len(sub):
            await anyio.sleep(0.001)


async def test_a_crowd_joining_never_holds_up_a_live_viewer(redis: RedisServer) -> None:
    """300 viewers join streams whose histories are full while a viewer watches another
    stream: its next update reaches it while the crowd is still being served."""
    streams, history = 20, 512
    raw = client(redis)
    async with raw.pipeline(transaction=False) as pipe:
        for s in range(streams):
            for seq in range(history):
                pipe.xadd(f"nmt:h:big{s}:zh", entry(f"big{s}", seq, f"line {seq} " * 12))
        await pipe.execute()
    bus = RedisBus(redis.url, history=history)
    await bus.start(["zh"])
    try:
        live = subscribe(bus, "live", lang="zh")
        await raw.xadd("nmt:h:live:zh", entry("live", 0, "before"))
        await first(live)
        crowd = [subscribe(bus, f"big{i % streams}", lang="zh") for i in range(300)]
        await first(crowd[0])  # the crowd is being served
        await raw.xadd("nmt:h:live:zh", entry("live", 1, "during"))
        with anyio.fail_after(30):
            while len(live) < 2:
                await anyio.sleep(0)
        served = sum(1 for sub in crowd if len(sub))
        for sub in crowd:
            await first(sub, 60)
    finally:
        await bus.aclose()
        await raw.aclose()
    assert served < len(crowd)
    assert [u.seq for u in live._items if isinstance(u, TranslationUpdate)] == [0, 1]


async def test_a_stream_refused_after_its_claim_leaves_no_epoch_and_epochs_expire(
    translator: Translator, redis: RedisServer
) -> None:
    writer = Owner("writer")
    bus = RedisBus(redis.url, lease_ms=600)
    raw = client(redis)
    refused = 0

    async def open_one(n: int) -> None:
        nonlocal refused
        try:
            await nmt.push(PartialTranscript(f"s{n}", 0, 0, "I will", False), writer)
        except InvalidEvent as exc:
            assert exc.error.code == "limit_exceeded"
            refused += 1

    try:
        async with IncrementalTranslator(translator, bus=bus, max_streams=1) as nmt:
            # All pass the first check at once; one stream opens, the rest are refused
            # once their claims are answered.
            async with anyio.create_task_group() as group:
                for n in range(50):
                    group.start_soon(open_one, n)
            (opened,) = nmt.streams
            await anyio.sleep(0.5)  # the refused claims' releases, and a lease renewal
            keys = sorted(await raw.keys("nmt:epoch:*"))
            ttl = await raw.pttl(f"nmt:epoch:{opened}")
    finally:
        await raw.aclose()
    assert refused == 49
    assert keys == [f"nmt:epoch:{opened}"]
    assert ttl > 0  # it expires (with its histories) once nobody holds the stream


async def test_redis_out_of_memory_is_said_counted_logged_and_not_ready(
    translator: Translator, redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    writer = Owner("writer")
    raw = client(redis)
    caplog.set_level(logging.INFO, "engine.streaming.redis_bus")
    try:
        async with node(translator, redis) as a:
            mine = a.updates(owner=writer)
            await a.push(PartialTranscript("s1", 0, 0, "I will meet Tom at three", True), writer)
            await read_until(mine, 1)
            await raw.config_set("maxmemory-policy", "noeviction")
            await raw.config_set("maxmemory", "1mb")
            await a.push(PartialTranscript("s1", 1, 1, "Tom reads", False), writer)
            await a.wait_idle("s1")
            await a.push(PartialTranscript("s1", 1, 2, "Tom reads a book", True), writer)
            (error,) = await read_until_error(mine)
            ready_while_full = a.ready
            await anyio.sleep(0.5)  # a renewal probes a write: still refused
            still_not_ready = not a.ready
            await raw.config_set("maxmemory", "0")
            with anyio.fail_after(10):
                while not a.ready:
                    await anyio.sleep(0.05)
            await a.push(PartialTranscript("s1", 2, 3, "we will see the film", True), writer)
            (answer,) = await read_until(mine, 1)
            stats = dict(a.bus.stats)
    finally:
        await raw.aclose()
    assert isinstance(error, ErrorMessage) and error.code == "unavailable" and error.seq == 2
    assert "out of memory" in error.message and "unreachable" not in error.message
    assert not ready_while_full and still_not_ready
    assert isinstance(answer, TranslationUpdate) and answer.seq == 3
    assert stats["redis_oom"] >= 2 and stats.get("redis_errors", 0) == 0
    assert stats["updates_dropped"] == 1 and stats["finals_refused"] == 1
    logged = [r.getMessage() for r in caplog.records]
    assert any("out of memory" in line and "refused" in line for line in logged)
    assert any("updates_dropped 1" in line for line in logged)
    assert any("finals_refused 1" in line for line in logged)


def test_viewer_metrics_are_totals_whatever_the_stream_ids() -> None:
    """Stream ids are chosen by viewers: `/metrics` must not grow a series per id."""
    from collections import Counter
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from engine.server.metrics import _BusStats

    bus = RedisBus("redis://127.0.0.1:1/0")  # never started: its hub is all that is read
    for n in range(300):
        for _ in range(2 if n < 10 else 1):
            bus.hub.join(bus.hub.viewer(f"chosen-by-a-viewer-{n}", "zh"), [])
    registry = CollectorRegistry()
    registry.register(_BusStats(lambda: SimpleNamespace(bus=bus, stats=Counter())))  # type: ignore[arg-type,return-value]
    lines = generate_latest(registry).decode().splitlines()
    series = [line for line in lines if line.startswith("nmt_bus_view")]
    assert series == ["nmt_bus_viewers 310.0", "nmt_bus_viewed_streams 300.0"]
    assert not any("chosen-by-a-viewer" in line for line in lines)
