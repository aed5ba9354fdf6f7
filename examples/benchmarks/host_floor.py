"""The floor under an update: what a bare WebSocket server and the model's own calls cost
the CPU at `host_cost.py`'s load, beside what `serve` costs there, in one run.

Three parts, on one machine, one after another:

- **whole**: `host_cost.py` through `serve` (N writers, a partial every `--interval` s, a
  final every 8th), which gives the server's CPU per update and the model's calls per
  update (encoder calls, prefills and steps, and their rows per call); then in process,
  and in process with no engine (`--load-only`: the load's own CPU, which the in-process
  figure counts);
- **transport**: a bare server that answers each message with one reply of an update's
  size, nothing else (`json.loads`, `json.dumps`, no checks): websockets' asyncio server as
  `serve` runs it, the same on the engine's coalescing loop (`serve`'s default), and
  websockets' Sans-I/O protocol on a plain asyncio `Protocol` (a connection layer of our
  own, at best); the same N writers in this process; server CPU per reply from
  `/proc/PID/stat`; the servers alternated, `--repeats` each, medians;
- **model**: the engine's own calls of the fixture (`MarianOnnx.encode`,
  `MaskedDecoder.prefill` of 13 positions with 3 read, an in-place step), at 1 to 4 rows,
  thread CPU per call, back to back and with a 2 ms pause before each call (the state of a
  lane at this load: its core idles between bursts), then weighed by the whole's calls per
  update, rows interpolated between the integers.

The floor through `serve` is transport + model: what an update costs with no engine between
the socket and the model; in process, the load's own + model. It is a lower bound (each
part alone, no threads between them, no tokenizing, policy, scheduling or publishing).
docs/performance.md has what it says.

    python examples/benchmarks/host_floor.py
    python examples/benchmarks/host_floor.py --writers 120 --repeats 3 --seconds 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from host_cost import cpu_name, proc_cpu  # noqa: E402
from load_server import free_port  # noqa: E402

SENTENCE = "Lucy wants to play tennis with my brother on Sunday"
SERVERS = ("websockets", "websockets, coalesced", "sans-io")
PAUSE_S = 0.002


# -- the bare servers (run as `--child SERVER PORT`) ----------------------------------------


def reply_for(message: str | bytes) -> str:
    """One reply of a translation update's size for one writer's message."""
    got = json.loads(message)
    return json.dumps(
        {
            "type": "translation",
            "stream": got.get("stream"),
            "seq": got.get("seq"),
            "lang": "de",
            "stable": got.get("text", "")[: len(got.get("text", "")) // 2],
            "tentative": got.get("text", "")[len(got.get("text", "")) // 2 :],
            "final": got.get("final", False),
            "cursor": "1-0",
            "epoch": 1,
        }
    )


async def websockets_server(port: int) -> None:
    from websockets.asyncio.server import ServerConnection, serve

    async def handler(ws: ServerConnection) -> None:
        async for message in ws:
            await ws.send(reply_for(message))

    async with serve(handler, "127.0.0.1", port, compression=None):
        await asyncio.Future()


async def sans_io_server(port: int) -> None:
    from websockets.frames import Frame, Opcode
    from websockets.http11 import Request
    from websockets.server import ServerProtocol

    class Connection(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport, self.ws = transport, ServerProtocol()

        def data_received(self, data: bytes) -> None:
            ws = self.ws
            ws.receive_data(data)
            for event in ws.events_received():
                if isinstance(event, Request):
                    ws.send_response(ws.accept(event))
                elif isinstance(event, Frame) and event.opcode is Opcode.TEXT:
                    ws.send_text(reply_for(bytes(event.data)).encode())
            for chunk in ws.data_to_send():
                if chunk:
                    self.transport.write(chunk)
                else:
                    self.transport.close()

    server = await asyncio.get_running_loop().create_server(Connection, "127.0.0.1", port)
    async with server:
        await asyncio.Future()


def child(kind: str, port: int) -> int:
    if kind == "sans-io":
        asyncio.run(sans_io_server(port))
    elif kind == "websockets, coalesced":
        from engine.streaming.wakeups import coalescing_loop

        with asyncio.Runner(loop_factory=coalescing_loop(0.005)) as runner:
            runner.run(websockets_server(port))
    else:
        asyncio.run(websockets_server(port))
    return 0


# -- the load --------------------------------------------------------------------------------


async def writer(
    url: str, index: int, args: argparse.Namespace, stop: float, got: list[int]
) -> None:
    from websockets.asyncio.client import connect

    words = SENTENCE.split()
    async with connect(url, compression=None) as ws:

        async def read() -> None:
            async for _ in ws:
                got[0] += 1

        reader = asyncio.create_task(read())
        await asyncio.sleep(args.interval * index / args.writers)  # staggered
        seq = 0
        while time.monotonic() < stop:
            final = seq % 8 == 7
            text = " ".join(words[: 1 + seq % len(words)])
            message: dict[str, object] = {"type": "final" if final else "partial"}
            message["stream"] = f"s{index}"
            message.update({"seq": seq, "text": text, "final": final})
            await ws.send(json.dumps(message))
            seq += 1
            await asyncio.sleep(args.interval)
        await asyncio.sleep(0.3)
        reader.cancel()


async def load(url: str, pid: int, args: argparse.Namespace) -> float:
    """Server CPU ms per reply over the measured window."""
    got = [0]
    stop = time.monotonic() + args.warmup + args.seconds
    tasks = [asyncio.create_task(writer(url, i, args, stop, got)) for i in range(args.writers)]
    await asyncio.sleep(args.warmup)
    c0, n0 = proc_cpu(pid), got[0]
    await asyncio.sleep(args.seconds)
    c1, n1 = proc_cpu(pid), got[0]
    await asyncio.gather(*tasks, return_exceptions=True)
    return (c1 - c0) / max(1, n1 - n0) * 1000.0


def transport(kind: str, args: argparse.Namespace) -> float:
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--child", kind, str(port)])
    try:
        time.sleep(1.5)
        return asyncio.run(load(f"ws://127.0.0.1:{port}", server.pid, args))
    finally:
        server.kill()
        server.wait()


# -- the model's calls -----------------------------------------------------------------------


@contextmanager
def translator(model: Path) -> Iterator[Any]:
    from engine import Translator
    from engine.decoding.scheduler import SchedulerOptions

    tr = Translator.from_dir(model, scheduler=SchedulerOptions())
    try:
        yield tr
    finally:
        tr.close()


def model_calls(tr: Any, rows: int) -> dict[str, Callable[[], object]]:
    """The encoder, the prefill (13 positions, 3 read) and an in-place step (20 cached) of
    `rows` rows, through the engine's own path (`call_cost.py`'s)."""
    from call_cost import one_row_calls

    made = one_row_calls(tr, past=20, rows=rows)
    return {
        name: call for name, (_, call) in zip(("encoder", "prefill", "step"), made, strict=True)
    }


def per_call_us(call: Callable[[], object], pause: float, n: int) -> float:
    for _ in range(10):
        call()
    spent = 0.0
    for _ in range(n):
        if pause:
            time.sleep(pause)
        began = time.thread_time()
        call()
        spent += time.thread_time() - began
    return spent / n * 1e6


def model_table(model: Path, rounds: int) -> dict[tuple[str, str], list[float]]:
    """(call, back to back | paused) -> us per call at 1..4 rows, medians of `rounds`."""
    table: dict[tuple[str, str], list[float]] = {}
    with translator(model) as tr:
        made = {rows: model_calls(tr, rows) for rows in range(1, 5)}
        for name in ("encoder", "prefill", "step"):
            for way, pause, n in (("back to back", 0.0, 300), ("paused", PAUSE_S, 150)):
                table[(name, way)] = [
                    statistics.median(
                        per_call_us(made[rows][name], pause, n) for _ in range(rounds)
                    )
                    for rows in range(1, 5)
                ]
    return table


def at_rows(costs: list[float], rows: float) -> float:
    """Cost per call at `rows` (1 to 4), interpolated linearly."""
    rows = min(4.0, max(1.0, rows))
    low = int(rows)
    if low >= 4:
        return costs[3]
    return costs[low - 1] + (costs[low] - costs[low - 1]) * (rows - low)


# -- the whole, and the report ------------------------------------------------------------


def whole(args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """One `host_cost.py` run at this load (`extra`: its mode and options)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        command = [sys.executable, str(HERE / "host_cost.py"), *extra]
        command += ["--writers", str(args.writers), "--seconds", str(args.seconds)]
        command += ["--warmup", str(args.warmup), "--interval", str(args.interval)]
        command += ["--model", str(args.model), "--json", str(out)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        runs: dict[str, Any] = json.loads(out.read_text())
    first: dict[str, Any] = next(iter(runs.values()))[0]  # one tree, one run
    return first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=120)
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between messages")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each bare server")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each model call")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "fixture" / "model")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]))

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"CPU: {cpu_name()}; {when}")
    print(f"{args.writers} writers, a message every {args.interval} s, {args.seconds} s measured")
    runs = whole(args, "--mode", "serve")
    inproc = whole(args, "--mode", "inproc")
    load_only = whole(args, "--mode", "inproc", "--load-only")["ms_per_update"]
    print(
        f"whole, serve: {runs['ms_per_update']:.3f} ms CPU per update "
        f"(lanes {runs['lanes_ms_per_update']:.3f} / loop {runs['loop_ms_per_update']:.3f}); "
        f"in process: {inproc['ms_per_update']:.3f}, of which the load's own {load_only:.3f}"
    )
    bare: dict[str, list[float]] = {kind: [] for kind in SERVERS}
    for repeat in range(args.repeats):
        order = SERVERS if repeat % 2 == 0 else tuple(reversed(SERVERS))
        for kind in order:
            bare[kind].append(transport(kind, args))
    print("transport, a bare server, ms CPU per reply (runs; median):")
    for kind, values in bare.items():
        runs_text = ", ".join(f"{v:.3f}" for v in values)
        print(f"  {kind:24s} {runs_text}; {statistics.median(values):.3f}")

    table = model_table(args.model, args.rounds)
    print("model calls, us of thread CPU per call at 1 / 2 / 3 / 4 rows:")
    for (name, way), costs in table.items():
        print(f"  {name:8s} {way:13s} " + " / ".join(f"{c:6.1f}" for c in costs))
    mix = {
        "encoder": (runs["encoder_calls_per_update"], runs["encoder_rows_per_call"]),
        "prefill": (runs["prefills_per_update"], runs["prefill_rows_per_call"]),
        "step": (runs["steps_per_update"], runs.get("step_rows_per_call") or 1.0),
    }
    print(
        "the whole's calls per update x rows per call: "
        + ", ".join(f"{name} {calls:.2f} x {rows:.2f}" for name, (calls, rows) in mix.items())
    )
    floor_transport = statistics.median(bare["websockets, coalesced"])
    for way in ("back to back", "paused"):
        model_ms = (
            sum(calls * at_rows(table[(name, way)], rows) for name, (calls, rows) in mix.items())
            / 1000.0
        )
        floor, spent = floor_transport + model_ms, runs["ms_per_update"]
        print(
            f"floor through serve, model {way}: transport {floor_transport:.3f} + model "
            f"{model_ms:.3f} = {floor:.3f} ms per update; the whole {spent:.3f} "
            f"({spent - floor:.3f} above)"
        )
        floor, spent = load_only + model_ms, inproc["ms_per_update"]
        print(
            f"floor in process, model {way}: the load {load_only:.3f} + model {model_ms:.3f} "
            f"= {floor:.3f} ms per update; the whole {spent:.3f} ({spent - floor:.3f} above)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
