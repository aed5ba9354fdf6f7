"""N live audio streams into one `nmt-incremental serve --asr pocketsphinx`: recognition and
translation together, as speakers on the speaker page would load a server.

Starts the server as a subprocess (the fixture model, pocketsphinx with the fixture's
domain model), then for each N opens N WebSocket connections that each play a talk (the
spoken test set, `examples/speech/wav/*.wav`, a rotation of `--files` files per stream,
about 3 s each with silence around) at real time: `start_audio`, 100 ms frames of 16 kHz
PCM each when its audio would have been captured, `end_audio`, then the last replies.
Stream starts are staggered by up to a second, so that talkers are not in lockstep.

Per N it reports:

- the delay from a segment's end of speech to its final translation at the client, p50 and
  p95: the final's `end_ms` (the end of speech the recognizer found, on the stream's audio
  clock) is the moment a live microphone captured it, `start + end_ms` on the client's
  clock; the delay counts the 100 ms framing, the recognizer's end-of-utterance pause
  (`--silence`, 0.3 s), recognition, translation and the network. Split in two: end of
  speech -> the final's echo (`partial_transcript`, recognition), echo -> final update
  (translation);
- the server's CPU use (cores, from /proc: the server process and its children, the
  recognition worker processes) and where it went: the CPU time of the recognizer's calls
  in the workers (`nmt_audio_seconds_total{kind="recognizing_cpu"}`: accept, flush,
  resampling), and the rest (the engine's encoder and decoder, the event loop, WebSocket
  framing, passing audio and events to and from the workers); and, beside them, the
  engine's `compute_ms` summed over every update sent (the wall time of its encoder and
  decoder calls, so it also counts waiting: for the GIL, for a core);
- finals heard against finals translated (every final is to get its update), and errors;

and prints the largest N whose p95 stays within `--bound` (1.5 s).

    python examples/benchmarks/audio_streams.py [--streams 1,2,4,8,16] [--files 6]
        [--asr-workers N]   # the server's recognition processes (0: threads of the server)

Needs the `asr` extra (pocketsphinx). The machine matters: `lscpu | grep 'Model name'`,
and whatever else runs on it (`uptime`) shows in the delays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

# The server's helpers are load_server.py's (this directory is on the path when the script
# runs, as every benchmark here is run).
from load_server import free_port, http_get
from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parents[2]
SPEECH = ROOT / "examples" / "speech"
RATE = 16_000
FRAME_MS = 100
QUIET_S = 1.5  # after end_audio: this long without a message, all finals answered: done
TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Stream:
    """One speaker's run: what it sent and what came back, with client clock times."""

    stream_id: str
    audio_ms: float = 0.0
    started: float = 0.0  # perf_counter when its first frame was due (audio time 0)
    echo_final: dict[int, tuple[float, float]] = field(default_factory=dict)  # seg -> end_ms, t
    update_final: dict[int, float] = field(default_factory=dict)  # seg -> t
    compute_ms: float = 0.0
    updates: int = 0
    echoes: int = 0
    errors: list[str] = field(default_factory=list)
    last_message: float = 0.0  # perf_counter of the last message received

    def delays(self) -> list[tuple[float, float, float]]:
        """Per segment with both a final echo and a final update: (end of speech to
        update, end of speech to echo, echo to update), in ms."""
        out = []
        for segment, (end_ms, echoed) in self.echo_final.items():
            updated = self.update_final.get(segment)
            if updated is None:
                continue
            spoken = self.started + end_ms / 1000
            out.append(
                ((updated - spoken) * 1000, (echoed - spoken) * 1000, (updated - echoed) * 1000)
            )
        return out


def read_wav(path: Path) -> bytes:
    with wave.open(str(path)) as w:
        if (w.getnchannels(), w.getsampwidth(), w.getframerate()) != (1, 2, RATE):
            raise SystemExit(f"{path}: expected 16 kHz 16-bit mono")
        pcm: bytes = w.readframes(w.getnframes())
        return pcm


def talks(files: list[Path], per_stream: int, n: int) -> list[bytes]:
    """N talks, each `per_stream` files in a rotation that differs per stream."""
    clips = [read_wav(path) for path in files]
    return [b"".join(clips[(i * 3 + k) % len(clips)] for k in range(per_stream)) for i in range(n)]


async def speak(url: str, stream: Stream, pcm: bytes, delay: float, timeout: float) -> None:
    await asyncio.sleep(delay)
    frame = RATE * FRAME_MS // 1000 * 2
    async with connect(url, max_size=2**22) as ws:

        async def receive() -> None:
            async for data in ws:
                now = time.perf_counter()
                message = json.loads(data)
                kind = message["type"]
                if kind == "partial_transcript":
                    stream.echoes += 1
                    if message["is_final"]:
                        stream.echo_final[message["segment_id"]] = (message["end_ms"], now)
                elif kind == "translation_update":
                    stream.updates += 1
                    stream.compute_ms += message["compute_ms"]
                    if message["is_final"]:
                        stream.update_final[message["segment_id"]] = now
                else:
                    stream.errors.append(f"{message['code']}: {message['message']}")
                stream.last_message = now

        reader = asyncio.create_task(receive())
        await ws.send(json.dumps({"type": "start_audio", "stream_id": stream.stream_id,
                                  "sample_rate": RATE}))  # fmt: skip
        stream.started = time.perf_counter()
        for k, at in enumerate(range(0, len(pcm), frame)):
            # Frame k holds audio [k, k + 1) x 100 ms: sent once it would be captured.
            due = stream.started + (k + 1) * FRAME_MS / 1000
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await ws.send(pcm[at : at + frame])
        stream.audio_ms = len(pcm) / 2 / RATE * 1000
        await ws.send(json.dumps({"type": "end_audio", "stream_id": stream.stream_id}))
        # Done once every final heard has its update and nothing came for a while (the
        # last utterance's final follows end_audio, when the talk ended inside one).
        deadline = time.perf_counter() + timeout
        while True:
            await asyncio.sleep(0.2)
            settled = set(stream.update_final) >= set(stream.echo_final)
            if settled and time.perf_counter() - stream.last_message > QUIET_S:
                break
            if time.perf_counter() > deadline:
                stream.errors.append("timed out waiting for final updates")
                break
        reader.cancel()


async def run(url: str, pcms: list[bytes], n: int, seed: int, timeout: float) -> list[Stream]:
    rng = random.Random(seed)
    streams = [Stream(f"talk-n{n}-{i}") for i in range(n)]
    await asyncio.gather(
        *(
            speak(url, stream, pcm, rng.uniform(0, 1.0) if n > 1 else 0.0, timeout)
            for stream, pcm in zip(streams, pcms, strict=True)
        )
    )
    return streams


# -- the server ----------------------------------------------------------------------------


def metric(body: str, name: str, labels: str = "") -> float:
    """Sum of the samples of `name` whose labels contain `labels`."""
    total = 0.0
    for line in body.splitlines():
        named = line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")
        if named and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) and of its descendants: the
    live ones (the recognition workers) and, through the process's cutime/cstime, those
    it has reaped (a worker that ended)."""
    fields = _stat(pid)
    total = sum(int(x) for x in fields[11:15])
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                continue  # it ended meanwhile
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            total += sum(int(x) for x in _stat(child)[11:13])
        except OSError:
            continue
        todo += children.get(child, [])
    return total / TICK


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass
class Row:
    n: int
    audio_s: float
    wall_s: float
    cpu_s: float
    recognizing_cpu_s: float
    compute_s: float
    delays: list[tuple[float, float, float]]
    heard: int
    translated: int
    errors: list[str]

    def line(self) -> str:
        total = [d[0] for d in self.delays]
        echo = [d[1] for d in self.delays]
        translate = [d[2] for d in self.delays]
        rest = self.cpu_s - self.recognizing_cpu_s
        lost = "" if self.heard == self.translated else " LOST"
        return (
            f"| {self.n} | {self.audio_s:.0f} | {percentile(total, 50):.0f} / "
            f"{percentile(total, 95):.0f} "
            f"| {percentile(echo, 50):.0f} / {percentile(echo, 95):.0f} "
            f"| {percentile(translate, 50):.0f} / {percentile(translate, 95):.0f} "
            f"| {self.cpu_s / self.wall_s:.2f} | {self.recognizing_cpu_s:.1f} "
            f"({self.recognizing_cpu_s / self.audio_s * 100:.1f}% of audio) | {rest:.1f} "
            f"| {self.compute_s:.1f} | {self.translated} / {self.heard}{lost} "
            f"| {len(self.errors)} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "fixture" / "model"))
    parser.add_argument("--streams", default="1,2,4,8,16", help="comma-separated N values")
    parser.add_argument("--files", type=int, default=6, help="spoken files per stream's talk")
    parser.add_argument("--bound", type=float, default=1500.0, help="p95 delay bound, ms")
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads")
    parser.add_argument(
        "--asr-workers",
        type=int,
        default=None,
        help="the server's recognition processes (default: serve's; 0: threads)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--keep-going", action="store_true", help="run every N even after one misses the bound"
    )
    args = parser.parse_args()
    counts = [int(x) for x in args.streams.split(",")]
    files = sorted((SPEECH / "wav").glob("*.wav"))
    if not files:
        raise SystemExit(f"no WAV files in {SPEECH / 'wav'} (examples/speech/make_set.py)")

    port = free_port()
    command = [
        sys.executable, "-m", "engine.server", "--model", args.model, "--port", str(port),
        "--asr", "pocketsphinx", "--lm", str(SPEECH / "fixture.lm.gz"),
        "--dict", str(SPEECH / "fixture.dict"), "--max-audio-streams", str(max(counts) + 4),
        "--max-audio-streams-per-address", "0", "--max-audio-starting", str(max(counts) + 4),
        "--max-streams", str(max(counts) * 2 + 8),
    ]  # fmt: skip
    if args.threads:
        command += ["--threads", str(args.threads)]
    if args.asr_workers is not None:
        command += ["--asr-workers", str(args.asr_workers)]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        server_log = open(Path(tmp) / "server.log", "w+", encoding="utf-8")  # noqa: SIM115
        server = subprocess.Popen(command, cwd=ROOT, stdout=server_log, stderr=server_log)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while http_get(base + "/readyz")[0] != 200:
                if server.poll() is not None or time.monotonic() > deadline:
                    server_log.seek(0)
                    print(server_log.read(), file=sys.stderr)
                    return 1
                time.sleep(0.2)
            for n in counts:
                pcms = talks(files, args.files, n)
                before = http_get(base + "/metrics")[1]
                cpu_before = cpu_seconds(server.pid)
                started = time.perf_counter()
                streams = asyncio.run(run(f"ws://127.0.0.1:{port}/ws", pcms, n, args.seed + n, 60))
                wall = time.perf_counter() - started
                cpu = cpu_seconds(server.pid) - cpu_before
                after = http_get(base + "/metrics")[1]
                kind = '"recognizing_cpu"'
                recognizing = metric(after, "nmt_audio_seconds_total", kind) - metric(
                    before, "nmt_audio_seconds_total", kind
                )
                row = Row(
                    n=n,
                    audio_s=sum(s.audio_ms for s in streams) / 1000,
                    wall_s=wall,
                    cpu_s=cpu,
                    recognizing_cpu_s=recognizing,
                    compute_s=sum(s.compute_ms for s in streams) / 1000,
                    delays=[d for s in streams for d in s.delays()],
                    heard=sum(len(s.echo_final) for s in streams),
                    translated=sum(len(s.update_final) for s in streams),
                    errors=[e for s in streams for e in s.errors],
                )
                rows.append(row)
                p95 = percentile([d[0] for d in row.delays], 95)
                print(f"N={n}: {wall:.0f} s, p95 {p95:.0f} ms", file=sys.stderr)
                for error in row.errors[:3]:
                    print(f"  error: {error}", file=sys.stderr)
                if p95 > args.bound * 2 and not args.keep_going:
                    print("  far past the bound: no larger N", file=sys.stderr)
                    break
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
            server_log.close()
    print()
    print(
        "| streams | audio s | end of speech -> final update p50 / p95 ms | -> final echo "
        "(recognition) | echo -> update (translation) | server cores | recognizer CPU s "
        "| rest of server CPU s | engine compute_ms (wall) s | finals translated / heard "
        "| errors |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(row.line())
    keeping_up = [
        row.n
        for row in rows
        if percentile([d[0] for d in row.delays], 95) <= args.bound and row.heard == row.translated
    ]
    best = max(keeping_up, default=None)
    print()
    print(
        f"largest N that keeps up (final within {args.bound:.0f} ms at p95, every final "
        f"translated): {best if best is not None else 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
