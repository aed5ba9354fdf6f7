"""Load test of `nmt-incremental serve` on loopback: N writers replaying a log in real time.

Starts the server as a subprocess (as it runs in production), then for each N opens N
writer connections that each replay the same transcript log on its own stream, staggered
by a random fraction of a second so that talkers are not in lockstep. Reports per N the
update latency measured by the client (partial sent -> its update received) and by the
engine (`latency_ms`), the errors, and whether every final got its final update:

    python examples/benchmarks/load_server.py [--clients 1,4,16] [--segments 12]

The log is `examples/logs/fixture_en_zh.jsonl` when present, else one is generated from
`models/fixture/heldout.tsv` (first column) with `generate_log`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one
sys.path.insert(0, str(ROOT / "examples"))

from replay_client import ReplayResult, percentile, read_log, replay  # noqa: E402

from engine.logs.format import read_log as read_log_lines  # noqa: E402
from engine.logs.format import write_log  # noqa: E402
from engine.logs.make import generate_log  # noqa: E402

DEFAULT_LOG = ROOT / "examples" / "logs" / "fixture_en_zh.jsonl"
HELDOUT = ROOT / "models" / "fixture" / "heldout.tsv"


def load_lines(args: argparse.Namespace, workdir: Path) -> Path:
    """The log to replay, cut to its first `--segments` segments."""
    path = workdir / "log.jsonl"
    if args.log is not None or DEFAULT_LOG.is_file():
        source = Path(args.log or DEFAULT_LOG)
        kept = [line for line in read_log_lines(source) if line["segment_id"] < args.segments]
        write_log(path, kept)
        print(f"log: {source} (first {args.segments} segments)", file=sys.stderr)
        return path
    sources = [
        row.split("\t")[0].strip()
        for row in HELDOUT.read_text(encoding="utf-8").splitlines()
        if row.strip()
    ][: args.segments]
    write_log(path, generate_log(sources, "en", seed=0))
    print(f"log: generated from {HELDOUT} ({len(sources)} segments)", file=sys.stderr)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def wait_ready(server: subprocess.Popen[bytes], base: str, log: IO[str]) -> bool:
    """Until the server at `base` answers /readyz (True), or it exits or 120 s pass
    (False, its log printed)."""
    deadline = time.monotonic() + 120
    while http_get(base + "/readyz")[0] != 200:
        if server.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            print(log.read(), file=sys.stderr)
            return False
        time.sleep(0.2)
    return True


def metric(body: str, name: str) -> float:
    """Sum of every sample of `name` (all label sets)."""
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def run_clients(url: str, log: Path, n: int, speed: float, seed: int) -> list[ReplayResult]:
    rng = random.Random(seed)

    async def one(i: int) -> ReplayResult:
        lines = read_log(log, rename=lambda sid: f"{sid}-n{n}-c{i}")
        await asyncio.sleep(rng.uniform(0.0, 1.0) if n > 1 else 0.0)
        return await replay(url, lines, speed=speed, final_timeout=60.0)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "fixture" / "model"))
    parser.add_argument("--log", default=None, help=f"default: {DEFAULT_LOG.relative_to(ROOT)}")
    parser.add_argument("--clients", default="1,4,16", help="comma-separated N values")
    parser.add_argument("--segments", type=int, default=12, help="segments replayed per client")
    parser.add_argument("--speed", type=float, default=1.0, help="1 = real time")
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads")
    parser.add_argument("--policy", default="la2")
    parser.add_argument("--quantized", action="store_true", help="the int8 files")
    parser.add_argument(
        "--int8-per-call", action="store_true", help="serve's --int8-per-call (files' scale)"
    )
    parser.add_argument(
        "--forced-length-ratio",
        type=float,
        default=None,
        help="random-weight benchmark models: every decode emits ceil(R * source tokens)",
    )
    args = parser.parse_args()
    counts = [int(x) for x in args.clients.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        log = load_lines(args, Path(tmp))
        port = free_port()
        command = [
            sys.executable, "-m", "engine.server", "--model", args.model,
            "--port", str(port), "--policy", args.policy,
            "--max-streams", str(max(counts) * 2 + 8),
        ]  # fmt: skip
        if args.threads:
            command += ["--threads", str(args.threads)]
        if args.quantized:
            command += ["--quantized"]
        if args.int8_per_call:
            command += ["--int8-per-call"]
        if args.forced_length_ratio:
            command += ["--forced-length-ratio", str(args.forced_length_ratio)]
        server_log = open(Path(tmp) / "server.log", "w+", encoding="utf-8")  # noqa: SIM115
        server = subprocess.Popen(command, cwd=ROOT, stdout=server_log, stderr=server_log)
        base = f"http://127.0.0.1:{port}"
        try:
            if not wait_ready(server, base, server_log):
                return 1
            rows = []
            for n in counts:
                before = http_get(base + "/metrics")[1]
                started = time.perf_counter()
                url = f"ws://127.0.0.1:{port}/ws"
                results = asyncio.run(run_clients(url, log, n, args.speed, seed=n))
                wall = time.perf_counter() - started
                after = http_get(base + "/metrics")[1]
                rows.append(summarize(n, results, wall, before, after))
                print(f"N={n} done in {wall:.0f} s", file=sys.stderr)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
            server_log.close()
    print()
    print(
        "| writers | partials sent | updates | client p50 / p95 ms | engine p50 / p95 ms "
        "| errors | finals received / sent | dropped updates |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(row)
    return 0


def summarize(n: int, results: list[ReplayResult], wall: float, before: str, after: str) -> str:
    client = [x for r in results for x in r.client_ms]
    engine = [x for r in results for x in r.server_ms]
    sent = sum(r.sent for r in results)
    updates = sum(len(r.updates) for r in results)
    errors = sum(len(r.errors) for r in results)
    expected = sum(len(r.finals_expected) for r in results)
    received = sum(
        len({(stream, seq) for stream, seq, _ in r.finals_received} & r.finals_expected)
        for r in results
    )
    dropped = metric(after, "nmt_server_dropped_updates_total") - metric(
        before, "nmt_server_dropped_updates_total"
    )
    lost = "" if received == expected else f" ({expected - received} LOST)"
    return (
        f"| {n} | {sent} | {updates} "
        f"| {percentile(client, 50):.0f} / {percentile(client, 95):.0f} "
        f"| {percentile(engine, 50):.0f} / {percentile(engine, 95):.0f} "
        f"| {errors} | {received} / {expected}{lost} | {dropped:.0f} |"
    )


if __name__ == "__main__":
    sys.exit(main())
