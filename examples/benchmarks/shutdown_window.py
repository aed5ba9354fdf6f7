"""The shutdown window of `nmt-incremental serve` on loopback: a final sent at any point
of a shutdown gets exactly one reply, unless the client had the server's close frame
before sending it.

Each try starts a fresh server (`python -m engine.server --model ...` on a free loopback
port) and a raw WebSocket writer with an open segment and nothing in flight; with
`--backlog N` a second writer's N finals are being translated, so that the drain lasts.
Then SIGTERM, and the writer's final at an offset spread evenly over 0-`--window` ms after
the signal. Each try ends as one of:

- answered: exactly one reply about the final (its update or `unavailable`), then 1001;
- closed before sending: the writer had the close frame before its final was due;
- lost: sent, no reply, then the close frame. The server logs each final it read after
  its close frame (it crossed the close on the wire: the client's to send again after
  reconnecting, as docs/protocol.md says); a lost final it did not log broke the contract.

With `--blind` the writer sends its final even when the close frame came first, as a
raw-socket attacker would (those count as closed before sending, and the server's log
says whether it read them after its close frame). With `--never-answer-close` the writer
stays silent after the close frame, as a hung client would: the figure to watch is then
the time from SIGTERM to the server's exit, bounded by `--shutdown-timeout` plus a fixed
grace. Exit status 0 when no final was lost unaccounted, none was answered twice, and
every server exited 0 with no traceback.

    python examples/benchmarks/shutdown_window.py [--tries 200] [--window 200] [--backlog 0]
    python examples/benchmarks/shutdown_window.py --tries 3 --never-answer-close \
        --shutdown-timeout 1

Only 127.0.0.1 is contacted; every wait is bounded, and the script stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

# this checkout's engine, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_server import ROOT, free_port, http_get

from protocol import PartialTranscript, serialize

AFTER_CLOSE = re.compile(r"(\d+) final\(s\) arrived after the server's close frame")


def partial(stream: str, segment: int, seq: int, text: str, final: bool = False) -> bytes:
    return serialize(PartialTranscript(stream, segment, seq, text, is_final=final)).encode()


@dataclass
class Raw:
    """A WebSocket client on a plain socket (websockets' sans-I/O protocol): it sends
    frames as they are and answers the close frame only when told to."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    protocol: ClientProtocol
    replies: list[dict[str, Any]] = field(default_factory=list)
    closed_at: float | None = None  # when the server's close frame came (perf_counter)
    eof: bool = False
    answered: bool = False  # it answered the server's close frame

    @classmethod
    async def connect(cls, port: int) -> Raw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/ws"))
        protocol.send_request(protocol.connect())
        for data in protocol.data_to_send():
            writer.write(data)
        async with asyncio.timeout(10):
            while True:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("closed during the handshake")
                protocol.receive_data(data)
                if any(isinstance(e, Response) for e in protocol.events_received()):
                    break
        if protocol.handshake_exc is not None:
            raise protocol.handshake_exc
        return cls(reader, writer, protocol)

    def send(self, payload: bytes) -> None:
        self.writer.write(Frame(Opcode.TEXT, payload).serialize(mask=True))

    async def pump(self) -> None:
        """Read until the connection is over (run as a task)."""
        while True:
            try:
                data = await self.reader.read(65536)
            except ConnectionError:
                data = b""
            if not data:  # the server closed TCP: so does a client that answered the close
                self.eof = True
                if self.protocol.close_sent is not None and self.answered:
                    self.writer.transport.close()
                return
            self.protocol.receive_data(data)
            for event in self.protocol.events_received():
                if not isinstance(event, Frame):
                    continue
                if event.opcode is Opcode.TEXT:
                    self.replies.append(json.loads(bytes(event.data)))
                elif event.opcode is Opcode.CLOSE and self.closed_at is None:
                    self.closed_at = time.perf_counter()

    def answer_close(self) -> None:
        self.answered = True
        for data in self.protocol.data_to_send():  # its close frame, queued on receipt
            if data:
                self.writer.write(data)
        if self.eof:
            self.writer.transport.close()

    def about(self, seq: int) -> list[dict[str, Any]]:
        return [
            r
            for r in self.replies
            if r.get("seq") == seq and (r["type"] == "error" or r.get("is_final"))
        ]

    def abort(self) -> None:
        self.writer.transport.abort()


@dataclass
class Try:
    outcome: str  # answered / closed before sending / lost
    reply: str = ""  # "update" or the error code, when answered
    exit_s: float = float("nan")  # SIGTERM -> the server's exit
    status: int | None = None
    logged_after_close: int = 0  # finals the server says it read after its close frame
    traceback: bool = False
    backlog_unanswered: int = 0
    sent_after_close: bool = False  # --blind: sent although the close frame had come


async def wait_until(condition: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.002)
    return True


async def one_try(
    server: subprocess.Popen[bytes], port: int, offset: float, args: argparse.Namespace
) -> Try:
    writer = await Raw.connect(port)
    busy = await Raw.connect(port) if args.backlog else None
    tasks = [asyncio.create_task(c.pump()) for c in (writer, busy) if c is not None]
    try:
        writer.send(partial("w", 0, 0, "I will meet"))
        if not await wait_until(lambda: any(r.get("seq") == 0 for r in writer.replies), 30):
            raise RuntimeError("the open segment got no update")
        if busy is not None:
            for seg in range(args.backlog):
                busy.send(partial("busy", seg, seg, "Tom will play tennis with Lucy", True))
            await asyncio.sleep(0.002)  # on the server's side before the signal
        signalled = time.perf_counter()
        server.send_signal(signal.SIGTERM)
        await asyncio.sleep(max(0.0, signalled + offset - time.perf_counter()))
        saw_close = writer.closed_at is not None or writer.eof
        if saw_close and not args.blind:
            outcome = "closed before sending"
        else:  # blind: sent even after the close frame came, as an attacker would
            writer.send(partial("w", 0, 1, "I will meet Tom", final=True))
            outcome = ""
        clients = [c for c in (writer, busy) if c is not None]
        await wait_until(lambda: all(c.closed_at is not None or c.eof for c in clients), 20)
        if not args.never_answer_close:
            for c in clients:
                c.answer_close()
        await wait_until(lambda: all(c.eof for c in clients), 20)
        try:
            status: int | None = await asyncio.to_thread(server.wait, 30)
        except subprocess.TimeoutExpired:
            status = None
        exit_s = time.perf_counter() - signalled
        if not outcome:
            replies = writer.about(1)
            if len(replies) == 1:
                outcome = "answered"
            elif replies:
                outcome = "answered twice"
            else:
                outcome = "closed before sending" if saw_close else "lost"
        result = Try(outcome, exit_s=exit_s, status=status, sent_after_close=saw_close)
        if outcome == "answered":
            result.reply = writer.about(1)[0].get("code", "update")
        if busy is not None:
            result.backlog_unanswered = sum(len(busy.about(s)) != 1 for s in range(args.backlog))
        return result
    finally:
        for client in (writer, busy):
            if client is not None:
                client.abort()
        for task in tasks:
            task.cancel()


def run_try(offset: float, args: argparse.Namespace, workdir: Path) -> Try:
    port = free_port()
    command = [
        sys.executable, "-m", "engine.server", "--model", args.model, "--port", str(port),
        "--shutdown-timeout", str(args.shutdown_timeout), "--rate-limit", "0",
        "--log-level", "info",
    ]  # fmt: skip
    log_path = workdir / "server.log"
    with open(log_path, "w+", encoding="utf-8") as server_log:
        server = subprocess.Popen(command, cwd=ROOT, stdout=server_log, stderr=server_log)
        try:
            deadline = time.monotonic() + 120
            while http_get(f"http://127.0.0.1:{port}/readyz")[0] != 200:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("server did not start:\n" + log_path.read_text())
                time.sleep(0.05)
            result = asyncio.run(one_try(server, port, offset, args))
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    logged = log_path.read_text(encoding="utf-8")
    result.logged_after_close = sum(int(n) for n in AFTER_CLOSE.findall(logged))
    result.traceback = "Traceback" in logged
    if result.traceback and args.verbose:
        print(logged, file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default=str(ROOT / "models" / "fixture" / "model"))
    parser.add_argument("--tries", type=int, default=200)
    parser.add_argument("--window", type=float, default=200.0, help="ms after SIGTERM")
    parser.add_argument("--backlog", type=int, default=0, help="finals being translated")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0)
    parser.add_argument("--never-answer-close", action="store_true")
    parser.add_argument(
        "--blind",
        action="store_true",
        help="send the final even when the close frame came first (a raw-socket attack)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.tries <= 10_000:
        parser.error("--tries must be between 1 and 10000")

    rng = random.Random(args.seed)
    tries: list[tuple[float, Try]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.tries):
            offset = args.window / 1000 * (i + rng.random()) / args.tries
            tries.append((offset, run_try(offset, args, Path(tmp))))
            if args.verbose:
                print(f"{offset * 1000:6.1f} ms: {tries[-1][1]}", file=sys.stderr)
    wall = time.monotonic() - started

    outcomes = Counter(t.outcome for _, t in tries)
    replies = Counter(t.reply for _, t in tries if t.reply)
    lost = outcomes["lost"]
    crossed = min(lost, sum(t.logged_after_close for _, t in tries if t.outcome == "lost"))
    unaccounted = lost - crossed
    exits = [t.exit_s for _, t in tries]
    bad_exit = sum(t.status != 0 for _, t in tries)
    tracebacks = sum(t.traceback for _, t in tries)
    backlog_bad = sum(t.backlog_unanswered for _, t in tries)
    answered_at = [o for o, t in tries if t.outcome == "answered"]
    closed_at = [o for o, t in tries if t.outcome == "closed before sending"]

    print(
        f"{args.tries} tries in {wall:.0f} s: final sent 0-{args.window:g} ms after SIGTERM, "
        f"backlog {args.backlog}, --shutdown-timeout {args.shutdown_timeout:g}"
        + (", writer never answers the close" if args.never_answer_close else "")
        + (", sent blind" if args.blind else "")
    )
    print(
        f"answered / closed-before-sending / lost: {outcomes['answered']} / "
        f"{outcomes['closed before sending']} / {lost}"
    )
    print(f"answered with: {dict(sorted(replies.items()))}; answered twice: "
          f"{outcomes['answered twice']}")  # fmt: skip
    print(
        f"lost that the server read after its close frame (the client's to resend): "
        f"{crossed}; lost unaccounted: {unaccounted}"
    )
    if answered_at:
        print(f"latest offset answered: {max(answered_at) * 1000:.1f} ms")
    if closed_at:
        print(f"earliest offset that found the close frame first: {min(closed_at) * 1000:.1f} ms")
    if args.blind:
        after = [t for _, t in tries if t.sent_after_close and t.outcome != "answered"]
        print(
            f"sent blind after the close frame came: {len(after)}, of which the server "
            f"logged reading after its close frame: {sum(t.logged_after_close > 0 for t in after)}"
        )
    if args.backlog:
        print(f"backlog finals without exactly one reply: {backlog_bad}")
    print(
        f"SIGTERM -> exit: median {sorted(exits)[len(exits) // 2]:.2f} s, max {max(exits):.2f} s; "
        f"non-zero exits: {bad_exit}; tracebacks logged: {tracebacks}"
    )
    ok = not unaccounted and not outcomes["answered twice"] and not bad_exit and not tracebacks
    ok = ok and not backlog_bad
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
