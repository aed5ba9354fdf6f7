"""SIGTERM with N speakers mid-utterance: does each speaker get every utterance it began
answered (its final translated, or an error about it), and how long does the server take
to exit?

Starts `nmt-incremental serve --asr pocketsphinx` (the fixture model and the fixture's
domain model) as a subprocess. For each N: N connections each start an audio stream and
send a little silence, and the script waits until the server has heard all of it (every
recognizer made), so that the stop does not land on recognizers still being built. Then
every speaker plays, at real time and all at once, one spoken file (a finished sentence,
with its pause) and the first `--cut` seconds of another (an utterance in progress), and
SIGTERM goes to the server right after the last frame. Each speaker then reads until the
close frame.

Per N it reports: the utterances heard (final echoes), those answered (a final
translation or an error naming its `seq`), those lost (echoed and not answered, plus each
speaker whose utterance in progress got no final), the errors about audio left
unrecognized, the close codes, the time from SIGTERM to the server's exit, and the
server's CPU time (its processes', from start to exit). Each N gets a fresh server.

    python examples/benchmarks/audio_shutdown.py [--speakers 24,48] [--shutdown-timeout 10]

Needs the `asr` extra (pocketsphinx). Only 127.0.0.1 is contacted; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from audio_streams import metric, read_wav
from load_server import free_port, http_get, wait_ready
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

ROOT = Path(__file__).resolve().parents[2]
SPEECH = ROOT / "examples" / "speech"
RATE = 16_000
FRAME = RATE // 10 * 2  # 100 ms of 16-bit PCM
WARM_S = 0.3


@dataclass
class Speaker:
    stream_id: str
    ws: ClientConnection | None = None
    talk_ms: float = 0.0  # where its utterance in progress began
    finals: dict[int, float] = field(default_factory=dict)  # echoed final seq -> start_ms
    answered: set[int] = field(default_factory=set)
    unrecognized: list[str] = field(default_factory=list)
    close_code: int | None = None

    def lost(self) -> int:
        unanswered = len(set(self.finals) - self.answered)
        last_begun = any(start >= self.talk_ms - 300 for start in self.finals.values())
        return unanswered + (0 if last_begun else 1)


async def read_until_closed(speaker: Speaker) -> None:
    assert speaker.ws is not None
    try:
        async for data in speaker.ws:
            message: dict[str, Any] = {"seq": None, **json.loads(data)}
            kind, seq, final = message["type"], message["seq"], message.get("is_final")
            about_final = kind == "error" or (kind == "translation_update" and final)
            if kind == "partial_transcript" and final:
                speaker.finals[int(seq)] = message["start_ms"]
            elif about_final and seq is not None:
                speaker.answered.add(int(seq))
            elif kind == "error" and "not recognized" in message["message"]:
                speaker.unrecognized.append(message["message"])
    except ConnectionClosed as closed:
        speaker.close_code = closed.rcvd.code if closed.rcvd is not None else None
    else:
        speaker.close_code = speaker.ws.close_code


async def run(url: str, base: str, server: subprocess.Popen[bytes], n: int, args: Any) -> str:
    files = sorted((SPEECH / "wav").glob("*.wav"))
    speakers = [Speaker(f"talk-{i}") for i in range(n)]
    talks = []
    for i, speaker in enumerate(speakers):
        first, second = read_wav(files[i % len(files)]), read_wav(files[(i + 7) % len(files)])
        speaker.talk_ms = (WARM_S * RATE * 2 + len(first)) / 2 / RATE * 1000 + 250
        talks.append(first + second[: int(args.cut * RATE) * 2])
    for speaker in speakers:
        speaker.ws = await connect(url, max_size=2**22)
        await speaker.ws.send(
            json.dumps({"type": "start_audio", "stream_id": speaker.stream_id, "sample_rate": RATE})
        )
        await speaker.ws.send(b"\0\0" * int(WARM_S * RATE))
    readers = [asyncio.create_task(read_until_closed(s)) for s in speakers]
    deadline = time.monotonic() + 120
    while metric(http_get(base + "/metrics")[1], "nmt_audio_seconds_total", '"heard"') < (
        n * WARM_S - 0.01
    ):
        if time.monotonic() > deadline:
            raise SystemExit("the recognizers were not ready within 120 s")
        await asyncio.sleep(0.2)

    async def play(speaker: Speaker, pcm: bytes, started: float) -> None:
        assert speaker.ws is not None
        for k, at in enumerate(range(0, len(pcm), FRAME)):
            await asyncio.sleep(max(0.0, started + (k + 1) / 10 - time.perf_counter()))
            await speaker.ws.send(pcm[at : at + FRAME])

    started = time.perf_counter()
    await asyncio.gather(*(play(s, pcm, started) for s, pcm in zip(speakers, talks, strict=True)))
    signalled = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    await asyncio.wait_for(asyncio.gather(*readers), timeout=60)
    await asyncio.to_thread(server.wait, 60)
    exit_s = time.perf_counter() - signalled
    heard = sum(len(s.finals) for s in speakers)
    answered = sum(len(set(s.finals) & s.answered) for s in speakers)
    lost = sum(s.lost() for s in speakers)
    codes = Counter(s.close_code for s in speakers)
    unrecognized = sum(len(s.unrecognized) for s in speakers)
    return (
        f"| {n} | {heard} | {answered} | {lost} | {unrecognized} | "
        f"{dict(codes)} | {exit_s:.1f} | {server.returncode} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options: dict[str, dict[str, Any]] = {
        "--speakers": {"default": "24,48", "help": "comma-separated N values"},
        "--shutdown-timeout": {"type": float, "default": 10.0},
        "--cut": {"type": float, "default": 1.5, "help": "seconds of the second file"},
        "--asr-workers": {"type": int, "default": None},
    }
    for name, spec in options.items():
        parser.add_argument(name, **spec)
    args = parser.parse_args()
    model = ROOT / "models" / "fixture" / "model"
    rows = []
    spent = 0.0  # CPU of the servers run so far
    for n in [int(x) for x in args.speakers.split(",")]:
        port = free_port()
        command = [
            sys.executable, "-m", "engine.server", "--model", str(model), "--port", str(port),
            "--asr", "pocketsphinx", "--lm", str(SPEECH / "fixture.lm.gz"),
            "--dict", str(SPEECH / "fixture.dict"), "--max-audio-streams", str(n + 4),
            "--max-streams", str(n * 2 + 8), "--shutdown-timeout", str(args.shutdown_timeout),
            "--log-level", "info",
        ]  # fmt: skip
        if args.asr_workers is not None:
            command += ["--asr-workers", str(args.asr_workers)]
        with tempfile.TemporaryDirectory() as tmp:
            log_path = Path(tmp) / "server.log"
            with open(log_path, "w+", encoding="utf-8") as server_log:
                server = subprocess.Popen(command, cwd=ROOT, stdout=server_log, stderr=server_log)
                base = f"http://127.0.0.1:{port}"
                try:
                    if not wait_ready(server, base, server_log):
                        return 1
                    row = asyncio.run(run(f"ws://127.0.0.1:{port}/ws", base, server, n, args))
                finally:
                    if server.poll() is None:
                        server.kill()
                        server.wait()
                tail = [x for x in log_path.read_text().splitlines() if "Traceback" in x]
            used = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu, spent = used.ru_utime + used.ru_stime - spent, used.ru_utime + used.ru_stime
            row += f" {cpu:.0f} |"
            print(f"N={n}: {row}", file=sys.stderr)
            if tail:
                print(f"  {len(tail)} traceback(s) in the server log", file=sys.stderr)
            rows.append(row)
    print()
    print(
        "| speakers | utterances heard | answered | lost | 'not recognized' errors "
        "| close codes | SIGTERM -> exit s | exit status | server CPU s |"
    )
    print("|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
