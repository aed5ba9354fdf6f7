"""Chaos soak of `nmt-incremental serve` on loopback: hostile and hasty clients beside normal
ones, then a SIGTERM; checks that nothing leaks and every final is answered.

Starts the server as a subprocess, then for `--seconds` runs, all at once:

- a bystander writer (one partial every 200 ms, a final every 8) and a viewer of it: the
  bystander's update latency (partial sent -> its update) is what the others must not hurt;
- churn: connections that open, send a partial and vanish, as fast as they can;
- leakers: a final, `close_stream`, partials for the same id at once, then disconnect;
- bursts: 84 messages at once, the last a final, over the rate limit;
- a flood writer at 50 messages per second.

Every writer that sends a final waits for its reply (its final update or an error). When
all clients have left it reads `/metrics` (streams left open must be 0) and the server's
RSS, sends SIGTERM and reads the exit status. Every loop is bounded in count and time, and
only 127.0.0.1 is contacted. Exit status 0 when every final was answered, no stream is left
open, the server exited 0 and logged no traceback.

    python examples/benchmarks/chaos_soak.py [--seconds 60] [--model models/fixture/model]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

# this checkout's engine, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_server import ROOT, free_port, http_get, metric

from protocol import PartialTranscript, serialize

WORDS = "Tom will play tennis with Lucy at three tomorrow".split()
MAX_CONNECTIONS = 5000  # churn bound, whatever the duration


@dataclass
class Tally:
    finals_sent: int = 0
    finals_answered: int = 0
    connections: int = 0
    bystander_ms: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


def partial(stream: str, segment: int, seq: int, text: str, final: bool = False) -> str:
    return serialize(PartialTranscript(stream, segment, seq, text, is_final=final))


async def read_reply(ws: ClientConnection, tally: Tally, seqs: set[int]) -> None:
    """Read one reply; count errors, and a final's reply (its final update or an error
    about its seq) once, removing its seq from `seqs`."""
    reply = json.loads(await ws.recv())
    if reply["type"] == "error":
        tally.errors[reply["code"]] = tally.errors.get(reply["code"], 0) + 1
    if reply.get("seq") in seqs and (reply["type"] == "error" or reply["is_final"]):
        seqs.discard(reply["seq"])
        tally.finals_answered += 1


async def await_finals(ws: ClientConnection, tally: Tally, seqs: set[int]) -> None:
    """Read until every seq in `seqs` got its reply (final update or error)."""
    try:
        async with asyncio.timeout(30):
            while seqs:
                await read_reply(ws, tally, seqs)
    except (TimeoutError, ConnectionClosed):
        pass


async def bystander(url: str, tally: Tally, until: float) -> None:
    async with connect(url) as ws:
        tally.connections += 1
        seq, segment = 0, 0
        while time.monotonic() < until:
            for k in range(1, len(WORDS) + 1):
                final = k == len(WORDS)
                sent = time.perf_counter()
                await ws.send(partial("bystander", segment, seq, " ".join(WORDS[:k]), final))
                tally.finals_sent += final
                async with asyncio.timeout(30):
                    while True:
                        reply = json.loads(await ws.recv())
                        if reply.get("seq") == seq:
                            break
                tally.bystander_ms.append((time.perf_counter() - sent) * 1000)
                tally.finals_answered += final
                seq += 1
                await asyncio.sleep(0.2)
            segment += 1


async def viewer(url: str, tally: Tally, until: float) -> None:
    async with connect(url) as ws:
        tally.connections += 1
        await ws.send(json.dumps({"type": "subscribe", "stream_id": "bystander"}))
        while time.monotonic() < until:
            try:
                async with asyncio.timeout(0.5):
                    await ws.recv()
            except TimeoutError:
                pass


async def churn(url: str, tally: Tally, until: float, rng: random.Random) -> None:
    while time.monotonic() < until and tally.connections < MAX_CONNECTIONS:
        try:
            async with connect(url) as ws:
                tally.connections += 1
                await ws.send(partial(f"churn-{rng.randrange(10**9)}", 0, 0, "I will"))
        except (OSError, ConnectionClosed, InvalidStatus):
            await asyncio.sleep(0.05)


async def leaker(url: str, tally: Tally, until: float, name: str) -> None:
    round_ = 0
    while time.monotonic() < until:
        sid = f"{name}-{round_}"
        async with connect(url) as ws:
            tally.connections += 1
            await ws.send(partial(sid, 0, 0, "Tom reads a book", final=True))
            tally.finals_sent += 1
            await ws.send(json.dumps({"type": "close_stream", "stream_id": sid}))
            for seq in range(1, 20):
                await ws.send(partial(sid, 0, seq, "Tom reads"))
            await await_finals(ws, tally, {0})
        round_ += 1


async def burst(url: str, tally: Tally, until: float, name: str) -> None:
    round_ = 0
    while time.monotonic() < until:
        async with connect(url) as ws:
            tally.connections += 1
            sid = f"{name}-{round_}"
            for seq in range(83):
                await ws.send(partial(sid, 0, seq, "I will meet Tom"))
            await ws.send(partial(sid, 0, 83, "I will meet Tom at three", final=True))
            tally.finals_sent += 1
            await await_finals(ws, tally, {83})
        round_ += 1
        await asyncio.sleep(0.5)


async def flood(url: str, tally: Tally, until: float) -> None:
    async with connect(url) as ws:
        tally.connections += 1
        seq, sent = 0, set[int]()

        async def read() -> None:
            while True:
                await read_reply(ws, tally, sent)

        reader = asyncio.create_task(read())
        while time.monotonic() < until:
            final = seq % 25 == 24
            await ws.send(partial("flood", seq // 25, seq, "I will meet Tom at three", final))
            if final:
                tally.finals_sent += 1
                sent.add(seq)
            seq += 1
            await asyncio.sleep(0.02)
        async with asyncio.timeout(30):
            while sent:
                await asyncio.sleep(0.05)
        reader.cancel()


async def soak(port: int, seconds: float, seed: int) -> Tally:
    url = f"ws://127.0.0.1:{port}/ws"
    tally = Tally()
    rng = random.Random(seed)
    until = time.monotonic() + seconds
    await asyncio.gather(
        bystander(url, tally, until),
        viewer(url, tally, until),
        churn(url, tally, until, rng),
        churn(url, tally, until, rng),
        leaker(url, tally, until, "leak-a"),
        leaker(url, tally, until, "leak-b"),
        burst(url, tally, until, "burst"),
        flood(url, tally, until),
    )
    return tally


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default=str(ROOT / "models" / "fixture" / "model"))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "engine.server", "--model", args.model, "--port", str(port),
        "--max-streams", "256", "--shutdown-timeout", "5",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "w+", encoding="utf-8") as server_log:
            server = subprocess.Popen(command, cwd=ROOT, stdout=server_log, stderr=server_log)
            deadline = time.monotonic() + 120
            while http_get(base + "/readyz")[0] != 200:
                if server.poll() is not None or time.monotonic() > deadline:
                    print(log_path.read_text(), file=sys.stderr)
                    server.kill()
                    return 1
                time.sleep(0.2)
            rss_before = rss_mib(server.pid)
            started = time.monotonic()
            tally = asyncio.run(soak(port, args.seconds, args.seed))
            wall = time.monotonic() - started
            time.sleep(1.0)  # let the server see the last disconnects through
            body = http_get(base + "/metrics")[1]
            open_streams = metric(body, "nmt_server_open_streams")
            rss_after = rss_mib(server.pid)
            server.send_signal(signal.SIGTERM)
            try:
                status = server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                status = -9
        logged = log_path.read_text()
    latencies = tally.bystander_ms
    p50 = statistics.median(latencies) if latencies else float("nan")
    p95 = statistics.quantiles(latencies, n=20)[-1] if len(latencies) >= 20 else float("nan")
    traceback = "Traceback" in logged
    ok = (
        tally.finals_answered == tally.finals_sent
        and open_streams == 0
        and status == 0
        and not traceback
    )
    print(f"soak {wall:.0f} s, {tally.connections} connections")
    print(f"finals sent / answered: {tally.finals_sent} / {tally.finals_answered}")
    print(f"streams left open after all clients left: {open_streams:.0f}")
    print(f"server RSS before / after: {rss_before:.0f} / {rss_after:.0f} MiB")
    print(f"bystander update latency p50 / p95: {p50:.0f} / {p95:.0f} ms ({len(latencies)})")
    print(f"error replies by code: {dict(sorted(tally.errors.items()))}")
    print(f"server exit status after SIGTERM: {status}; traceback logged: {traceback}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
