"""A real-time speaker's delay to its finals while other connections churn audio streams:
each sends `start_audio` then `end_audio` with no audio in between, over and over, so the
server is asked to make recognizers as fast as it lets them be asked for.

Starts `nmt-incremental serve --asr pocketsphinx` (the fixture model and the fixture's
domain language model, or with `--general-model` pocketsphinx's own en-US model, whose
recognizers take longer to make; one recognition process) from `--root` (default this checkout, so
that another checkout's server can be measured alike), lets one speaker play a talk of
`--files` spoken files at real time (`audio_streams.speak`), and meanwhile `--churners`
connections each send a start/end pair every `--every` seconds until the speaker is done.

It reports the speaker's end of speech -> final translation (p50 / p95 / max, as
`audio_streams.py` measures it), finals heard against finals translated, its errors, how
many starts the churners sent and how many were refused (by code), and the server's
resident memory after the run.

    python examples/benchmarks/audio_churn.py [--churners 40] [--every 1.0] [--files 4]
        [--general-model] [--root DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from audio_streams import Stream, percentile, read_wav, speak
from load_server import free_port, wait_ready
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

ROOT = Path(__file__).resolve().parents[2]
SPEECH = ROOT / "examples" / "speech"


async def churn(
    url: str, index: int, every: float, done: asyncio.Event, codes: Counter[str]
) -> None:
    """Start and end an audio stream every `every` seconds until `done`; count the starts
    (`sent`) and the refusals by code."""
    stream = f"churn-{index}"
    start = json.dumps({"type": "start_audio", "stream_id": stream, "sample_rate": 16000})
    end = json.dumps({"type": "end_audio", "stream_id": stream})
    async with connect(url) as ws:

        async def read() -> None:
            async for data in ws:
                message = json.loads(data)
                if message["type"] == "error" and message.get("field") != "stream_id":
                    codes[message["code"]] += 1

        reader = asyncio.create_task(read())
        try:
            while not done.is_set():
                await ws.send(start)
                await ws.send(end)
                codes["sent"] += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), every)
        except ConnectionClosed:
            pass
        reader.cancel()


async def run(url: str, pcm: bytes, churners: int, every: float) -> tuple[Stream, Counter[str]]:
    speaker = Stream("speaker")
    codes: Counter[str] = Counter()
    done = asyncio.Event()
    talk = asyncio.create_task(speak(url, speaker, pcm, 0.0, 60.0))
    await asyncio.sleep(0.5)  # the speaker's stream is open before the churn begins
    tasks = [asyncio.create_task(churn(url, i, every, done, codes)) for i in range(churners)]
    await talk
    done.set()
    await asyncio.gather(*tasks)
    return speaker, codes


def rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its children (the recognition workers), in MB."""
    pids = [pid]
    for children in Path(f"/proc/{pid}/task").glob("*/children"):  # any thread's
        pids += [int(p) for p in children.read_text().split()]
    total = 0
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "fixture" / "model"))
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose server runs")
    parser.add_argument("--churners", type=int, default=40)
    parser.add_argument(
        "--every", type=float, default=1.0, help="seconds between a churner's start/end pairs"
    )
    parser.add_argument("--files", type=int, default=4, help="spoken files in the talk")
    parser.add_argument(
        "--general-model",
        action="store_true",
        help="pocketsphinx's general en-US model (each recognizer takes longer to make) "
        "instead of the fixture's domain model",
    )
    args = parser.parse_args()
    files = sorted((SPEECH / "wav").glob("*.wav"))[: args.files]
    pcm = b"".join(read_wav(path) for path in files)
    port = free_port()
    command = [
        sys.executable, "-m", "engine.server", "--model", args.model, "--port", str(port),
        "--asr", "pocketsphinx", "--asr-workers", "1",
    ]  # fmt: skip
    if not args.general_model:
        command += ["--lm", str(SPEECH / "fixture.lm.gz"), "--dict", str(SPEECH / "fixture.dict")]
    env = {"PYTHONPATH": args.root, "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command, cwd=args.root, stdout=log, stderr=log, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            if not wait_ready(server, base, log):
                return 1
            url = f"ws://127.0.0.1:{port}/ws"
            speaker, codes = asyncio.run(run(url, pcm, args.churners, args.every))
            rss = rss_mb(server.pid)
        finally:
            server.terminate()
            server.wait(30)
    delays = [d[0] for d in speaker.delays()]
    sent = codes.pop("sent", 0)
    print(
        f"speaker: {len(pcm) / 32000:.1f} s of speech, {len(speaker.echo_final)} finals heard, "
        f"{len(speaker.update_final)} translated; end of speech -> final translation "
        f"p50 {percentile(delays, 50):.0f} ms, p95 {percentile(delays, 95):.0f} ms, "
        f"max {max(delays, default=float('nan')):.0f} ms; errors: {speaker.errors[:3]}"
    )
    print(f"churn: {args.churners} connections, {sent} starts sent, refused: {dict(codes)}")
    print(f"server RSS after the run (with its recognition worker): {rss:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
