"""`Bridge`: the I/O around a mapper. One connection to the recogniser, one to
`nmt-incremental serve` (through `RemoteTranslator`), and the events in between. The
connections themselves (opening, reading, relaying) are `transport`'s; what each kind
sends, and when a session starts and ends, is here.

Our side: `RemoteTranslator` is the writer. It keeps each final until the server has
answered it and resends the unanswered ones after a reconnect (`protocol/writer.py`), so a
final the bridge pushed is answered once, by a translation or an error, or, if our server
stays away longer than `reconnect_for`, by an `unavailable` error: never silently lost.

The recogniser's side, in one of two modes:

- connect (`url` and `audio`; or `url` alone for `cloud`): the bridge is the recogniser's
  client. It streams the audio (WhisperLive, Vosk, whisper_streaming want it from their
  client) or, for `cloud`, reads a forwarder's WebSocket. When the connection is lost
  before the input is over, the recogniser's session is gone with its segmentation: the
  mapper closes the interrupted segment (`Interrupted`), and the bridge reconnects with
  `Backoff` (bounded: it gives up after `reconnect_for` seconds, and says so), then goes on
  with the audio where it was, on the same stream, with the next segment id. A session
  that ends within `short_session` seconds does not end the outage (a recogniser that
  answers, then closes at once, is failing too), `max_short_sessions` of them in a row
  give up, and once the audio is over no new session is opened.
- listen (`listen`): the user's own client (a microphone app, WhisperLive's or Vosk's
  client, `arecord | nc`) connects to the bridge instead of the recogniser, and the bridge
  relays its session both ways, unchanged, while mapping what the recogniser answers. None
  of these servers lets a second client listen to another's session (WhisperLive and Vosk
  make one recogniser per connection, whisper_streaming serves one client at a time), so
  relaying is the only way to watch a session the bridge does not feed. For `cloud`, the
  forwarder connects to the bridge and sends its JSON lines. One session at a time: the
  stream has one writer; a second client is refused (WebSocket close 1013, or the TCP
  connection closed) until the first leaves. Each new session is a new recogniser session.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import anyio
from anyio.abc import SocketAttribute, SocketStream
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from engine.bridges import vosk, whisperlive
from engine.bridges.audio import AudioSource
from engine.bridges.errors import BridgeError
from engine.bridges.kinds import Kind, Mapper, make_mapper
from engine.bridges.options import BridgeOptions, BridgeResult, Reply
from engine.bridges.transport import (
    MAX_MESSAGE,
    Link,
    close_reason,
    open_tcp,
    open_ws,
    tcp_address,
)
from engine.errors import unwrapped
from engine.remote import RemoteTranslator
from protocol import EngineClosed, PartialTranscript

logger = logging.getLogger(__name__)

WHISPER_STREAMING_CHUNK = 1600  # samples: 0.1 s, what arecord's pipe brings about


class _OurServerGone(Exception):
    """`RemoteTranslator` gave up on our server: nothing more can be pushed."""


class Bridge:
    """Runs one bridge (`run`). `on_reply` hears each update or error for the stream;
    `on_notice` a line about each recogniser connection event; `on_listening` the port a
    `listen` bridge took (useful with port 0)."""

    def __init__(
        self,
        options: BridgeOptions,
        *,
        on_reply: Callable[[Reply], None] | None = None,
        on_notice: Callable[[str], None] | None = None,
        on_listening: Callable[[int], None] | None = None,
    ) -> None:
        self.options = options
        self.mapper: Mapper = make_mapper(options.kind, options.stream_id, options.mapper_options())
        self.result = BridgeResult()
        self._on_reply = on_reply or (lambda _: None)
        self._notice = on_notice or (lambda line: logger.info("%s", line))
        self._on_listening = on_listening or (lambda _: None)
        self._nmt: RemoteTranslator | None = None
        self._unsent: list[PartialTranscript] = []  # finals stopped before `push` took them
        self._busy = False  # a relayed session is on (listen mode: one at a time)
        self._gone = anyio.Event()  # our server was given up: nothing can be pushed
        self._replies_ended = anyio.Event()  # the stream's subscription is over
        self._link = Link(self._feed, self._idle, options.idle, options.end_wait)
        if options.kind is Kind.WHISPER_STREAMING and options.url is not None:
            tcp_address(options.url)  # a bad address fails before anything connects

    @property
    def relaying(self) -> bool:
        """A relayed (listen mode) session is on: another client would be refused."""
        return self._busy

    # -- the run ------------------------------------------------------------------------

    async def run(self, stop: anyio.Event | None = None) -> BridgeResult:
        """Bridge until the input ends (connect mode: the audio is over and the recogniser
        closed; a cloud forwarder closed with 1000) or `stop` is set, then close the
        stream and wait (up to `drain_timeout`) for its finals to be answered. Raises
        `BridgeError` when the recogniser cannot be reached at all, and our server's
        connection error when it cannot."""
        options = self.options
        stop = stop or anyio.Event()
        audio = (
            AudioSource(
                options.audio,
                rate=None if options.kind is Kind.VOSK else 16000,
                speed=options.speed,
                raw_rate=options.audio_rate,
            )
            if options.audio is not None
            else None
        )
        try:
            with unwrapped():
                await self._run(audio, stop)
        finally:
            self._nmt = None
            if audio is not None:
                audio.close()
        return self.result

    async def _run(self, audio: AudioSource | None, stop: anyio.Event) -> None:
        options = self.options
        async with RemoteTranslator(
            options.to,
            options.token,
            reconnect_for=options.reconnect_for,
            rate=options.rate,
            drain_timeout=options.drain_timeout,
        ) as nmt:
            self._nmt = nmt
            sub = nmt.updates(options.stream_id)
            if options.glossary is not None:
                await nmt.set_glossary(options.stream_id, options.glossary)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._collect, sub)
                    with anyio.CancelScope() as finishing:
                        tg.start_soon(self._stop_in_time, stop, finishing, nmt)
                        try:
                            with unwrapped():
                                await self._bridge(audio, stop)
                            await self._push(self.mapper.end_session())
                        except _OurServerGone:
                            pass
                        if self._gone.is_set():
                            self.result.gave_up = "our server could not be reached again"
                        await self._drain(nmt)
                    tg.cancel_scope.cancel()
            finally:  # cancelled too (a second Ctrl-C): what was never answered is known
                self.result.unanswered = nmt.ledger.owed(options.stream_id) + self._unsent

    async def _stop_in_time(
        self, stop: anyio.Event, finishing: anyio.CancelScope, nmt: RemoteTranslator
    ) -> None:
        """Once `stop` is set, give closing the stream `stop_timeout` seconds, then stop
        waiting: a server that keeps answering `rate_limited` or cannot be reached would
        otherwise hold the bridge for `drain_timeout` and `reconnect_for`."""
        await stop.wait()
        await anyio.sleep(self.options.stop_timeout)
        finishing.cancel()
        nmt.abandon("the bridge was stopped before this final was answered")

    async def _bridge(self, audio: AudioSource | None, stop: anyio.Event) -> None:
        async with anyio.create_task_group() as tg:

            async def watch(event: anyio.Event) -> None:
                await event.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(watch, stop)
            tg.start_soon(watch, self._gone)  # relayed sessions run in the servers' tasks
            if self.options.listen is not None:
                await self._listen(*self.options.listen)
            else:
                await self._connect_loop(audio)
            tg.cancel_scope.cancel()

    async def _drain(self, nmt: RemoteTranslator) -> None:
        stream_id = self.options.stream_id
        if not self.result.events or stream_id not in nmt.streams:
            return
        with contextlib.suppress(EngineClosed):
            await nmt.close_stream(stream_id)
        with anyio.move_on_after(self.options.drain_timeout):
            while stream_id in nmt.streams and not self._replies_ended.is_set():
                await anyio.sleep(0.02)
        self.result.unanswered = nmt.ledger.owed(stream_id)

    async def _collect(self, sub: AsyncIterator[Reply]) -> None:
        """Every reply about the stream, until its subscription ends: its finals are all
        answered after the close, or `RemoteTranslator` gave up (and answered each final
        still owed with an `unavailable` error)."""
        async for reply in sub:
            self.result.replies.append(reply)
            self._on_reply(reply)
        self._replies_ended.set()

    async def _push(self, events: list[PartialTranscript]) -> None:
        nmt = self._nmt
        if nmt is None:
            return
        for n, event in enumerate(events):
            try:
                await nmt.push(event)
            except EngineClosed:
                self._gone.set()
                self._unsent += [e for e in events[n:] if e.is_final]
                raise _OurServerGone from None
            except anyio.get_cancelled_exc_class():
                self._unsent += [e for e in events[n:] if e.is_final]  # never sent
                raise
            self.result.events.append(event)

    async def _feed(self, message: str | bytes) -> bool:
        """Map and push one message; whether it meant something (an event, or WhisperLive
        getting ready): a session that only ever said "wait" does not end an outage."""
        events = self.mapper.feed(message)
        await self._push(events)
        return bool(events) or getattr(self.mapper, "ready", False) is True

    async def _idle(self) -> None:
        await self._push(self.mapper.idle())

    async def _session_ended(self, why: str, next_offset_ms: float | None) -> None:
        """A recogniser session ended before the input did: close what it left open."""
        self.result.disconnects.append(why)
        self._notice(f"recogniser session ended: {why}")
        await self._push(self.mapper.end_session(next_offset_ms))

    # -- connect mode -------------------------------------------------------------------

    async def _connect_loop(self, audio: AudioSource | None) -> None:
        options = self.options
        backoff = options.recogniser_backoff
        outage = time.monotonic()
        attempt = 0
        short = 0  # sessions in a row that ended within `short_session` seconds
        while True:
            began = time.monotonic()
            try:
                over, why, heard = await self._one_session(audio)
            except (OSError, InvalidHandshake, TimeoutError) as exc:
                if self.result.sessions == 0:
                    raise BridgeError(
                        f"cannot reach the {options.kind} server at {options.url}: {exc}"
                    ) from None
                attempt += 1
                if backoff.gives_up(time.monotonic() - outage, attempt):
                    self.result.gave_up = (
                        f"the {options.kind} server could not be reached again for "
                        f"{backoff.total:g} s ({exc})"
                    )
                    self._notice(self.result.gave_up)
                    return
                await anyio.sleep(backoff.jittered(attempt))
                continue
            if over:
                return
            await self._session_ended(why, audio.position_ms if audio is not None else None)
            if audio is not None and audio.ended:
                return  # the input is over: a new session would have nothing to hear
            short = short + 1 if time.monotonic() - began < options.short_session else 0
            if heard and not short:
                outage, attempt = time.monotonic(), 0
            else:
                attempt += 1  # that session never got going: the same outage goes on
            if short >= options.max_short_sessions:
                self.result.gave_up = (
                    f"the {options.kind} server ended {short} sessions in a row within "
                    f"{options.short_session:g} s ({why})"
                )
                self._notice(self.result.gave_up)
                return
            if backoff.gives_up(time.monotonic() - outage, attempt):
                self.result.gave_up = f"the {options.kind} server kept failing ({why})"
                self._notice(self.result.gave_up)
                return
            await anyio.sleep(backoff.jittered(attempt))
            self._notice(f"reconnecting to {options.url}")

    async def _one_session(self, audio: AudioSource | None) -> tuple[bool, str, bool]:
        """One recogniser connection: (the input is over, why it ended, the recogniser
        answered something)."""
        kind = self.options.kind
        if kind is Kind.WHISPER_STREAMING:
            return await self._tcp_session(audio)
        url = str(self.options.url)
        ws = await open_ws(url, close_timeout=2.0)
        self.result.sessions += 1
        heard = [False]
        async with ws:
            if kind is Kind.WHISPERLIVE:
                over = await self._whisperlive(ws, audio, heard)
            elif kind is Kind.VOSK:
                over = await self._vosk(ws, audio, heard)
            else:
                over = await self._forwarder(ws, heard)
        return over, close_reason(ws), heard[0]

    async def _whisperlive(
        self, ws: ClientConnection, audio: AudioSource | None, heard: list[bool]
    ) -> bool:
        mapper = self.mapper
        assert isinstance(mapper, whisperlive.WhisperLiveMapper) and audio is not None
        uid = whisperlive.new_uid()
        mapper.uid = uid
        await ws.send(
            whisperlive.config_message(uid, lang=self.options.lang, model=self.options.model)
        )

        async def send(last: list[float], closed: anyio.Event) -> bool:
            with anyio.move_on_after(self.options.ready_timeout):
                while not mapper.ready and not closed.is_set():
                    await anyio.sleep(0.02)
            if not mapper.ready:
                status = f": {mapper.status[0]} {mapper.status[1]}" if mapper.status else ""
                self._notice(f"WhisperLive did not get ready{status}")
                await ws.close()
                return False
            async for chunk in audio.chunks(whisperlive.CHUNK_SAMPLES):
                await ws.send(whisperlive.float32_audio(chunk))
            await self._link.quiet(last)
            await ws.send(whisperlive.END_OF_AUDIO)
            return True

        return await self._link.duplex(ws, heard, send)

    async def _vosk(
        self, ws: ClientConnection, audio: AudioSource | None, heard: list[bool]
    ) -> bool:
        assert audio is not None
        await ws.send(vosk.config_message(audio.sample_rate))

        async def send(last: list[float], closed: anyio.Event) -> bool:
            samples = round(audio.sample_rate * vosk.CHUNK_SECONDS)
            async for chunk in audio.chunks(samples):
                await ws.send(chunk)
            await ws.send(vosk.EOF_MESSAGE)  # answered by the final result, then closed
            return True

        return await self._link.duplex(ws, heard, send)

    async def _forwarder(self, ws: ClientConnection, heard: list[bool]) -> bool:
        """A cloud forwarder's results, until it closes: 1000 means its input is over."""
        await self._link.receive(ws, heard, [0.0])
        return ws.close_code == 1000

    async def _tcp_session(self, audio: AudioSource | None) -> tuple[bool, str, bool]:
        assert audio is not None
        stream = await open_tcp(str(self.options.url))
        self.result.sessions += 1
        heard = [False]
        over = False
        async with stream, anyio.create_task_group() as tg:

            async def sending() -> None:
                nonlocal over
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    async for chunk in audio.chunks(WHISPER_STREAMING_CHUNK):
                        await stream.send(chunk)
                    await stream.send_eof()  # the server finishes and closes
                    over = True

            tg.start_soon(sending)
            why = await self._link.tcp_lines(stream, heard)
            if not over:
                tg.cancel_scope.cancel()
        return over, why, heard[0]

    # -- listen mode --------------------------------------------------------------------

    async def _listen(self, host: str, port: int) -> None:
        if self.options.kind is Kind.WHISPER_STREAMING:
            listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
            async with listener:
                self._listening(host, listener.extra(SocketAttribute.local_port), "tcp")
                await listener.serve(self._relay_tcp)
            return
        handler = self._relay_ws if self.options.kind.wants_audio else self._forwarded
        async with serve(handler, host, port, max_size=MAX_MESSAGE) as server:
            self._listening(host, server.sockets[0].getsockname()[1], "ws")
            await anyio.sleep_forever()

    def _listening(self, host: str, port: int, scheme: str) -> None:
        self._on_listening(port)
        what = "the forwarder" if self.options.kind is Kind.CLOUD else "your recogniser client"
        self._notice(f"listening on {scheme}://{host}:{port}: point {what} here")

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self) -> AsyncIterator[bool]:
        """Yields False when a session is on already (the caller refuses this one)."""
        if self._busy:
            yield False
            return
        self._busy = True
        self.result.sessions += 1
        try:
            yield True
        finally:
            self._busy = False

    async def _forwarded(self, client: ServerConnection) -> None:
        async with self._one_at_a_time() as mine, _ended_by_our_server():
            if not mine:
                await client.close(1013, "the bridge takes one forwarder at a time")
                return
            with contextlib.suppress(ConnectionClosed):
                async for message in client:
                    await self._feed(message)
            await self._session_ended(close_reason(client), None)

    async def _relay_ws(self, client: ServerConnection) -> None:
        async with self._one_at_a_time() as mine, _ended_by_our_server():
            if not mine:
                await client.close(1013, "the bridge relays one session at a time")
                return
            try:
                upstream = await open_ws(str(self.options.url))
            except (OSError, InvalidHandshake, TimeoutError) as exc:
                self._notice(f"cannot reach the {self.options.kind} server: {exc}")
                await client.close(1011, "the recogniser cannot be reached")
                return
            if isinstance(self.mapper, whisperlive.WhisperLiveMapper):
                self.mapper.uid = None  # the client chose it
            await self._link.relay_ws(client, upstream)
            await client.close()
            await self._session_ended(close_reason(upstream), None)

    async def _relay_tcp(self, client: SocketStream) -> None:
        async with self._one_at_a_time() as mine, _ended_by_our_server():
            if not mine:
                await client.aclose()
                return
            try:
                upstream = await open_tcp(str(self.options.url))
            except (OSError, TimeoutError) as exc:
                self._notice(f"cannot reach the whisper_streaming server: {exc}")
                await client.aclose()
                return
            why = await self._link.relay_tcp(client, upstream)
            await self._session_ended(why, None)


@contextlib.asynccontextmanager
async def _ended_by_our_server() -> AsyncIterator[None]:
    """A relayed session's handler runs in its server's task, not the bridge's: when our
    server is given up it just ends (`Bridge._gone` stops the bridge)."""
    with contextlib.suppress(_OurServerGone), unwrapped():
        yield
