"""What a viewer costs the server: CPU per update delivered with many viewers a stream.

A captioning service shows each stream on many screens: every update a writer's stream
makes is sent to each of its viewers. W writers (one stream each, a partial every
`--interval` s growing a fixture sentence word by word, a final every 8th) and V viewers
of each stream (`subscribe`, each its own connection) over WebSocket on loopback; the
server is `python -m engine.server` with the fixture model in a subprocess, started from
each checkout given (`--root`, repeatable; alternated, the order turned every repeat:
ABBA). Server CPU from `/proc/PID/stat` over the measured window, divided by the updates
delivered (the writers' and the viewers'), and by the writers' updates alone; and the
viewers' lag behind their writer (the same update's arrival, viewer against writer).

    python examples/benchmarks/fanout_cost.py                      # 8 writers x 50 viewers
    git worktree add /tmp/before HEAD~1
    python examples/benchmarks/fanout_cost.py --root /tmp/before --root . --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from host_cost import cpu_name, proc_cpu  # noqa: E402
from load_server import free_port, wait_ready  # noqa: E402

SENTENCE = "Lucy wants to play tennis with my brother on Sunday"


@dataclass
class Tally:
    writer_updates: int = 0
    viewer_updates: int = 0
    seen: dict[tuple[str, int, bool], float] = field(default_factory=dict)  # writer's arrival
    lags_ms: list[float] = field(default_factory=list)
    measuring: bool = False


def key(update: dict[str, object]) -> tuple[str, int, bool]:
    seq = update.get("seq")
    return (
        str(update.get("stream_id")),
        seq if isinstance(seq, int) else -1,
        bool(update.get("is_final")),
    )


async def writer(url: str, index: int, args: argparse.Namespace, stop: float, tally: Tally) -> None:
    from websockets.asyncio.client import connect

    words = SENTENCE.split()
    async with connect(url, compression=None) as ws:

        async def read() -> None:
            async for message in ws:
                update = json.loads(message)
                if update.get("type") == "translation_update":
                    tally.seen[key(update)] = time.monotonic()
                    tally.writer_updates += tally.measuring

        reader = asyncio.create_task(read())
        await asyncio.sleep(args.interval * index / args.writers)
        seq = segment = 0
        while time.monotonic() < stop:
            final = seq % 8 == 7
            text = " ".join(words[: 1 + seq % 8])
            await ws.send(
                json.dumps(
                    {
                        "type": "partial_transcript",
                        "stream_id": f"s{index}",
                        "segment_id": segment,
                        "seq": seq,
                        "text": text,
                        "is_final": final,
                    }
                )
            )
            seq += 1
            segment += final
            await asyncio.sleep(args.interval)
        await asyncio.sleep(0.5)
        reader.cancel()


async def viewer(url: str, stream: str, delay: float, stop: float, tally: Tally) -> None:
    from websockets.asyncio.client import connect

    await asyncio.sleep(delay)  # the server takes so many handshakes at a time
    async with connect(url, compression=None) as ws:
        await ws.send(json.dumps({"type": "subscribe", "stream_id": stream}))
        while True:
            try:
                message = await asyncio.wait_for(ws.recv(), max(0.1, stop + 0.5 - time.monotonic()))
            except (asyncio.TimeoutError, TimeoutError):
                return
            update = json.loads(message)
            if update.get("type") != "translation_update":
                continue
            if tally.measuring:
                tally.viewer_updates += 1
                at = tally.seen.get(key(update))
                if at is not None:
                    tally.lags_ms.append((time.monotonic() - at) * 1000.0)


async def load(url: str, pid: int, args: argparse.Namespace) -> dict[str, float]:
    tally = Tally()
    stop = time.monotonic() + 3.0 + args.warmup + args.seconds
    count = args.writers * args.viewers
    viewers = [
        asyncio.create_task(viewer(url, f"s{i % args.writers}", 2.0 * i / count, stop, tally))
        for i in range(count)
    ]
    await asyncio.sleep(3.0)  # every viewer connected and subscribed first
    writers = [asyncio.create_task(writer(url, i, args, stop, tally)) for i in range(args.writers)]
    await asyncio.sleep(args.warmup)
    tally.measuring, c0 = True, proc_cpu(pid)
    await asyncio.sleep(args.seconds)
    tally.measuring, c1 = False, proc_cpu(pid)
    failed = [
        e for e in await asyncio.gather(*writers, *viewers, return_exceptions=True) if e is not None
    ]
    if failed:
        print(f"  {len(failed)} connections failed, the first: {failed[0]!r}", file=sys.stderr)
    cpu = c1 - c0
    delivered = tally.writer_updates + tally.viewer_updates
    lags = sorted(tally.lags_ms) or [float("nan")]
    return {
        "writer_updates_per_s": tally.writer_updates / args.seconds,
        "delivered_per_s": delivered / args.seconds,
        "us_per_delivered": cpu / max(1, delivered) * 1e6,
        "ms_per_writer_update": cpu / max(1, tally.writer_updates) * 1e3,
        "viewer_share": tally.viewer_updates / max(1, tally.writer_updates * args.viewers),
        "lag_p50_ms": lags[len(lags) // 2],
        "lag_p95_ms": lags[min(len(lags) - 1, int(len(lags) * 0.95))],
    }


def run(root: Path, args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    command = [sys.executable, "-m", "engine.server", "--model", str(args.model)]
    command += ["--port", str(port), "--log-level", "warning"]
    command += ["--max-connections", str(args.writers * (args.viewers + 1) + 16)]
    command += ["--max-connections-per-address", str(args.writers * (args.viewers + 1) + 16)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=log)
        try:
            if not wait_ready(server, f"http://127.0.0.1:{port}", log):
                raise SystemExit(f"the server from {root} did not start")
            return asyncio.run(load(f"ws://127.0.0.1:{port}/ws", server.pid, args))
        finally:
            server.terminate()
            server.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--viewers", type=int, default=50, help="viewers of each stream")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between messages")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "fixture" / "model")
    parser.add_argument("--root", type=Path, action="append", help="checkout(s) (default: this)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    roots = [r.resolve() for r in (args.root or [ROOT])]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"CPU: {cpu_name()}; {when}")
    print(
        f"{args.writers} writers x {args.viewers} viewers each, a message every "
        f"{args.interval} s, {args.seconds} s measured"
    )
    got: dict[Path, list[dict[str, float]]] = {root: [] for root in roots}
    for repeat in range(args.repeats):
        for root in roots if repeat % 2 == 0 else list(reversed(roots)):
            r = run(root, args)
            got[root].append(r)
            print(
                f"  run {root}: {r['us_per_delivered']:.1f} us CPU per update delivered, "
                f"{r['ms_per_writer_update']:.3f} ms per writer's update, "
                f"{r['delivered_per_s']:.0f} delivered/s, viewers got "
                f"{r['viewer_share']:.0%}, lag p50/p95 "
                f"{r['lag_p50_ms']:.1f}/{r['lag_p95_ms']:.1f} ms"
            )
    print(
        "\n| checkout | us CPU per update delivered | ms per writer's update | viewers got", end=""
    )
    print(" | lag p50 / p95 ms |")
    print("|---|---:|---:|---:|---:|")
    for root, runs in got.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {root} | {med['us_per_delivered']:.1f} | {med['ms_per_writer_update']:.3f} | "
            f"{med['viewer_share']:.0%} | {med['lag_p50_ms']:.1f} / {med['lag_p95_ms']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
