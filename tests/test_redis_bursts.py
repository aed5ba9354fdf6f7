"""The Redis bus under bursts and a full Redis, against a real `redis-server`: many claims
at once on one node, a live update while a joiner's long history is read, and a node
that writes nothing while Redis is out of memory (issue 53, finding 6)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import protocol
from engine.decoding.translator import Translator
from engine.streaming import redis_viewers
from engine.streaming.bus import subscribe
from engine.streaming.history import Entry
from engine.streaming.redis_bus import RedisBus
from engine.streaming.redis_store import KIND_REPLY
from protocol import InvalidEvent, TranslationUpdate
from tests.redis_server import RedisServer, redis_server
from tests.test_redis_bus import node

pytestmark = pytest.mark.anyio


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def client(redis: RedisServer) -> Any:
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(redis.url, decode_responses=True)


def entry(stream_id: str, seq: int, text: str) -> dict[str, str]:
    """A final update as the bus stores it in a history."""
    update = TranslationUpdate(stream_id, seq, seq, text, "", True, 1.0, 1.0, lang="zh")
    return {"k": KIND_REPLY, "e": "1", "m": protocol.serialize(update)}


async def test_500_claims_at_once_on_one_node_are_all_granted(redis: RedisServer) -> None:
    """A reconnect storm: 500 writers open streams on one node at the same instant. Each
    claim waits for a connection to Redis rather than failing as if it were unreachable."""
    bus = RedisBus(redis.url)
    await bus.start(["zh"])
    refused: list[str] = []
    granted: list[int] = []

    async def claim(n: int) -> None:
        try:
            granted.append((await bus.claim(f"s{n}")).epoch)
        except InvalidEvent as exc:
            refused.append(exc.error.message)

    try:
        async with anyio.create_task_group() as group:
            for n in range(500):
                group.start_soon(claim, n)
        ready = bus.ready
    finally:
        await bus.aclose()
    assert refused == []
    assert len(granted) == 500
    assert ready and bus.stats["redis_errors"] == 0


async def test_a_live_update_is_delivered_between_the_pages_of_a_joiners_history(
    redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A viewer joins a stream with a full history (512 entries), whose parse is slowed
    down here to 150 ms; an update of a watched stream arrives once that parse has begun.
    It reaches its viewer before the joiner is replayed its history: the history is
    parsed a page at a time, the live reads served in between."""
    raw = client(redis)
    async with raw.pipeline(transaction=False) as pipe:
        for seq in range(512):
            pipe.xadd("nmt:h:big:zh", entry("big", seq, f"line {seq}"))
        await pipe.execute()
    parse = redis_viewers.entry_of
    started = threading.Event()

    def live_update() -> None:
        import redis as sync_redis

        with sync_redis.Redis.from_url(redis.url) as sync:
            sync.xadd("nmt:h:live:zh", entry("live", 1, "during"))

    def slow_parse(entry_id: str, fields: dict[str, str]) -> Entry:
        parsed = parse(entry_id, fields)
        if isinstance(parsed.reply, TranslationUpdate) and parsed.reply.stream_id == "big":
            if not started.is_set():
                started.set()
                threading.Thread(target=live_update).start()
            time.sleep(0.0003)
        return parsed

    bus = RedisBus(redis.url)
    await bus.start(["zh"])
    order: list[str] = []
    join, deliver = bus.hub.join, bus.hub.deliver

    def joined(sub: Any, histories: Any, after: str | None = None) -> bool:
        order.append(f"join {sub.stream_id}")
        return join(sub, histories, after)

    def delivered(stream_id: str, lane: str, item: Entry) -> None:
        order.append(f"deliver {stream_id} {item.reply.seq if item.reply else None}")
        deliver(stream_id, lane, item)

    monkeypatch.setattr(bus.hub, "join", joined)
    monkeypatch.setattr(bus.hub, "deliver", delivered)
    try:
        live = subscribe(bus, "live", lang="zh")
        await raw.xadd("nmt:h:live:zh", entry("live", 0, "before"))
        with anyio.fail_after(10):
            while not len(live):
                await anyio.sleep(0.001)
        monkeypatch.setattr(redis_viewers, "entry_of", slow_parse)
        joiner = subscribe(bus, "big", lang="zh")
        with anyio.fail_after(30):
            while len(live) < 2 or not len(joiner):
                await anyio.sleep(0.001)
    finally:
        await bus.aclose()
        await raw.aclose()
    assert started.is_set()
    assert order.index("deliver live 1") < order.index("join big")
    assert [u.seq for u in live._items if isinstance(u, TranslationUpdate)] == [0, 1]


async def test_a_node_that_writes_nothing_is_not_ready_while_redis_is_out_of_memory(
    translator: Translator, redis: RedisServer
) -> None:
    """No writer on the node, so it appends nothing: it still finds out that Redis takes
    no writes (`maxmemory` reached under `noeviction`), and `/readyz` (the engine's
    `ready`) says so until Redis takes writes again."""
    raw = client(redis)
    try:
        async with node(translator, redis, lease_ms=300) as a:
            with anyio.fail_after(5):
                while not a.ready:
                    await anyio.sleep(0.01)
            await raw.set("filler", "x" * 2_000_000)
            await raw.config_set("maxmemory-policy", "noeviction")
            await raw.config_set("maxmemory", "1mb")
            with anyio.fail_after(5):
                while a.ready:
                    await anyio.sleep(0.01)
            bus = a.bus
            assert isinstance(bus, RedisBus)
            why = bus.health.refusing
            await raw.config_set("maxmemory", "0")
            with anyio.fail_after(5):
                while not a.ready:
                    await anyio.sleep(0.01)
    finally:
        await raw.aclose()
    assert why == "the update bus (Redis) is out of memory"
    assert bus.stats["redis_oom"] >= 1
