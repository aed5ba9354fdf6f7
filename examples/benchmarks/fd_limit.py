"""Attack `nmt-incremental serve` at its file-descriptor limit, on loopback only.

Starts the server as a subprocess under a low `ulimit -n` (`--nofile`, set with
`resource.setrlimit` in the child before it starts) and with `--token`, then runs, one
after the other, attacks that each hold their connections for `--hold` seconds:

- `idle`: `--connections` WebSocket connections (default three times the limit, far past
  it) that authenticate and then never send a message (all from 127.0.0.1, so the cap
  per address meets them first; `idle-no-per-address-cap` lifts it to reach the cap in
  all);
- `silent`: `--silent` TCP connects that never send a request (unauthenticated sockets,
  which could hold their descriptors for the 10 s handshake timeout);
- `over-cap`: `idle` again against a second server whose `--max-connections` is set past
  what the descriptor limit holds, so that `accept()` itself fails (EMFILE): the path
  where asyncio would log a traceback per failed accept.

While an attack holds, it measures the server's log bytes per second and CPU share, and
whether `/healthz` and a new writer (a final translated and answered) get through; after
it lets go, whether a writer gets through again; and it prints the refusals `/metrics`
counted by reason. Every loop is bounded in count and time and only 127.0.0.1 is
contacted. Exit status 0 when, in every attack, the log stayed under `--max-log-rate`
bytes per second, no traceback was logged, `/healthz` answered 200 to at least half of
the probes while the attack held and none waited a second or more, and after it both
`/healthz` and a new writer got through.

    python examples/benchmarks/fd_limit.py [--nofile 256] [--connections 768] [--hold 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidHandshake, InvalidStatus

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "fd-limit-writer"
MAX_CONNECTIONS = 5000  # whatever the options say

# Each attack's server options past --token, from the server's descriptor limit.
SERVER_OPTIONS: dict[str, Callable[[int], list[str]]] = {
    "idle": lambda nofile: [],
    "idle-no-per-address-cap": lambda nofile: ["--max-connections-per-address", "0"],
    "silent": lambda nofile: [],
    "over-cap": lambda nofile: ["--max-connections", str(4 * nofile)],
}
HOST = "127.0.0.1"


@dataclass
class Probe:
    """What clients trying to get in saw: `/healthz` (every half second while an attack
    holds) and one new writer."""

    healthz: list[str] = field(default_factory=list)
    writer: str = ""

    @property
    def healthz_ok(self) -> int:
        return sum(h.startswith("200") for h in self.healthz)

    def describe(self) -> str:
        first = self.healthz[0] if self.healthz else "-"
        bad = sorted({h.split(" after")[0] for h in self.healthz if not h.startswith("200")})
        return (
            f"/healthz 200 {self.healthz_ok}/{len(self.healthz)} (first: {first}"
            f"{'; else ' + ', '.join(bad) if bad else ''}); new writer {self.writer}"
        )


@dataclass
class Attack:
    name: str
    opened: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    log_bytes_per_s: float = 0.0
    cpu_percent: float = 0.0
    during: Probe = field(default_factory=Probe)
    after: Probe = field(default_factory=Probe)
    rejected: dict[str, float] = field(default_factory=dict)
    tracebacks: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def http_get(port: int, path: str, timeout: float = 5.0, token: str | None = None) -> str:
    """'200 in 3 ms', '503 in ...', or what went wrong."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://{HOST}:{port}{path}", headers=headers)
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, TimeoutError) as exc:
        return f"failed after {time.perf_counter() - started:.1f} s ({type(exc).__name__})"
    return f"{status} in {(time.perf_counter() - started) * 1000:.0f} ms"


def waited(outcome: str) -> float:
    """Seconds an `http_get` outcome took ('200 in 3 ms', 'failed after 5.0 s (...)')."""
    if " in " in outcome:
        return float(outcome.split(" in ", 1)[1].split(" ms", 1)[0]) / 1000
    return float(outcome.split(" after ", 1)[1].split(" s", 1)[0])


def metrics(port: int) -> str:
    request = urllib.request.Request(
        f"http://{HOST}:{port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            body: str = response.read().decode()
            return body
    except (OSError, TimeoutError):
        return ""


def rejected(body: str) -> dict[str, float]:
    """`nmt_server_connections_rejected_total` by reason."""
    out = {}
    prefix = 'nmt_server_connections_rejected_total{reason="'
    for line in body.splitlines():
        if line.startswith(prefix):
            reason = line[len(prefix) :].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def server(
    model: str, nofile: int, log_path: Path, extra: list[str]
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`serve` under `ulimit -n nofile`, yielded with its port once /readyz says 200."""
    port = free_port()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    command = [
        sys.executable, "-m", "engine.server", "--model", model, "--port", str(port),
        "--token", TOKEN, "--shutdown-timeout", "3", *extra,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log, preexec_fn=limit)
        try:
            deadline = time.monotonic() + 120
            while not http_get(port, "/readyz", 2).startswith("200"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(log_path.read_text(errors="replace"))
                time.sleep(0.2)
            yield proc, port
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def final_message() -> str:
    return json.dumps(
        {
            "type": "partial_transcript",
            "stream_id": f"probe-{time.monotonic_ns()}",
            "segment_id": 0,
            "seq": 0,
            "text": "Tom reads a book",
            "is_final": True,
        }
    )


async def writer(port: int, timeout: float = 10.0) -> str:
    """A new writer: connect, send a final, wait for its reply."""
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        async with asyncio.timeout(timeout):
            async with connect(
                f"ws://{HOST}:{port}/ws", additional_headers=headers, open_timeout=timeout
            ) as ws:
                await ws.send(final_message())
                while True:
                    reply = json.loads(await ws.recv())
                    if reply["type"] == "error" or reply.get("is_final"):
                        break
    except InvalidStatus as exc:
        return f"refused {exc.response.status_code}"
    except (OSError, TimeoutError, InvalidHandshake) as exc:
        return f"failed after {time.perf_counter() - started:.1f} s ({type(exc).__name__})"
    ms = (time.perf_counter() - started) * 1000
    what = "final translated" if reply["type"] != "error" else f"error {reply['code']}"
    return f"{what} in {ms:.0f} ms"


async def probe(port: int, seconds: float = 0.0) -> Probe:
    """Probe /healthz every half second for `seconds` (at least once) and one writer."""
    result = Probe()

    async def health() -> None:
        until = time.monotonic() + seconds
        while True:  # bounded: one probe per half second, each within 5 s
            result.healthz.append(await asyncio.to_thread(http_get, port, "/healthz"))
            if time.monotonic() >= until:
                break
            await asyncio.sleep(0.5)

    async def write() -> None:
        result.writer = await writer(port)

    await asyncio.gather(health(), write())
    return result


async def idle_connections(port: int, n: int, attack: Attack) -> list[ClientConnection]:
    """Open `n` authenticated WebSocket connections (some at a time) that never write."""
    held: list[ClientConnection] = []
    gate = asyncio.Semaphore(64)
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def one() -> None:
        async with gate:
            try:
                ws = await connect(
                    f"ws://{HOST}:{port}/ws",
                    additional_headers=headers,
                    open_timeout=5,
                    ping_interval=None,
                )
            except InvalidStatus as exc:
                attack.outcomes[f"refused {exc.response.status_code}"] += 1
            except (OSError, TimeoutError, InvalidHandshake) as exc:
                # Reset before an answer: dropped at accept (pending room full), or aborted.
                attack.outcomes[f"dropped ({type(exc).__name__})"] += 1
            else:
                attack.outcomes["open"] += 1
                held.append(ws)

    await asyncio.gather(*(one() for _ in range(n)))
    attack.opened = len(held)
    return held


def silent_connects(port: int, n: int, attack: Attack) -> list[socket.socket]:
    """Open `n` TCP connections that never send a byte."""
    held = []
    for _ in range(n):
        try:
            held.append(socket.create_connection((HOST, port), timeout=2))
            attack.outcomes["connected"] += 1
        except OSError as exc:
            attack.outcomes[type(exc).__name__] += 1
    attack.opened = len(held)
    return held


async def run_attack(
    name: str, proc: subprocess.Popen[bytes], port: int, log_path: Path, args: argparse.Namespace
) -> Attack:
    attack = Attack(name)
    before = rejected(metrics(port))
    held_ws: list[ClientConnection] = []
    held_socks: list[socket.socket] = []
    if name == "silent":
        held_socks = await asyncio.to_thread(silent_connects, port, args.silent, attack)
    else:
        held_ws = await idle_connections(port, args.connections, attack)
    size, cpu, started = log_path.stat().st_size, cpu_seconds(proc.pid), time.monotonic()
    attack.during = await probe(port, args.hold)
    wall = time.monotonic() - started
    attack.log_bytes_per_s = (log_path.stat().st_size - size) / wall
    attack.cpu_percent = 100 * (cpu_seconds(proc.pid) - cpu) / wall
    for sock in held_socks:
        sock.close()
    await asyncio.gather(*(ws.close() for ws in held_ws), return_exceptions=True)
    await asyncio.sleep(1.5)  # asyncio's accept retry, the closes seen through
    attack.after = await probe(port)
    after = rejected(metrics(port))
    attack.rejected = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0)}
    attack.tracebacks = log_path.read_text(errors="replace").count("Traceback")
    return attack


def report(attack: Attack) -> None:
    print(f"\n== {attack.name}: {dict(attack.outcomes)}")
    print(f"log {attack.log_bytes_per_s:,.0f} B/s, server CPU {attack.cpu_percent:.0f}% while held")
    print(f"while held: {attack.during.describe()}")
    print(f"after:      {attack.after.describe()}")
    print(f"refused by reason (/metrics): {attack.rejected}")
    print(f"tracebacks logged: {attack.tracebacks}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default=str(ROOT / "models" / "fixture" / "model"))
    parser.add_argument("--nofile", type=int, default=256, help="the server's ulimit -n")
    parser.add_argument("--connections", type=int, default=None, help="default: 3 x --nofile")
    parser.add_argument("--silent", type=int, default=600, help="silent TCP connects")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds each attack holds")
    parser.add_argument("--max-log-rate", type=float, default=2000.0, help="bytes/s allowed")
    parser.add_argument(
        "--attacks", nargs="+", choices=list(SERVER_OPTIONS), default=list(SERVER_OPTIONS)
    )
    args = parser.parse_args(argv)
    args.connections = min(MAX_CONNECTIONS, args.connections or 3 * args.nofile)
    args.silent = min(MAX_CONNECTIONS, args.silent)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.connections + args.silent + 64
    if soft < need:  # the attacker needs the descriptors the server lacks
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))
    print(f"server: ulimit -n {args.nofile}, --token; attacks hold {args.hold:g} s each")
    attacks = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.attacks:
            extra = SERVER_OPTIONS[name](args.nofile)
            log_path = Path(tmp) / f"{name}.log"
            with server(args.model, args.nofile, log_path, extra) as (proc, port):
                attack = asyncio.run(run_attack(name, proc, port, log_path, args))
            report(attack)
            attacks.append(attack)
            warnings = [
                line for line in log_path.read_text().splitlines() if "connections refused" in line
            ]
            print(f"log lines about refusals: {len(warnings)}; last: {warnings[-1:]}")
    ok = all(
        a.log_bytes_per_s <= args.max_log_rate
        and 2 * a.during.healthz_ok >= len(a.during.healthz)
        and max(map(waited, a.during.healthz)) < 1.0
        and a.after.healthz_ok == len(a.after.healthz)
        and a.after.writer.startswith("final translated")
        and a.tracebacks == 0
        for a in attacks
    )
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
