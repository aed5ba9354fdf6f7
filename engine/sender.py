"""Play a transcript log into a running `nmt-incremental serve`, in real time: the writer
behind `nmt-incremental send` (and `examples/replay_client.py`, a thin wrapper of it).

A log is JSON Lines of `partial_transcript` messages with an extra `emit_ms` (when the
recogniser emitted it; see `engine/logs/format.py`). Each line is sent at its `emit_ms`
(divided by the speed) without `emit_ms`, and the updates come back to `on_message`;
`format_message` makes a line of each: its target language, the translation with its
tentative tail, and the source it translates. It needs the client side only (`protocol`,
`engine.reconnect`'s `Reconnector`, `websockets`), not the model.

The URL may name a load balancer in front of several server nodes. When the connection is
lost (a node dies or drains, or answers a final `unavailable`), the replay reconnects to
the same URL (`engine.reconnect.Reconnector`) and resends every final not yet answered
(`protocol.FinalLedger`), for up to `reconnect_for` seconds; the summary says how often.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import statistics
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

import protocol
from engine.reconnect import GaveUp, Reconnector, why_lost
from protocol import (
    Backoff,
    CloseStream,
    ErrorMessage,
    FinalLedger,
    Outcome,
    PartialTranscript,
    TranslationUpdate,
)
from protocol.codec import FROM_ENGINE_TYPES

_FIELDS = frozenset(f.name for f in dataclasses.fields(PartialTranscript)) | {"type"}


@dataclass(frozen=True)
class LogLine:
    emit_ms: float
    event: PartialTranscript


@dataclass
class ReplayResult:
    """What one replay saw. Latencies are in milliseconds: `client_ms` from sending a
    partial to receiving its update (a resent final's from its first send), `server_ms`
    the update's own `latency_ms`. `updates` holds each update once: a final's update
    received again after a resend counts in `duplicates` only.

    Reconnects (`protocol/writer.py`): `disconnects` says why each connection was lost
    (close code and reason, a dropped connection, an `unavailable` error about a final),
    `reconnects` how many new connections were made, `resent` how many finals were sent
    again on them, `skipped` how many partials that fell due meanwhile were superseded
    by a later line before they could be sent; `gave_up`: an outage outlasted
    `reconnect_for` (the log's finals never sent then count as lost)."""

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
    disconnects: list[str] = field(default_factory=list)
    reconnects: int = 0
    resent: int = 0
    duplicates: int = 0
    skipped: int = 0
    gave_up: bool = False

    @property
    def lost_finals(self) -> set[tuple[str, int, str | None]]:
        """(stream, seq, language) of finals that got no reply in a language the server
        answers in (neither their final update nor an error other than `unavailable`,
        which only means "send it again elsewhere")."""
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
    reconnect_for: float = 30.0,
    backoff: Backoff | None = None,
    on_event: Callable[[str], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> ReplayResult:
    """Send `lines` on their schedule, then close their streams and wait (up to
    `final_timeout` s) until every final has its final update.

    The connection may be lost: a node behind the balancer dies or drains (close frame
    1012, or 1001 from a single server), or cannot publish a final (`unavailable`). The
    replay then follows the writer's rule (`protocol/writer.py`): it reconnects to `url`
    (backing off from 0.1 s to 2 s, giving up after `reconnect_for` s), resends every
    final not yet answered, in order, with its ids, then goes on with the log. Partials
    that fell due while it was away are skipped when a later line of their stream is due
    too (a live recogniser's newer partial supersedes them); finals never are. `on_event`
    hears a line about each disconnect and reconnect; `on_wait`, at once, that the first
    connection failed and for how long the replay waits for a server (`waiting_note`)."""
    run = _Replay(
        url,
        lines,
        speed=speed,
        token=token,
        on_message=on_message,
        on_event=on_event or (lambda _: None),
        on_wait=on_wait or (lambda _: None),
        final_timeout=final_timeout,
        backoff=backoff or Backoff(total=reconnect_for),
    )
    return await run.run()


class _Replay:
    """One replay's state across its connections."""

    def __init__(
        self,
        url: str,
        lines: Sequence[LogLine],
        *,
        speed: float,
        token: str | None,
        on_message: Callable[[TranslationUpdate | ErrorMessage], None] | None,
        on_event: Callable[[str], None],
        on_wait: Callable[[str], None],
        final_timeout: float,
        backoff: Backoff,
    ) -> None:
        self.lines = lines
        self.speed = speed
        self.url = url
        self.on_wait = on_wait
        self.connected = False  # a first connection was made (later losses: on_event)
        self.dialer = Reconnector(url, token, backoff=backoff, on_retry=self._retrying)
        self.on_message = on_message
        self.on_event = on_event
        self.final_timeout = final_timeout
        self.backoff = backoff
        self.result = ReplayResult()
        self.ledger = FinalLedger()
        self.sent_at: dict[tuple[str, int], float] = {}
        self.next_line = 0  # the first line of the log not sent (nor skipped) yet
        self.closes_sent = False
        self.start = 0.0
        self.origin = lines[0].emit_ms if lines else 0.0
        self.resumed_at = 0.0  # when the last reconnect succeeded (lines due before: late)
        self.healthy = False  # the connection delivered an update: the outage is over
        self.deadline: float | None = None  # end of the wait for the last finals
        # The next line of the same stream, to tell a late partial that is superseded.
        self.next_of: list[int | None] = [None] * len(lines)
        last: dict[str, int] = {}
        for i in reversed(range(len(lines))):
            sid = lines[i].event.stream_id
            self.next_of[i] = last.get(sid)
            last[sid] = i

    def _retrying(self, attempt: int, failure: Exception) -> None:
        if not self.connected and attempt == 1:
            self.on_wait(waiting_note(self.url, failure, self.backoff.total))

    def due(self, index: int) -> float:
        return self.start + (self.lines[index].emit_ms - self.origin) / 1000.0 / self.speed

    async def run(self) -> ReplayResult:
        self.start = time.perf_counter()
        ws = await self.dialer.connect()  # never connected: the error itself is raised
        self.connected = True
        while True:
            self.healthy = self.ledger.pending == 0
            async with ws:
                reason = await self._session(ws)
            if reason is None:
                break
            self.result.disconnects.append(reason)
            self.on_event(f"reconnecting ({reason})")
            try:
                ws = await self.dialer.reconnect(self.healthy)
            except GaveUp:
                self.result.gave_up = True
                self.on_event(f"gave up reconnecting after {self.backoff.total:g} s")
                self._unsent_finals_are_lost()
                break
            self.result.reconnects += 1
            self.resumed_at = time.perf_counter()
        self.result.resent = self.ledger.resent
        self.result.duplicates = self.ledger.duplicates
        return self.result

    async def _session(self, ws: ClientConnection) -> str | None:
        """Resend what is owed, go on with the log, wait for the last finals. Returns why
        the connection was lost, or None when the replay is over."""
        receiver = asyncio.create_task(self._receive(ws))
        try:
            return await self._write(ws, receiver)
        except ConnectionClosed as exc:
            return why_lost(ws, exc)
        finally:
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiver

    async def _write(self, ws: ClientConnection, receiver: asyncio.Task[str]) -> str | None:
        # Streams opened on this connection: those of an earlier one were closed by the
        # server when it ended (their writer left), so only these are closed here.
        opened: set[str] = set()
        resent = self.ledger.owed()
        for event in resent:
            await ws.send(protocol.serialize(event))
            self.ledger.sent(event)
            opened.add(event.stream_id)
        if resent:
            self.on_event(f"resent {len(resent)} unanswered final(s)")
        if self.closes_sent:  # the resends opened their streams again: close them again
            for stream_id in sorted(opened):
                await ws.send(protocol.serialize(CloseStream(stream_id)))
        while self.next_line < len(self.lines):
            i = self.next_line
            delay = self.due(i) - time.perf_counter()
            if delay > 0:
                await asyncio.wait({receiver}, timeout=delay)
            if receiver.done():
                return receiver.result()
            self.next_line += 1
            if self._superseded(i):
                self.result.skipped += 1
                continue
            event = self.lines[i].event
            self.sent_at.setdefault((event.stream_id, event.seq), time.perf_counter())
            if event.is_final:
                self.result.finals_expected.add((event.stream_id, event.seq))
            self.ledger.hold(event)  # kept before the send, which may fail
            self.result.sent += 1
            await ws.send(protocol.serialize(event))
            self.ledger.sent(event)
            opened.add(event.stream_id)
        if not self.closes_sent:
            for stream_id in sorted(opened):
                await ws.send(protocol.serialize(CloseStream(stream_id)))
            self.closes_sent = True
        now = time.perf_counter()
        if self.deadline is None or resent:
            self.deadline = max(self.deadline or 0.0, now + self.final_timeout)
        while self.ledger.pending or self.result.lost_finals:
            if receiver.done():
                return receiver.result()
            if time.perf_counter() >= self.deadline:
                break
            await asyncio.wait({receiver}, timeout=0.02)
        return None

    def _superseded(self, i: int) -> bool:
        """A partial that fell due while the replay was disconnected, and whose stream's
        next line is due already: a live writer would never have sent it."""
        nxt = self.next_of[i]
        return (
            not self.lines[i].event.is_final
            and self.due(i) < self.resumed_at
            and nxt is not None
            and self.due(nxt) <= time.perf_counter()
        )

    def _unsent_finals_are_lost(self) -> None:
        """Giving up: the log's finals never sent got no reply either."""
        for line in self.lines[self.next_line :]:
            if line.event.is_final:
                self.result.finals_expected.add((line.event.stream_id, line.event.seq))

    async def _receive(self, ws: ClientConnection) -> str:
        """Read replies until the connection ends; returns why it ended (or the
        `unavailable` error that means this node cannot deliver an owed final)."""
        result = self.result
        try:
            async for data in ws:
                now = time.perf_counter()
                message = protocol.parse(data, max_bytes=2**22, accept=FROM_ENGINE_TYPES)
                if not isinstance(message, TranslationUpdate | ErrorMessage):
                    continue
                got = self.ledger.received(message)
                if got.outcome is Outcome.DUPLICATE:
                    continue  # seen already: counted by the ledger, shown once
                if isinstance(message, TranslationUpdate):
                    self.healthy = True
                    result.updates.append(message)
                    sent = self.sent_at.get((message.stream_id, message.seq))
                    if sent is not None:
                        result.client_ms.append((now - sent) * 1000.0)
                    result.server_ms.append(message.latency_ms)
                    result.languages.add(message.lang)
                    if message.is_final:
                        result.finals_received.add((message.stream_id, message.seq, message.lang))
                else:
                    result.errors.append(message)
                    key = (message.stream_id or "", message.seq if message.seq is not None else -1)
                    if key in result.finals_expected and got.outcome is not Outcome.MUST_RECONNECT:
                        result.finals_refused.add((*key, message.lang))  # not sent again
                if self.on_message is not None:
                    self.on_message(message)
                if got.outcome is Outcome.MUST_RECONNECT and isinstance(message, ErrorMessage):
                    return f"{message.code}: {message.message}"
        except ConnectionClosed as exc:
            return why_lost(ws, exc)
        return why_lost(ws)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def format_message(message: TranslationUpdate | ErrorMessage, *, color: bool) -> str:
    """One update as a line: final or not, stream and segment, seq, latency, the target
    language, the translation, and the source it translates (after `<-`). The tentative
    tail is dim on a terminal (`color`), in brackets elsewhere: a file gets plain text."""
    if isinstance(message, ErrorMessage):
        lang = f" [{message.lang}]" if message.lang else ""
        return f"error {message.code}: {message.message} ({message.stream_id} {message.seq}){lang}"
    mark = "FINAL" if message.is_final else "     "
    tail = message.unstable_text
    source = message.source_text or ""
    if color:
        tail = f"\x1b[2;3m{tail}\x1b[0m" if tail else ""
        source = f"\x1b[2m{source}\x1b[0m" if source else ""
    elif tail or not message.is_final:  # a final has no tentative tail
        tail = f"[{tail}]"
    lang = f"{message.lang:<3}" if message.lang else "-  "
    heard = f"  <- {source}" if source else ""
    return (
        f"{mark} {message.stream_id}#{message.segment_id} seq {message.seq:>4} "
        f"{message.latency_ms:6.0f} ms  {lang} {message.stable_text}{tail}{heard}"
    )


def waiting_note(url: str, failure: Exception, wait: float) -> str:
    """What the replay says at once when no server answers its first connection."""
    return (
        f"no server answers at {url} yet ({failure}); waiting up to {wait:g} s for one "
        "(start it: nmt-incremental serve --model fixture)"
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


def summary(result: ReplayResult) -> str:
    """The line printed at the end of a replay."""
    why = f" ({'; '.join(result.disconnects)})" if result.disconnects else ""
    gave_up = ", then gave up" if result.gave_up else ""
    return (
        f"sent {result.sent} partials, got {len(result.updates)} updates, "
        f"{len(result.errors)} errors; latency p50 {percentile(result.client_ms, 50):.0f} ms, "
        f"p95 {percentile(result.client_ms, 95):.0f} ms (client-measured); "
        f"finals {len(result.finals_received)}/"
        f"{len(result.finals_expected) * max(len(result.languages), 1)} translated "
        f"({len(result.languages) or 1} language(s)), "
        f"{len(result.finals_refused)} refused with an error, {len(result.lost_finals)} "
        f"without a reply; {len(result.disconnects)} connection(s) lost{why}, "
        f"{result.reconnects} reconnect(s){gave_up}, {result.resent} final(s) resent, "
        f"{result.duplicates} duplicate update(s) dropped, {result.skipped} late partial(s) "
        "skipped"
    )
