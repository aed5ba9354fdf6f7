"""What the Redis update bus costs, against the in-process one.

No model: replies as the controller publishes them (a 40-character Chinese line, its
source, a final every eighth) go through the bus alone, so the figures are the bus's.
It starts its own `redis-server` (Debian's) on a free loopback port, without persistence.

1. **Latency added**: one stream, one update every 20 ms, a viewer subscribed on another
   bus (another node): time from `publish` to the viewer's subscription holding it, p50
   and p95, against the same through one `InProcessBus`.
2. **Updates per second one node publishes**: a burst of N updates over S streams,
   until Redis has acknowledged the last one (the writer's reply waits for that).
3. **Fan-out**: one stream watched by V viewers spread over three buses (nodes): delivery
   time from publish to each viewer, p50/p95 over every (update, viewer).
4. **CPU per 40 streams**: 40 streams talking at 4 updates a second each, with a viewer of
   each on another node, for T seconds: the CPU the writing node and the reading node
   spend on the bus, in percent of one core, and Redis's own.
5. **Term counts** (`--only terms` runs this alone): a stream's glossary counts given to
   the bus before each final (`keep_terms`, changed every final, as a glossary stream's
   are), one stream's updates appended one at a time (nothing to batch with): Redis round
   trips and commands (inside the scripts too, from `INFO commandstats`) per update, and
   the append latency; then a burst over 40 streams. On a checkout without `keep_terms`
   the same updates go without counts (the "before").

    python examples/benchmarks/bus.py [--viewers 3000] [--seconds 20] [--only terms]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one

from engine.streaming.bus import InProcessBus, UpdateBus, subscribe  # noqa: E402
from engine.streaming.lifecycle import Owner  # noqa: E402
from engine.streaming.redis_bus import RedisBus  # noqa: E402
from engine.streaming.subscriptions import Subscription  # noqa: E402
from protocol import TranslationUpdate  # noqa: E402

LINE = "我们将在三点钟和汤姆见面然后一起去看电影我们将在三点钟和汤姆见面然后一起去看"
SOURCE = "we will meet Tom at three and then go to the cinema together"


def update(stream: str, seq: int, epoch: int) -> TranslationUpdate:
    final = seq % 8 == 7
    return TranslationUpdate(
        stream,
        seq // 8,
        seq,
        LINE[:30],
        "" if final else LINE[30:],
        final,
        120.0,
        80.0,
        source_text=SOURCE,
        epoch=epoch,
        lang="zh",
    )


def quantiles(samples: Sequence[float]) -> str:
    ordered = sorted(samples)
    if not ordered:
        return "n/a"
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return f"p50 {statistics.median(ordered) * 1000:.2f} ms, p95 {p95 * 1000:.2f} ms"


class Redis:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="nmt-bus-bench-")
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
        )
        time.sleep(0.3)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


async def node(redis: Redis) -> RedisBus:
    bus = RedisBus(redis.url, queue_size=4096)
    await bus.start(["zh"])
    return bus


async def claimed(bus: UpdateBus, stream: str) -> int:
    return (await bus.claim(stream)).epoch


async def wait_for(sub: Subscription, count: int, timeout: float = 30) -> None:
    deadline = time.perf_counter() + timeout
    while len(sub) < count and time.perf_counter() < deadline:
        await asyncio.sleep(0.0005)


async def latency(redis: Redis, updates: int) -> None:
    results = {}
    for name in ("in-process", "redis"):
        writer_bus: UpdateBus
        reader_bus: UpdateBus
        if name == "redis":
            writer_bus, reader_bus = await node(redis), await node(redis)
        else:
            writer_bus = reader_bus = InProcessBus(queue_size=4096)
        stream = f"lat-{name}"
        epoch = await claimed(writer_bus, stream)
        viewer = subscribe(reader_bus, stream, lang="zh")
        await asyncio.sleep(0.2)
        samples = []
        for seq in range(updates):
            before = len(viewer)
            start = time.perf_counter()
            writer_bus.publish(update(stream, seq, epoch), Owner("w"), epoch)
            while len(viewer) == before:
                await asyncio.sleep(0)
            samples.append(time.perf_counter() - start)
            await asyncio.sleep(0.02)
        results[name] = samples
        if isinstance(writer_bus, RedisBus):
            await writer_bus.aclose()
        if isinstance(reader_bus, RedisBus):
            await reader_bus.aclose()
    for name, samples in results.items():
        print(
            f"  {name:>10}: publish -> viewer on {'another' if name == 'redis' else 'the same'}"
            f" node: {quantiles(samples)} ({len(samples)} updates)"
        )
    added = statistics.median(results["redis"]) - statistics.median(results["in-process"])
    print(f"  added by the Redis path (median): {added * 1000:.2f} ms")


async def throughput(redis: Redis, updates: int, streams: int) -> None:
    bus = await node(redis)
    owner = Owner("w")
    writer = subscribe(bus, owner=owner)
    epochs = {f"tp-{i}": await claimed(bus, f"tp-{i}") for i in range(streams)}
    names = list(epochs)
    cpu0, redis0, start = time.process_time(), redis.cpu_seconds(), time.perf_counter()
    for seq in range(updates):
        stream = names[seq % streams]
        bus.publish(update(stream, seq, epochs[stream]), owner, epochs[stream])
        if seq % 256 == 255:
            await asyncio.sleep(0)
    while bus.stats["appended"] < updates:
        await asyncio.sleep(0.001)
    wall = time.perf_counter() - start
    cpu, redis_cpu = time.process_time() - cpu0, redis.cpu_seconds() - redis0
    print(
        f"  {updates} updates over {streams} streams in {wall:.2f} s: {updates / wall:,.0f} "
        f"updates/s; node CPU {cpu / wall * 100:.0f}% of a core, "
        f"Redis {redis_cpu / wall * 100:.0f}%"
    )
    assert len(writer) > 0
    await bus.aclose()


async def fan_out(redis: Redis, viewers: int, updates: int) -> None:
    writer_bus = await node(redis)
    nodes = [await node(redis) for _ in range(3)]
    stream = "talk"
    epoch = await claimed(writer_bus, stream)
    subs = [subscribe(nodes[i % 3], stream, lang="zh") for i in range(viewers)]
    await asyncio.sleep(0.5)
    samples: list[float] = []
    for seq in range(updates):
        start = time.perf_counter()
        writer_bus.publish(update(stream, seq, epoch), Owner("w"), epoch)
        pending = set(range(viewers))
        while pending:
            done = {i for i in pending if len(subs[i]) > 0}
            now = time.perf_counter()
            for i in done:
                subs[i]._items.clear()
                samples.append(now - start)
            pending -= done
            if pending:
                await asyncio.sleep(0)
        await asyncio.sleep(0.05)
    print(
        f"  {viewers} viewers of one stream over 3 nodes, {updates} updates: delivery "
        f"{quantiles(samples)} (publish -> each viewer's queue)"
    )
    for bus in [writer_bus, *nodes]:
        await bus.aclose()


async def cpu_per_40(redis: Redis, seconds: float, streams: int = 40, rate: float = 4.0) -> None:
    writer_bus, reader_bus = await node(redis), await node(redis)
    owner = Owner("w")
    writer_sub = subscribe(writer_bus, owner=owner)
    epochs = {f"cpu-{i}": await claimed(writer_bus, f"cpu-{i}") for i in range(streams)}
    viewers = [subscribe(reader_bus, s, lang="zh") for s in epochs]
    await asyncio.sleep(0.5)
    names = list(epochs)
    interval = 1 / (rate * streams)
    cpu0, redis0, start = time.process_time(), redis.cpu_seconds(), time.perf_counter()
    seq = 0
    while time.perf_counter() - start < seconds:
        stream = names[seq % streams]
        writer_bus.publish(update(stream, seq, epochs[stream]), owner, epochs[stream])
        seq += 1
        writer_sub._items.clear()
        for sub in viewers:
            sub._items.clear()
        await asyncio.sleep(interval)
    wall = time.perf_counter() - start
    cpu, redis_cpu = time.process_time() - cpu0, redis.cpu_seconds() - redis0
    print(
        f"  {streams} streams x {rate:g} updates/s for {wall:.0f} s ({seq} updates), writer and "
        f"reader node in one process: {cpu / wall * 100:.1f}% of a core for both "
        f"(~{cpu / wall * 50:.1f}% each); Redis {redis_cpu / wall * 100:.1f}%"
    )
    await writer_bus.aclose()
    await reader_bus.aclose()


def redis_counts(redis: Redis) -> tuple[int, int]:
    """Commands Redis ran so far, those inside scripts included (`INFO commandstats`), and
    the reads it served (`total_reads_processed`: one a round trip of a client's, however
    many commands it pipelines), each less this call's own."""
    out = subprocess.run(
        ["redis-cli", "-p", str(redis.port), "INFO", "all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    commands = sum(
        int(line.split("calls=", 1)[1].split(",", 1)[0])
        for line in out.splitlines()
        if line.startswith("cmdstat_") and not line.startswith("cmdstat_info")
    )
    reads = next(
        int(line.split(":", 1)[1])
        for line in out.splitlines()
        if line.startswith("total_reads_processed:")
    )
    return commands, reads


def keep_terms(bus: RedisBus, stream: str, epoch: int, seq: int) -> None:
    if hasattr(bus, "keep_terms"):  # a checkout before the counts: nothing to keep
        bus.keep_terms(stream, epoch, {"zh": (seq // 8 + 1, seq // 8)})


async def terms(redis: Redis, updates: int, burst: int) -> None:
    bus = await node(redis)
    owner = Owner("w")
    writer = subscribe(bus, owner=owner)
    epoch = await claimed(bus, "terms")
    commands0, reads0 = redis_counts(redis)
    for seq in range(updates):
        if seq % 8 == 7:
            keep_terms(bus, "terms", epoch, seq)
        bus.publish(update("terms", seq, epoch), owner, epoch)
        while bus.stats["appended"] <= seq:
            await asyncio.sleep(0.0002)
    commands, reads = redis_counts(redis)
    # The INFO call's own read and the lease renewals and test writes meanwhile (about
    # one of each a second) are in these too.
    trips, commands = reads - reads0 - 1, commands - commands0
    samples = list(bus.publish_seconds)[-updates:]
    print(
        f"  one stream, {updates} updates one at a time (a final every 8th, counts before "
        f"each): {trips / updates:.3f} round trips and {commands / updates:.2f} Redis commands"
        f" an update; append {quantiles(samples)}; counts written "
        f"{bus.stats['terms_written']} (alone {bus.stats['terms_alone']})"
    )
    names = [f"tb-{i}" for i in range(40)]
    epochs = {name: await claimed(bus, name) for name in names}
    appended0, (_, reads0) = bus.stats["appended"], redis_counts(redis)
    start = time.perf_counter()
    for seq in range(burst):
        stream = names[seq % 40]
        if seq % 8 == 7:
            keep_terms(bus, stream, epochs[stream], seq)
        bus.publish(update(stream, seq, epochs[stream]), owner, epochs[stream])
        if seq % 256 == 255:
            await asyncio.sleep(0)
    while bus.stats["appended"] - appended0 < burst:
        await asyncio.sleep(0.001)
    wall = time.perf_counter() - start
    reads = redis_counts(redis)[1] - reads0 - 1
    print(
        f"  burst of {burst} over 40 streams: {burst / wall:,.0f} updates/s, "
        f"{reads / burst:.4f} round trips an update"
    )
    assert len(writer) > 0
    await bus.aclose()


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


async def main(args: argparse.Namespace) -> None:
    redis = Redis()
    try:
        print(f"CPU: {cpu_name()}, {os.cpu_count()} cores")
        if args.only == "terms":
            print("5. term counts")
            await terms(redis, args.updates, args.burst)
            return
        print("1. latency added by the Redis path")
        await latency(redis, args.updates)
        print("2. updates per second one node publishes")
        await throughput(redis, args.burst, 40)
        print("3. one stream, many viewers over three nodes")
        await fan_out(redis, args.viewers, args.fan_updates)
        print("4. CPU per 40 streams")
        await cpu_per_40(redis, args.seconds)
        print("5. term counts")
        await terms(redis, args.updates, args.burst)
    finally:
        redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=300, help="latency samples")
    parser.add_argument("--burst", type=int, default=20000, help="updates in the burst")
    parser.add_argument("--viewers", type=int, default=3000)
    parser.add_argument("--fan-updates", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--only", choices=["terms"], help="run one section alone")
    asyncio.run(main(parser.parse_args()))
