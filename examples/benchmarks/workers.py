"""Updates per second through `serve` at 1, 2 and N processes (`serve --workers N`).

The load of `host_cost.py` (N writers, one stream each, a partial every 0.3 s growing a
fixture sentence, a final every 8th message) from this process over loopback, against:

- `1`: one `serve` process, no bus (the embedded default);
- `1+redis`: one `serve` process with `--bus` on a private redis-server (what the bus
  alone costs);
- `N` (N > 1): `serve --workers N` (its private redis-server).

Per run: updates received per second in the measured window, the CPU of the whole server
tree (supervisor, workers, redis-server: `/proc/PID/stat`) per update, partial p50/p95
(sent -> update received), the partials answered, and every final answered once (finals
sent, answered once, answered twice). The configurations are alternated run by run,
medians of `--repeats`:

    python examples/benchmarks/workers.py                       # 1, 1+redis, 2, 4; 720 writers
    python examples/benchmarks/workers.py --configs 1 2 --writers 240 480 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one
sys.path.insert(0, str(HERE))
from host_cost import (  # noqa: E402
    FINAL_EVERY,
    MODEL,
    Tally,
    cpu_name,
    percentile,
    proc_cpu,
    schedule,
    writers,
)
from load_server import free_port, wait_ready  # noqa: E402

from engine.cli.workers import PrivateRedis  # noqa: E402


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    found = [pid]
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += tree(int(child))
    return found


def tree_cpu(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        with contextlib.suppress(OSError, IndexError):
            total += proc_cpu(p)
    return total


def run(config: str, writers_n: int, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    command = [
        sys.executable, "-m", "engine.cli", "serve", "--model", str(args.model),
        "--port", str(port), "--log-level", "info", "--max-streams", str(writers_n * 2 + 8),
    ]  # fmt: skip
    redis: PrivateRedis | None = None
    if config == "1+redis":
        redis = PrivateRedis.start(args.redis_server)
        command += ["--bus", redis.url]
    elif config != "1":
        command += ["--workers", config]
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "server.log", "w+", encoding="utf-8")  # noqa: SIM115
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log, env=env)
        try:
            ready = "ready" if config in ("1", "1+redis") else f"ready: {config} workers"
            deadline = time.monotonic() + 120
            while ready not in Path(log.name).read_text():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{config}: the server did not start\n{log.name}")
                time.sleep(0.1)
            if not wait_ready(server, f"http://127.0.0.1:{port}", log):
                raise SystemExit(f"{config}: /readyz never answered")
            plans = schedule(writers_n, args.warmup + args.seconds, args.interval, args.seed)
            tally = Tally((args.warmup, args.warmup + args.seconds))
            cpu: dict[str, float] = {}

            def on_mark(name: str) -> None:
                cpu[name] = tree_cpu(server.pid)

            asyncio.run(writers(f"ws://127.0.0.1:{port}/ws", plans, tally, on_mark))
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=40)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
            if redis is not None:
                redis.stop()
    finals = tally.final_replies
    return {
        "updates_per_s": tally.updates / args.seconds,
        "ms_per_update": (cpu["end"] - cpu["start"]) / max(1, tally.updates) * 1000.0,
        "partial_p50_ms": percentile(tally.partial_ms, 50),
        "partial_p95_ms": percentile(tally.partial_ms, 95),
        "answered": tally.partial_updates / max(1, tally.partials_changed),
        "finals_sent": tally.finals_sent,
        "finals_once": sum(1 for n in finals.values() if n == 1),
        "finals_twice": sum(1 for n in finals.values() if n > 1),
        "errors": tally.errors,
        "exit": server.returncode,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["1", "1+redis", "2", "4"])
    parser.add_argument("--writers", type=int, nargs="+", default=[720])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--redis-server", default="redis-server")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}")
    print(
        f"a message every {args.interval} s per writer, a final every {FINAL_EVERY}th; "
        f"model {args.model}; {args.seconds:g} s measured after {args.warmup:g} s"
    )
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for n in args.writers:
        for i in range(args.repeats):
            for config in args.configs:
                r = run(config, n, args)
                runs.setdefault((n, config), []).append(r)
                print(
                    f"  {n} writers, {config} process(es), run {i + 1}: "
                    f"{r['updates_per_s']:.0f} updates/s, {r['ms_per_update']:.3f} ms CPU/update, "
                    f"partial p50/p95 {r['partial_p50_ms']:.0f}/{r['partial_p95_ms']:.0f} ms, "
                    f"{r['answered']:.0%} answered, finals {r['finals_once']}/{r['finals_sent']} "
                    f"once ({r['finals_twice']} twice), {r['errors']} errors, exit {r['exit']}",
                    flush=True,
                )
    print()
    print(
        "| writers | processes | updates/s | ms CPU per update | partial p50 / p95 ms "
        "| answered | finals once |"
    )
    print("| ---: | --- | ---: | ---: | --- | ---: | --- |")
    for (n, config), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        once = sum(r["finals_once"] for r in rs)
        sent = sum(r["finals_sent"] for r in rs)
        print(
            f"| {n} | {config} | {med['updates_per_s']:.0f} | {med['ms_per_update']:.3f} "
            f"| {med['partial_p50_ms']:.0f} / {med['partial_p95_ms']:.0f} "
            f"| {med['answered']:.0%} | {once}/{sent} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
