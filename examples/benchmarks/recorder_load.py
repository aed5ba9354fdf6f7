"""What `serve --record` costs per final, and what it costs the other streams.

Part 1, the recorder alone (no model, no server): one stream's finals fed to
`engine.server.recorder.Recorder` as `record` feeds it. For 100 and 4,000 finals it prints

- the event loop's cost per final (median of `Recorder.take`: turning an update into a final and
  queueing it; all that runs on the loop),
- the writer thread's cost per final at that point (the last 100 finals, timed once the
  ones before are written): flat if a file grows a final at a time,
- for comparison, the naive way's cost at that point (the whole file laid out and
  rewritten through a temporary file and a rename, on the event loop, for every final;
  `subtitles.layout` + pysubs2).

Part 2 (`--serve`), through a real `serve` on loopback with the fixture model: a flood
writer sends one final every 1/33 s (a stream of its own) while a bystander writer sends a
partial every 200 ms and a final every 8th; run without `--record` and with it. Prints
the bystander's update latency p50/p95, the flood's final latency p50/p95, its finals
answered and those refused `rate_limited`. `--root DIR` runs the server from another
checkout, to compare two versions.

    python examples/benchmarks/recorder_load.py [--finals 100 4000] [--serve --flood 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect

# this checkout's engine, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_server import ROOT, free_port, http_get

from engine import subtitles
from engine.server.recorder import Recorder
from protocol import PartialTranscript, TranslationUpdate, serialize

WORDS = "Tom will play tennis with Lucy at three tomorrow".split()


def text_of(i: int) -> str:
    """A translation-sized final (30-60 characters), varied."""
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(5 + i % 5))


def update(i: int) -> TranslationUpdate:
    start = i * 2500.0
    return TranslationUpdate(
        "bench", i, i, text_of(i), "", True, 1.0, 1.0, epoch=1, start_ms=start, end_ms=start + 2000
    )


class _Engine:
    """What `Recorder.take` reads of an engine."""

    def epoch_of(self, stream_id: str) -> int | None:
        return 1


def new_recorder_cost(n: int, directory: Path, last: int = 100) -> tuple[float, float, int]:
    """(loop µs per final (median), writer µs per final over the last `last` of `n`,
    file bytes)."""
    rec = Recorder(directory, "vtt")
    engine: object = _Engine()
    updates = [update(i) for i in range(n)]
    writer = threading.Thread(target=rec.write_all)
    head = updates[: n - last]
    loop_s = []
    for u in head:  # the loop's side, timed alone (the writer has not started)
        t0 = time.perf_counter()
        rec.take(u, engine)  # type: ignore[arg-type]
        loop_s.append(time.perf_counter() - t0)
    writer.start()
    while rec.stats.finals < len(head):
        time.sleep(0.0002)
    t0 = time.perf_counter()
    for u in updates[n - last :]:
        rec.take(u, engine)  # type: ignore[arg-type]
    while rec.stats.finals < n:
        time.sleep(0.0002)
    writer_s = time.perf_counter() - t0
    rec.close()
    writer.join()
    (path,) = directory.glob("*.vtt")
    return statistics.median(loop_s) * 1e6, writer_s / last * 1e6, path.stat().st_size


def old_recorder_cost(n: int, directory: Path, reps: int = 5) -> float:
    """ms for a whole-file rewrite after the `n`-th final: lay out all `n` finals,
    write them with pysubs2 to a temporary file, rename it over the file (with
    `subtitles._is_cjk_text` uncached)."""
    directory.mkdir(parents=True, exist_ok=True)
    finals = [
        subtitles.Final(u.start_ms or 0, u.end_ms or 0, u.stable_text)
        for u in map(update, range(n))
    ]
    cached = subtitles._is_cjk_text
    subtitles._is_cjk_text = cached.__wrapped__  # type: ignore[assignment]
    try:
        times = [_old_write(finals, directory / "old.vtt") for _ in range(reps)]
    finally:
        subtitles._is_cjk_text = cached
    return statistics.median(times) * 1000


def _old_write(finals: list[subtitles.Final], path: Path) -> float:
    import pysubs2

    t0 = time.perf_counter()
    subs = pysubs2.SSAFile()
    for cue in subtitles.layout(finals):
        text = "\\N".join(cue.lines)
        subs.append(pysubs2.SSAEvent(start=int(cue.start_ms), end=int(cue.end_ms), text=text))
    tmp = path.with_name(path.name + ".tmp")
    subs.save(str(tmp), format_="vtt", encoding="utf-8")
    os.replace(tmp, path)
    return time.perf_counter() - t0


def part1(counts: list[int]) -> None:
    print("## recorder alone: cost per final, one stream")
    print()
    print(
        "| finals | event loop per final | writer thread per final (last 100) | file "
        "| old: rewrite on the loop per final |"
    )
    print("|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            loop_us, writer_us, size = new_recorder_cost(n, Path(tmp) / f"new{n}", min(100, n // 2))
            old_ms = old_recorder_cost(n, Path(tmp) / f"old{n}")
            print(
                f"| {n} | {loop_us:.1f} µs | {writer_us:.0f} µs | {size / 1024:.0f} KiB "
                f"| {old_ms:.1f} ms |"
            )
    print()


# --- part 2: through a real server ------------------------------------------------------


@dataclass
class Run:
    bystander_ms: list[float] = field(default_factory=list)
    flood_ms: list[float] = field(default_factory=list)
    flood_answered: int = 0
    rate_limited: int = 0
    other_errors: dict[str, int] = field(default_factory=dict)


def message(stream: str, segment: int, seq: int, text: str, final: bool, at: float) -> str:
    event = PartialTranscript(stream, segment, seq, text, final, start_ms=at, end_ms=at + 2000.0)
    return serialize(event)


async def flood(url: str, count: int, rate: float, run: Run) -> None:
    """One final every 1/rate s, each its own segment; waits for every reply."""
    sent: dict[int, float] = {}
    async with connect(url) as ws:
        reader = asyncio.create_task(read_flood(ws, sent, count, run))
        start = time.perf_counter()
        for i in range(count):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            sent[i] = time.perf_counter()
            await ws.send(message("flood", i, i, text_of(i), True, i * 2500.0))
        await asyncio.wait_for(reader, 120)


async def read_flood(ws: ClientConnection, sent: dict[int, float], count: int, run: Run) -> None:
    answered = 0
    while answered < count:
        reply = json.loads(await ws.recv())
        seq = reply.get("seq")
        if reply["type"] == "error":
            code = reply["code"]
            if code == "rate_limited":
                run.rate_limited += 1
            else:
                run.other_errors[code] = run.other_errors.get(code, 0) + 1
            answered += seq is not None
        elif reply["is_final"]:
            run.flood_ms.append((time.perf_counter() - sent[seq]) * 1000)
            run.flood_answered += 1
            answered += 1


async def bystander(url: str, stop: asyncio.Event, run: Run) -> None:
    """A partial every 200 ms, a final every 8th; latency of each to its update."""
    sent: dict[int, float] = {}
    async with connect(url) as ws:

        async def read() -> None:
            while True:
                reply = json.loads(await ws.recv())
                if reply["type"] == "translation_update" and reply["seq"] in sent:
                    run.bystander_ms.append((time.perf_counter() - sent.pop(reply["seq"])) * 1000)

        reader = asyncio.create_task(read())
        seq = 0
        while not stop.is_set():
            segment, k = divmod(seq, 8)
            words = WORDS[: k + 2]
            sent[seq] = time.perf_counter()
            await ws.send(
                message("bystander", segment, seq, " ".join(words), k == 7, segment * 3000.0)
            )
            seq += 1
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        reader.cancel()


async def drive(url: str, count: int, rate: float) -> Run:
    run = Run()
    stop = asyncio.Event()
    side = asyncio.create_task(bystander(url, stop, run))
    await asyncio.sleep(1.0)
    await flood(url, count, rate, run)
    stop.set()
    await side
    return run


def serve_run(args: argparse.Namespace, record: Path | None) -> Run:
    port = free_port()
    command = [
        sys.executable, "-m", "engine.server", "--model", args.model, "--port", str(port),
    ]  # fmt: skip
    if record is not None:
        command += ["--record", str(record)]
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command, cwd=args.root, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 120
            while http_get(f"http://127.0.0.1:{port}/readyz")[0] != 200:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise SystemExit(log.read())
                time.sleep(0.2)
            return asyncio.run(drive(f"ws://127.0.0.1:{port}/ws", args.flood, args.rate))
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()


def pct(values: list[float], q: int) -> str:
    if len(values) < 2:
        return "-"
    return f"{statistics.quantiles(values, n=100, method='inclusive')[q - 1]:.0f}"


def part2(args: argparse.Namespace) -> None:
    print(
        f"## through serve: a flood writer at {args.rate:g} finals/s ({args.flood} finals) "
        "beside a bystander"
    )
    print(f"server from {args.root}")
    print()
    print(
        "| --record | bystander p50 / p95 ms | flood final p50 / p95 ms | flood finals answered "
        "| rate_limited | other errors | recorded cues |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for recording in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            record = Path(tmp) / "rec" if recording else None
            run = serve_run(args, record)
            cues = 0
            if record is not None:
                cues = sum(p.read_bytes().count(b" --> ") for p in record.glob("flood*"))
            print(
                f"| {'yes' if recording else 'no'} "
                f"| {pct(run.bystander_ms, 50)} / {pct(run.bystander_ms, 95)} "
                f"| {pct(run.flood_ms, 50)} / {pct(run.flood_ms, 95)} "
                f"| {run.flood_answered} / {args.flood} | {run.rate_limited} "
                f"| {run.other_errors or 0} | {cues if recording else '-'} |",
                flush=True,
            )
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finals", type=int, nargs="+", default=[100, 4000])
    parser.add_argument("--serve", action="store_true", help="also part 2 (a real server)")
    parser.add_argument("--flood", type=int, default=2000, help="finals the flood writer sends")
    parser.add_argument("--rate", type=float, default=33.0, help="flood finals per second")
    parser.add_argument("--model", default=str(ROOT / "models" / "fixture" / "model"))
    parser.add_argument("--root", default=str(ROOT), help="checkout the server runs from")
    args = parser.parse_args()
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}"
    )
    print()
    part1(args.finals)
    if args.serve:
        part2(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
