"""Replay a transcript log into a running `nmt-incremental serve`, in real time.

A log is JSON Lines of `partial_transcript` messages with an extra `emit_ms` (when the
recogniser emitted it; see `engine/logs/format.py`). Each line is sent at its
`emit_ms` (divided by `--speed`) without `emit_ms`, and the updates are printed as they
come. Needs only the `protocol` package and `websockets`, like any pipeline client:

    python examples/replay_client.py examples/logs/fixture_en_zh.jsonl --stream-id mic-1
    python examples/replay_client.py LOG --url ws://host:8765/ws --token SECRET --quiet

It prints the subtitle page of each stream first (open it to watch the subtitles live).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect

import protocol
from protocol import CloseStream, ErrorMessage, PartialTranscript, TranslationUpdate

_FIELDS = frozenset(f.name for f in dataclasses.fields(PartialTranscript)) | {"type"}


@dataclass(frozen=True)
class LogLine:
    emit_ms: float
    event: PartialTranscript


@dataclass
class ReplayResult:
    """What one replay saw. Latencies are in milliseconds: `client_ms` from sending a
    partial to receiving its update, `server_ms` the update's own `latency_ms`."""

    sent: int = 0
    updates: list[TranslationUpdate] = field(default_factory=list)
    errors: list[ErrorMessage] = field(default_factory=list)
    client_ms: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    finals_expected: set[tuple[str, int]] = field(default_factory=set)
    # (stream, seq, language): a server translating into several languages (fan-out)
    # answers each final once per language; a writer hears every language.
    finals_received: set[tuple[str, int, str | None]] = field(default_factory=set)
    # An error replied; language None: about the message itself, so for every language.
    finals_refused: set[tuple[str, int, str | None]] = field(default_factory=set)
    languages: set[str | None] = field(default_factory=set)  # seen on updates

    @property
    def lost_finals(self) -> set[tuple[str, int, str | None]]:
        """(stream, seq, language) of finals that got no reply in a language the server
        answers in (neither their final update nor an error)."""
        languages = self.languages or {None}
        return {
            (stream, seq, lang)
            for stream, seq in self.finals_expected
            for lang in languages
            if (stream, seq, lang) not in self.finals_received
            and (stream, seq, lang) not in self.finals_refused
            and (stream, seq, None) not in self.finals_refused
        }


def read_log(path: str | Path, rename: Callable[[str], str] = str) -> list[LogLine]:
    """Log lines as protocol events; annotations other than `emit_ms` are dropped, and
    `rename` maps stream ids (e.g. to run several copies of one log at once)."""
    lines: list[LogLine] = []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            obj = json.loads(raw)
            emit_ms = float(obj.pop("emit_ms"))
            wire = {k: v for k, v in obj.items() if k in _FIELDS}
            if isinstance(wire.get("stream_id"), str):
                wire["stream_id"] = rename(wire["stream_id"])
            event = protocol.parse(json.dumps(wire), accept={"partial_transcript"})
            if not isinstance(event, PartialTranscript):
                raise ValueError(f"{path}:{number}: {getattr(event, 'message', event)}")
            lines.append(LogLine(emit_ms, event))
    return lines


async def replay(
    url: str,
    lines: Sequence[LogLine],
    *,
    speed: float = 1.0,
    token: str | None = None,
    on_message: Callable[[TranslationUpdate | ErrorMessage], None] | None = None,
    final_timeout: float = 30.0,
) -> ReplayResult:
    """Send `lines` on their schedule over one connection, then close their streams and
    wait (up to `final_timeout` s) until every final has its final update."""
    result = ReplayResult()
    sent_at: dict[tuple[str, int], float] = {}
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with connect(url, additional_headers=headers, max_size=2**22) as ws:
        receiver = asyncio.create_task(_receive(ws, result, sent_at, on_message))
        start = time.perf_counter()
        origin = lines[0].emit_ms if lines else 0.0
        for line in lines:
            delay = start + (line.emit_ms - origin) / 1000.0 / speed - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            event = line.event
            sent_at[(event.stream_id, event.seq)] = time.perf_counter()
            await ws.send(protocol.serialize(event))
            result.sent += 1
            if event.is_final:
                result.finals_expected.add((event.stream_id, event.seq))
        for stream_id in sorted({line.event.stream_id for line in lines}):
            await ws.send(protocol.serialize(CloseStream(stream_id)))
        deadline = time.perf_counter() + final_timeout
        while result.lost_finals and time.perf_counter() < deadline and not receiver.done():
            await asyncio.sleep(0.02)
        receiver.cancel()
    return result


async def _receive(
    ws: ClientConnection,
    result: ReplayResult,
    sent_at: dict[tuple[str, int], float],
    on_message: Callable[[TranslationUpdate | ErrorMessage], None] | None,
) -> None:
    async for data in ws:
        now = time.perf_counter()
        message = protocol.parse(data, max_bytes=2**22, accept=protocol.FROM_ENGINE_TYPES)
        if isinstance(message, TranslationUpdate):
            result.updates.append(message)
            sent = sent_at.get((message.stream_id, message.seq))
            if sent is not None:
                result.client_ms.append((now - sent) * 1000.0)
            result.server_ms.append(message.latency_ms)
            result.languages.add(message.lang)
            if message.is_final:
                result.finals_received.add((message.stream_id, message.seq, message.lang))
        elif isinstance(message, ErrorMessage):
            result.errors.append(message)
            key = (message.stream_id or "", message.seq if message.seq is not None else -1)
            if key in result.finals_expected:
                result.finals_refused.add((*key, message.lang))
        if on_message is not None and isinstance(message, TranslationUpdate | ErrorMessage):
            on_message(message)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def _print_message(message: TranslationUpdate | ErrorMessage) -> None:
    if isinstance(message, ErrorMessage):
        print(f"error {message.code}: {message.message} ({message.stream_id} {message.seq})")
        return
    mark = "FINAL" if message.is_final else "     "
    tail = f"\x1b[2;3m{message.unstable_text}\x1b[0m" if message.unstable_text else ""
    print(
        f"{mark} {message.stream_id}#{message.segment_id} seq {message.seq:>4} "
        f"{message.latency_ms:6.0f} ms  {message.stable_text}{tail}"
    )


def page_url(ws_url: str, stream_id: str, token: str | None = None) -> str:
    """The subtitle page of a stream on the server behind the WebSocket URL `ws_url`."""
    parts = urllib.parse.urlsplit(ws_url)
    scheme = "https" if parts.scheme == "wss" else "http"
    query = {"stream": stream_id, **({"token": token} if token else {})}
    return urllib.parse.urlunsplit((scheme, parts.netloc, "/", urllib.parse.urlencode(query), ""))


def renamer(lines: Sequence[LogLine], stream_id: str | None) -> Callable[[str], str]:
    """`--stream-id ID`: a log's only stream becomes ID; several become ID-NAME each."""
    if stream_id is None:
        return str
    streams = {line.event.stream_id for line in lines}
    if len(streams) == 1:
        return lambda _: stream_id
    return lambda name: f"{stream_id}-{name}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="transcript log (JSON Lines with emit_ms)")
    parser.add_argument(
        "--url",
        default="ws://127.0.0.1:8765/ws",
        help="the server's WebSocket URL (default %(default)s)",
    )
    parser.add_argument(
        "--stream-id",
        default=None,
        metavar="ID",
        help="send the log's stream as ID (several streams: ID-NAME each)",
    )
    parser.add_argument("--token", default=None, help="the server's --token (the writer's)")
    parser.add_argument(
        "--viewer-token",
        default=None,
        help="the server's --viewer-token, for the page URL printed (never the writer's)",
    )
    parser.add_argument("--speed", type=float, default=1.0, help="2 = twice real time")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    args = parser.parse_args(argv)
    if args.speed <= 0:
        parser.error("--speed must be positive")
    lines = read_log(args.log)
    if args.stream_id is not None:
        lines = read_log(args.log, renamer(lines, args.stream_id))
    for stream in sorted({line.event.stream_id for line in lines}):
        print(f"subtitle page: {page_url(args.url, stream, args.viewer_token)}", file=sys.stderr)
    result = asyncio.run(
        replay(
            args.url,
            lines,
            speed=args.speed,
            token=args.token,
            on_message=None if args.quiet else _print_message,
        )
    )
    print(
        f"sent {result.sent} partials, got {len(result.updates)} updates, "
        f"{len(result.errors)} errors; latency p50 {percentile(result.client_ms, 50):.0f} ms, "
        f"p95 {percentile(result.client_ms, 95):.0f} ms (client-measured); "
        f"finals {len(result.finals_received)}/"
        f"{len(result.finals_expected) * max(len(result.languages), 1)} translated "
        f"({len(result.languages) or 1} language(s)), "
        f"{len(result.finals_refused)} refused with an error, {len(result.lost_finals)} "
        "without a reply",
        file=sys.stderr,
    )
    return 0 if not result.lost_finals else 1


if __name__ == "__main__":
    sys.exit(main())
