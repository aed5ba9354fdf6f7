"""Bursts on one node of the Redis update bus: many claims at once, many viewers joining.

No model: the bus alone, against its own `redis-server` (Debian's) on a free loopback port.

1. **Claims at once**: N writers open N streams on one node in the same instant (a
   reconnect storm after a node died): how many are granted, how many refused and why,
   how long the last one took, and whether the node stayed ready.
2. **A live update's wait while viewers join**: one stream gets an update every 5 ms,
   watched from a second node; then J viewers join J other streams on that node at once,
   each with a full history (512 entries) to read and replay. Printed: the live
   update's delivery time (publish to the viewer's node handing it out) before and during
   the joins, and the longest the event loop was held (a 1 ms ticker's worst lateness).
   Both nodes share this process's event loop, as a writer's and its viewers' streams
   share a real node's.

    python examples/benchmarks/bus_bursts.py [--claims 500] [--joiners 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one

from bus import Redis, cpu_name, update  # noqa: E402

import protocol  # noqa: E402
from engine.streaming.bus import subscribe  # noqa: E402
from engine.streaming.history import Entry  # noqa: E402
from engine.streaming.redis_bus import RedisBus  # noqa: E402
from engine.streaming.subscriptions import Subscription  # noqa: E402
from protocol import InvalidEvent  # noqa: E402


def quantiles(samples: Sequence[float]) -> str:
    ordered = sorted(samples)
    if not ordered:
        return "n/a"
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    mid = ordered[len(ordered) // 2]
    return f"p50 {mid * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms"


async def node(redis: Redis) -> RedisBus:
    bus = RedisBus(redis.url, queue_size=4096)
    await bus.start(["zh"])
    return bus


async def claims(redis: Redis, count: int) -> None:
    bus = await node(redis)
    outcomes: Counter[str] = Counter()
    took: list[float] = []

    async def claim(i: int) -> None:
        start = time.perf_counter()
        try:
            await bus.claim(f"claim-{i}")
            outcomes["granted"] += 1
        except InvalidEvent as exc:
            outcomes[f"refused {exc.error.code} ({exc.error.message})"] += 1
        took.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(claim(i) for i in range(count)))
    wall = time.perf_counter() - start
    ready = bus.ready
    await bus.aclose()
    summary = "; ".join(f"{k}: {v}" for k, v in sorted(outcomes.items()))
    print(f"   {count} claims at once on one node: {summary}")
    print(f"   all answered in {wall * 1000:.0f} ms ({quantiles(took)}); node ready: {ready}")


async def fill(redis: Redis, streams: int, entries: int) -> None:
    """Histories of `entries` updates each, written straight into Redis as the bus does."""
    import redis.asyncio as aioredis

    client: Any = aioredis.Redis.from_url(redis.url, decode_responses=True)
    for sid in range(streams):
        async with client.pipeline(transaction=False) as pipe:
            for seq in range(entries):
                payload = protocol.serialize(update(f"big-{sid}", seq, 1))
                pipe.xadd(f"nmt:h:big-{sid}:zh", {"k": "r", "e": "1", "m": payload})
            await pipe.execute()
    await client.aclose()


async def joins(redis: Redis, joiners: int, entries: int) -> None:
    await fill(redis, joiners, entries)
    writer, reader = await node(redis), await node(redis)
    epoch = (await writer.claim("live")).epoch
    sent: dict[int, float] = {}
    delays: dict[str, list[float]] = {"before": [], "during": []}
    phase = "before"
    deliver = reader.hub.deliver

    def timed(stream_id: str, lane: str, entry: Entry) -> None:
        reply = entry.reply
        if stream_id == "live" and reply is not None and reply.seq in sent:
            delays[phase].append(time.perf_counter() - sent.pop(reply.seq))
        deliver(stream_id, lane, entry)

    reader.hub.deliver = timed  # type: ignore[method-assign]
    subscribe(reader, "live", lang="zh")
    lateness: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lateness.append(time.perf_counter() - start - 0.001)

    async def talk() -> None:
        seq = 0
        while not stop.is_set():
            sent[seq] = time.perf_counter()
            writer.publish(update("live", seq, epoch), None, epoch)
            seq += 1
            await asyncio.sleep(0.005)

    tasks = [asyncio.ensure_future(talk()), asyncio.ensure_future(ticker())]
    await asyncio.sleep(1.0)
    calm = list(lateness)
    lateness.clear()
    phase = "during"
    start = time.perf_counter()
    subs: list[Subscription] = [
        subscribe(reader, f"big-{sid}", lang="zh") for sid in range(joiners)
    ]
    while any(len(sub) == 0 for sub in subs) and time.perf_counter() - start < 120:
        await asyncio.sleep(0.005)
    burst = time.perf_counter() - start
    stop.set()
    await asyncio.gather(*tasks)
    await writer.aclose()
    await reader.aclose()
    print(f"   {joiners} viewers joining as many streams of {entries} entries: {burst:.2f} s")
    print(f"   live update, before the joins: {quantiles(delays['before'])}")
    print(f"   live update, while they join:  {quantiles(delays['during'])}")
    print(f"   event loop held: calm {quantiles(calm)}; joining {quantiles(lateness)}")


async def main(args: argparse.Namespace) -> None:
    redis = Redis()
    try:
        print(f"CPU: {cpu_name()}, {os.cpu_count()} cores")
        print("1. claims at once")
        await claims(redis, args.claims)
        print("2. a live update while viewers join")
        await joins(redis, args.joiners, args.entries)
    finally:
        redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=500)
    parser.add_argument("--joiners", type=int, default=300)
    parser.add_argument("--entries", type=int, default=512, help="entries per joined history")
    asyncio.run(main(parser.parse_args()))
