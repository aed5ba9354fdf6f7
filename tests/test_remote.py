"""`RemoteTranslator` (engine/remote.py): the `NmtIncremental` API over a server's WebSocket,
keeping each final until answered across lost connections.

First against tiny fake servers (websockets on 127.0.0.1:0) that misbehave on cue: close
with 1012 after a final without answering it, answer it `unavailable`, drop the connection,
answer twice, vanish. Then against a real `SubtitleServer` with the fixture model, through a
TCP proxy standing in for a load balancer (cut mid-talk), and restarted on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import pytest
from anyio.abc import TaskStatus
from websockets.asyncio.server import ServerConnection, serve

import protocol
from engine.decoding.translator import Translator
from engine.remote import RemoteTranslator
from protocol import (
    Backoff,
    EngineClosed,
    ErrorCode,
    ErrorMessage,
    InvalidEvent,
    NmtIncremental,
    PartialTranscript,
    TranslationUpdate,
)
from tests.conftest import wait_for
from tests.live_server import STREAMING, serving

Reply = TranslationUpdate | ErrorMessage
QUICK = Backoff(first=0.02, most=0.1, total=5.0)


def partial(
    seq: int, text: str = "I will", segment: int = 0, stream: str = "s"
) -> PartialTranscript:
    return PartialTranscript(stream, segment, seq, text, False)


def final(
    seq: int, text: str = "I will go", segment: int = 0, stream: str = "s"
) -> PartialTranscript:
    return PartialTranscript(stream, segment, seq, text, True)


def finals_of(replies: list[Reply]) -> list[tuple[int, str | None]]:
    """(seq, language) of each final update, in the order received."""
    return [(r.seq, r.lang) for r in replies if isinstance(r, TranslationUpdate) and r.is_final]


async def collect(sub: AsyncIterator[Reply], into: list[Reply]) -> None:
    async for reply in sub:
        into.append(reply)


# --- a fake server ------------------------------------------------------------------------

Behaviour = Callable[["Fake", ServerConnection, int, PartialTranscript], Awaitable[bool]]
"""What a fake does with an event on its connection number n (from 0); False: it answers
nothing more on that connection (it closed or dropped it)."""


@dataclass
class Fake:
    behaviour: Behaviour
    langs: tuple[str | None, ...] = (None,)
    received: list[list[PartialTranscript]] = field(default_factory=list)  # per connection
    closes: list[list[str]] = field(default_factory=list)
    everything: list[list[protocol.Message]] = field(default_factory=list)  # per connection
    port: int = 0

    async def handler(self, ws: ServerConnection) -> None:
        n = len(self.received)
        self.received.append([])
        self.closes.append([])
        self.everything.append([])
        async for data in ws:
            message = protocol.parse(data)
            self.everything[n].append(message)
            if isinstance(message, protocol.CloseStream):
                self.closes[n].append(message.stream_id)
            if not isinstance(message, PartialTranscript):
                continue
            self.received[n].append(message)
            if not await self.behaviour(self, ws, n, message):
                return

    async def answer(self, ws: ServerConnection, event: PartialTranscript) -> None:
        for lang in self.langs:
            await ws.send(protocol.serialize(reply_to(event, lang)))

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"


def reply_to(event: PartialTranscript, lang: str | None = None) -> TranslationUpdate:
    text = f"<{event.text}>"
    return TranslationUpdate(
        event.stream_id,
        event.segment_id,
        event.seq,
        text if event.is_final else "",
        "" if event.is_final else text,
        event.is_final,
        1.0,
        1.0,
        source_text=event.text,
        lang=lang,
    )


@contextlib.asynccontextmanager
async def fake_server(
    behaviour: Behaviour, langs: tuple[str | None, ...] = (None,)
) -> AsyncIterator[Fake]:
    fake = Fake(behaviour, langs)
    async with serve(fake.handler, "127.0.0.1", 0) as server:
        fake.port = server.sockets[0].getsockname()[1]
        yield fake


def on_first_final(
    first: Callable[[ServerConnection, PartialTranscript], Awaitable[None]],
) -> Behaviour:
    """Connection 0 meets its first final with `first` (and stops answering); every other
    event, and every later connection, is answered."""

    async def behaviour(fake: Fake, ws: ServerConnection, n: int, event: PartialTranscript) -> bool:
        if n == 0 and event.is_final:
            await first(ws, event)
            return False
        await fake.answer(ws, event)
        return True

    return behaviour


async def talk(
    nmt: RemoteTranslator, events: list[PartialTranscript], stream: str = "s"
) -> list[Reply]:
    """Push `events`, close the stream, return every reply its subscription yielded."""
    replies: list[Reply] = []
    sub = nmt.updates(stream)
    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, sub, replies)
        for event in events:
            await nmt.push(event)
            await anyio.sleep(0.01)
        await nmt.close_stream(stream)
        with anyio.fail_after(20):
            while stream in nmt.streams:
                await anyio.sleep(0.01)
    return replies


@pytest.mark.anyio
async def test_a_final_met_with_close_1012_is_resent_and_answered_once() -> None:
    async def restart(ws: ServerConnection, event: PartialTranscript) -> None:
        await ws.close(1012, "service restart")

    async with (
        fake_server(on_first_final(restart)) as fake,
        RemoteTranslator(fake.url, backoff=QUICK) as nmt,
    ):
        assert isinstance(nmt, NmtIncremental)
        events = [partial(0), final(1), partial(2, "Tom", 1), final(3, "Tom reads", 1)]
        replies = await talk(nmt, events)
        stats = nmt.stats
    assert finals_of(replies) == [(1, None), (3, None)]
    assert [r.text for r in replies if isinstance(r, TranslationUpdate) and r.is_final] == [
        "<I will go>",
        "<Tom reads>",
    ]
    assert not [r for r in replies if isinstance(r, ErrorMessage)]
    # The second connection got the final again first, ids and text as sent.
    assert fake.received[0] == [partial(0), final(1)]
    assert fake.received[1][0] == final(1)
    assert stats.disconnects == ["close 1012 service restart"]
    assert (stats.reconnects, stats.resent, stats.duplicates) == (1, 1, 0)


@pytest.mark.anyio
async def test_a_streams_glossary_goes_again_ahead_of_the_resends() -> None:
    async def restart(ws: ServerConnection, event: PartialTranscript) -> None:
        await ws.close(1012, "service restart")

    glossary = protocol.SetGlossary("s", "en\tzh\nTom\t爱丽丝\n")
    async with (
        fake_server(on_first_final(restart)) as fake,
        RemoteTranslator(fake.url, backoff=QUICK) as nmt,
    ):
        with pytest.raises(InvalidEvent) as too_large:
            await nmt.set_glossary("s", "en\tzh\n" + "x\ty\n" * 1001)
        await nmt.set_glossary("s", glossary.glossary)
        replies = await talk(nmt, [partial(0), final(1)])
    assert too_large.value.error.code == "too_large"
    assert finals_of(replies) == [(1, None)]
    assert fake.everything[0] == [glossary, partial(0), final(1)]
    assert fake.everything[1][:2] == [glossary, final(1)]  # the glossary first, then the resend


@pytest.mark.anyio
async def test_an_unavailable_error_about_a_final_moves_to_another_connection() -> None:
    async def lost_store(ws: ServerConnection, event: PartialTranscript) -> None:
        error = ErrorMessage(
            ErrorCode.UNAVAILABLE,
            "the shared store is unreachable",
            None,
            event.stream_id,
            event.seq,
        )
        await ws.send(protocol.serialize(error))

    async with (
        fake_server(on_first_final(lost_store)) as fake,
        RemoteTranslator(fake.url, backoff=QUICK) as nmt,
    ):
        replies = await talk(nmt, [partial(0), final(1)])
        stats = nmt.stats
    # The `unavailable` error was the node's business: never shown, the final answered once.
    assert replies[-1] == reply_to(final(1))
    assert finals_of(replies) == [(1, None)] and not any(
        isinstance(r, ErrorMessage) for r in replies
    )
    assert stats.disconnects == ["unavailable: the shared store is unreachable"]
    assert (stats.reconnects, stats.resent) == (1, 1)


@pytest.mark.anyio
async def test_a_final_dropped_for_the_rate_is_sent_again_and_the_pace_halved() -> None:
    """`rate_limited` about a final: the server did not take it, so it is no answer. The
    translator halves its pace, sends the final again on a new connection (on this one
    the next segment's partial was taken already), and shows no error."""

    async def too_fast(fake: Fake, ws: ServerConnection, n: int, event: PartialTranscript) -> bool:
        if n == 0 and event.is_final:
            error = ErrorMessage(
                ErrorCode.RATE_LIMITED, "more than 5 messages per second", None, "s", event.seq
            )
            await ws.send(protocol.serialize(error))
            return True
        await fake.answer(ws, event)
        return True

    async with (
        fake_server(too_fast) as fake,
        RemoteTranslator(fake.url, backoff=QUICK, rate=20.0) as nmt,
    ):
        replies = await talk(nmt, [partial(0), final(1), partial(2, "Tom", 1)])
        stats = nmt.stats
        assert nmt._pacer is not None and nmt._pacer.rate == 10.0
    assert finals_of(replies) == [(1, None)]
    assert not [r for r in replies if isinstance(r, ErrorMessage)]
    assert fake.received[1][0] == final(1)
    assert stats.rate_limited == 1 and stats.reconnects == 1 and stats.resent == 1
    assert stats.disconnects == ["rate_limited: more than 5 messages per second"]


@pytest.mark.anyio
async def test_a_burst_of_partials_is_paced_latest_wins_and_finals_kept() -> None:
    async def answer(fake: Fake, ws: ServerConnection, n: int, event: PartialTranscript) -> bool:
        await fake.answer(ws, event)
        return True

    burst = [partial(seq, f"I will {seq}") for seq in range(200)]
    async with fake_server(answer) as fake, RemoteTranslator(fake.url, rate=10.0) as nmt:
        for event in burst[:100]:
            await nmt.push(event)
        await nmt.push(final(100))
        for event in burst[101:]:
            await nmt.push(PartialTranscript("s", 1, event.seq, event.text, False))
        with anyio.fail_after(10):
            while not fake.received or fake.received[0][-1].seq != 199:
                await anyio.sleep(0.01)
        stats = nmt.stats
    got = [e.seq for e in fake.received[0]]
    assert got[:10] == list(range(10))  # the burst allowance
    assert 100 in got and got[-1] == 199  # the final, and the latest partial, went
    assert got == sorted(got) and len(got) < 20
    assert stats.coalesced == 200 - len(got) and stats.dropped_partials == 0


@pytest.mark.anyio
async def test_a_dropped_connection_without_a_close_frame() -> None:
    async def die(ws: ServerConnection, event: PartialTranscript) -> None:
        ws.transport.abort()  # kill -9: no close frame

    async with (
        fake_server(on_first_final(die)) as fake,
        RemoteTranslator(fake.url, backoff=QUICK) as nmt,
    ):
        replies = await talk(nmt, [final(0, "Tom", 0), final(1, "Lucy", 1)])
        stats = nmt.stats
    assert finals_of(replies) == [(0, None), (1, None)]
    assert stats.disconnects == ["connection dropped"] and stats.resent == 1


@pytest.mark.anyio
async def test_a_close_goes_only_where_the_stream_is_open() -> None:
    """After a reconnect, a stream that had nothing to resend is not open on the new
    connection (the server closed it when the old one ended): closing it sends nothing,
    which would only earn an `unknown_stream` error. A stream reopened by a resend is
    closed there."""

    async def restart(ws: ServerConnection, event: PartialTranscript) -> None:
        await ws.close(1012, "service restart")

    async with (
        fake_server(on_first_final(restart)) as fake,
        RemoteTranslator(fake.url, backoff=QUICK) as nmt,
    ):
        await nmt.push(partial(0, stream="b"))
        await nmt.close_stream("b")  # open here: closed
        await nmt.push(partial(1, stream="c"))
        await nmt.push(final(0, stream="a"))
        with anyio.fail_after(10):
            while nmt.ledger.pending:
                await anyio.sleep(0.01)
        await nmt.close_stream("c")  # opened on the first connection only: nothing sent
        await nmt.close_stream("a")  # reopened by its resend: closed
        with anyio.fail_after(10):
            while len(fake.closes[1]) < 1:
                await anyio.sleep(0.01)
    assert fake.closes == [["b"], ["a"]]
    assert nmt.stats.reconnects == 1


@pytest.mark.anyio
async def test_fan_out_duplicates_after_a_resend_are_dropped() -> None:
    """The first node answered zh, then drained before de; the next answers both (zh
    from its history): the writer shows zh once and de once."""

    async def half(ws: ServerConnection, event: PartialTranscript) -> None:
        await ws.send(protocol.serialize(reply_to(event, "zh")))
        await ws.close(1012, "service restart")

    async with (
        fake_server(on_first_final(half), langs=("zh", "de")) as fake,
        RemoteTranslator(fake.url, backoff=QUICK) as nmt,
    ):
        # A partial first, so that both languages are known before the final.
        replies = await talk(nmt, [partial(0), final(1)])
        stats = nmt.stats
    assert finals_of(replies) == [(1, "zh"), (1, "de")]
    assert (stats.resent, stats.duplicates) == (1, 1)


@pytest.mark.anyio
async def test_refusals_arrive_as_errors_and_answer_their_final() -> None:
    async def refuse(fake: Fake, ws: ServerConnection, n: int, event: PartialTranscript) -> bool:
        if event.is_final:
            error = ErrorMessage(
                ErrorCode.OUT_OF_ORDER,
                "seq is not above the last",
                "seq",
                event.stream_id,
                event.seq,
            )
            await ws.send(protocol.serialize(error))
        return True

    async with fake_server(refuse) as fake, RemoteTranslator(fake.url, backoff=QUICK) as nmt:
        replies = await talk(nmt, [final(1)])
        with pytest.raises(InvalidEvent) as info:
            await nmt.close_stream("s")  # closed already
        assert info.value.error.code == "unknown_stream"
        with pytest.raises(InvalidEvent):
            await nmt.push("not an event")  # type: ignore[arg-type]
    assert [(r.code, r.seq) for r in replies if isinstance(r, ErrorMessage)] == [
        ("out_of_order", 1)
    ]
    assert nmt.ledger.pending == 0 and nmt.ledger.refused == 1
    with pytest.raises(EngineClosed):
        await nmt.push(final(2))


@pytest.mark.anyio
async def test_a_late_subscriber_starts_from_the_last_lines() -> None:
    async def answer(fake: Fake, ws: ServerConnection, n: int, event: PartialTranscript) -> bool:
        await ws.send(protocol.serialize(reply_to(event)))
        return True

    async with fake_server(answer) as fake, RemoteTranslator(fake.url, backoff=QUICK) as nmt:
        everything = nmt.updates()  # every stream of this writer
        for event in [final(0, "Tom", 0), partial(1, "Lucy", 1)]:
            await nmt.push(event)
        with anyio.fail_after(10):
            seen = [await everything.__anext__(), await everything.__anext__()]
        assert seen == [reply_to(final(0, "Tom", 0)), reply_to(partial(1, "Lucy", 1))]
        late = nmt.updates("s")
        await nmt.close_stream("s")
        with anyio.fail_after(10):
            got = [reply async for reply in late]
        assert got == seen
        await everything.aclose()
        assert [reply async for reply in everything] == []


@pytest.mark.anyio
async def test_an_outage_past_the_backoff_answers_what_is_owed_unavailable() -> None:
    """The service never comes back: the translator gives up, answers the owed final
    (every final gets one reply), ends the subscription, takes no more events."""

    async def vanish(fake: Fake, ws: ServerConnection, n: int, event: PartialTranscript) -> bool:
        if event.is_final:
            await ws.close(1012, "service restart")
            return False
        await ws.send(protocol.serialize(reply_to(event)))
        return True

    replies: list[Reply] = []
    async with contextlib.AsyncExitStack() as stack:
        async with fake_server(vanish) as fake:
            nmt = await stack.enter_async_context(
                RemoteTranslator(fake.url, backoff=Backoff(first=0.02, most=0.05, total=0.3))
            )
            sub = nmt.updates("s")
            await nmt.push(partial(0))
            await nmt.push(final(1))
            with anyio.fail_after(5):
                while not nmt.stats.disconnects:
                    await anyio.sleep(0.01)
        # The fake is gone: connecting is refused until the backoff's total runs out.
        with anyio.fail_after(10):
            await collect(sub, replies)
        with pytest.raises(EngineClosed):
            await nmt.push(partial(2))
    errors = [r for r in replies if isinstance(r, ErrorMessage)]
    assert [(e.code, e.seq) for e in errors] == [("unavailable", 1)]
    assert "could not be reached again" in errors[0].message


@pytest.mark.anyio
async def test_the_first_connection_failing_raises() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    nmt = RemoteTranslator(f"ws://127.0.0.1:{port}/ws", backoff=Backoff(0.01, 0.02, 0.1))
    with pytest.raises(OSError):
        async with nmt:
            pass
    with pytest.raises(EngineClosed):
        await nmt.push(partial(0))


# --- a real server ------------------------------------------------------------------------

SENTENCES = [
    "I will meet Tom at three",
    "Tom reads a book",
    "Does Tom draw a horse",
    "Peter will find a car",
]


def events_of(sentences: list[str], stream: str = "s1") -> list[list[PartialTranscript]]:
    """Per sentence: growing partials, then the final, with seq running over the talk."""
    seq = 0
    talk: list[list[PartialTranscript]] = []
    for segment, sentence in enumerate(sentences):
        words = sentence.split()
        events = []
        for n in range(1, len(words) + 1):
            text = " ".join(words[:n])
            events.append(PartialTranscript(stream, segment, seq, text, n == len(words)))
            seq += 1
        talk.append(events)
    return talk


class Proxy:
    """A TCP forwarder in front of the server, standing in for a load balancer: `cut()`
    drops every connection at once, as a node killed with -9 (no close frame); `hold()`
    stops passing the server's bytes on, so what it sends until the cut is lost."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.port = 0
        self.holding = False
        self.connections = 0
        self._transports: list[asyncio.WriteTransport] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def hold(self) -> None:
        self.holding = True

    def cut(self) -> None:
        for transport in self._transports:
            transport.abort()
        self._transports.clear()
        self.holding = False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        self._transports += [writer.transport, up_writer.transport]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, down: bool) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    if down and self.holding:
                        continue
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer, False), pump(up_reader, writer, True))


def offline(translator: Translator, sentences: list[str]) -> list[str]:
    return [r.text for r in translator.translate(sentences, STREAMING.decode)]


def exactly_once(replies: list[Reply], talk: list[list[PartialTranscript]]) -> list[str]:
    """Each final of the talk answered by exactly one final update (no error); returns
    their texts in order."""
    finals = [events[-1].seq for events in talk]
    got = [r for r in replies if isinstance(r, TranslationUpdate) and r.is_final]
    assert [r.seq for r in got] == finals
    assert not [r for r in replies if isinstance(r, ErrorMessage)]
    return [r.stable_text for r in got]


@pytest.mark.anyio
async def test_a_node_cut_mid_talk_every_final_answered_exactly_once(
    translator: Translator,
) -> None:
    """Two cuts: after the server translated a final whose update never reached the
    writer (the resend is answered from the stream's history, not translated again), and
    right after a final left the writer (in flight: answered once, whichever way)."""
    talk = events_of(SENTENCES)
    replies: list[Reply] = []
    async with (
        serving(translator) as server,
        Proxy(server.port) as proxy,
        RemoteTranslator(proxy.url, backoff=QUICK) as nmt,
        anyio.create_task_group() as tg,
    ):
        engine = server.engine
        assert engine is not None
        tg.start_soon(collect, nmt.updates("s1"), replies)
        # Sentence 0: its final's update is held back, then the connection is cut.
        for event in talk[0][:-1]:
            await nmt.push(event)
        await wait_for(lambda: any(isinstance(r, TranslationUpdate) for r in replies))
        proxy.hold()
        await nmt.push(talk[0][-1])
        await wait_for(lambda: engine.stats["events"] == len(talk[0]))
        await engine.wait_idle("s1")
        proxy.cut()
        # Sentence 1 goes on as soon as it can (partials pushed during the reconnect
        # are dropped; its final is kept).
        for event in talk[1]:
            await nmt.push(event)
            await anyio.sleep(0.02)
        await wait_for(lambda: len(finals_of(replies)) == 2)
        # Sentence 2: cut while its final is in flight.
        for event in talk[2]:
            await nmt.push(event)
        proxy.cut()
        for event in talk[3]:
            await nmt.push(event)
            await anyio.sleep(0.02)
        await nmt.close_stream("s1")
        await wait_for(lambda: "s1" not in nmt.streams, timeout=30)
        stats = nmt.stats
        from_history = engine.stats["answered_from_history"]
    assert exactly_once(replies, talk) == offline(translator, SENTENCES)
    assert stats.reconnects == 2 and proxy.connections == 3
    assert stats.disconnects == ["connection dropped", "connection dropped"]
    assert stats.resent >= 1 and from_history >= 1


async def serve_until(
    translator: Translator,
    port: int,
    stop: anyio.Event,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """A server on `port` until `stop` (in a task of its own, so that its lifetime need
    not nest with the client's)."""
    async with serving(translator, port=port):
        task_status.started()
        await stop.wait()


@pytest.mark.anyio
async def test_a_server_restarted_on_the_same_port_gets_what_is_owed(
    translator: Translator,
) -> None:
    """A single server stops (close 1001) and a new one starts on its port; a final
    pushed meanwhile is kept and sent to the new one."""
    talk = events_of(SENTENCES[:2])
    replies: list[Reply] = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first, second = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(serve_until, translator, port, first)
        async with RemoteTranslator(
            f"ws://127.0.0.1:{port}/ws", backoff=Backoff(0.05, 0.2, 30.0)
        ) as nmt:
            tg.start_soon(collect, nmt.updates("s1"), replies)
            for event in talk[0]:
                await nmt.push(event)
            await wait_for(lambda: len(finals_of(replies)) == 1)
            first.set()  # the server stops
            await wait_for(lambda: bool(nmt.stats.disconnects))
            # Down: the translator is reconnecting; the next sentence's final is kept.
            for event in talk[1]:
                await nmt.push(event)
            assert nmt.ledger.pending == 1
            await tg.start(serve_until, translator, port, second)
            await wait_for(lambda: len(finals_of(replies)) == 2, timeout=30)
            await nmt.close_stream("s1")
        stats = nmt.stats
        second.set()
    assert exactly_once(replies, talk) == offline(translator, SENTENCES[:2])
    assert stats.disconnects[0].startswith("close 1001") and stats.reconnects == 1
    assert stats.dropped_partials == len(talk[1]) - 1
