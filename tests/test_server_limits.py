"""The server at its limits: what an attacker, a confused proxy or a crowd sends gets a
clear answer (a refusal, an error, a final), never a 500, a lost final or a held slot.

Duplicate Authorization, Origin or Accept headers are refused by name with a 400: the
server never lets websockets' MultipleValuesError become a 500 and a traceback."""

from __future__ import annotations

import json

import anyio
import pytest

from engine.decoding.translator import Translator
from engine.server.handshake import SINGLE_HEADERS, duplicate_headers
from tests.conftest import slow_decodes
from tests.live_server import serving


def test_duplicate_single_headers_are_refused_by_name() -> None:
    assert duplicate_headers({name: 1 for name in SINGLE_HEADERS}) is None
    assert duplicate_headers({}) is None
    refusal = duplicate_headers({"Authorization": 2, "Origin": 1, "Accept": 3})
    assert refusal is not None and refusal.status == 400
    assert "Authorization" in refusal.reason and "Accept" in refusal.reason
    assert "Origin" not in refusal.reason


async def raw_request(port: int, head: str) -> str:
    """Send a hand-written HTTP request (duplicate headers included) and read the reply."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(head.replace("\n", "\r\n").encode() + b"\r\n")
        data = b""
        with anyio.fail_after(10):
            while b"\r\n\r\n" not in data:
                data += await stream.receive()
    return data.decode("latin-1")


UPGRADE = (
    "GET /ws HTTP/1.1\nHost: 127.0.0.1\nUpgrade: websocket\nConnection: Upgrade\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\nSec-WebSocket-Version: 13\n"
)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("ws", "Authorization: Bearer a\nAuthorization: Bearer b\n"),
        ("ws", "Origin: http://a.example\nOrigin: http://b.example\n"),
        ("metrics", "Accept: text/plain\nAccept: application/openmetrics-text\n"),
    ],
)
async def test_duplicate_headers_get_400_not_500(
    translator: Translator, path: str, headers: str
) -> None:
    async with serving(translator, token="a") as server:
        head = UPGRADE if path == "ws" else "GET /metrics HTTP/1.1\nHost: 127.0.0.1\n"
        reply = await raw_request(server.port, head + headers)
        assert reply.startswith("HTTP/1.1 400"), reply
        assert "Duplicate" in reply
        # The server goes on serving everyone else.
        ok = await raw_request(server.port, "GET /healthz HTTP/1.1\nHost: 127.0.0.1\n")
        assert ok.startswith("HTTP/1.1 200"), ok


# -- a stream closing while partials arrive keeps no slot ----------------------------------
# A partial that arrives after the engine closed the stream but before the connection hears
# so must not open a new stream: nobody would own, close or watch it, and it would hold a
# --max-streams slot until restart.


@pytest.mark.anyio
async def test_partials_after_a_close_never_reopen_the_stream(translator: Translator) -> None:
    """A final, close_stream and partials for the same id at once, then gone: the engine
    refuses the partials (the stream is closing) and frees the slot once the final is
    answered; nothing is left open (tests/test_lifecycle.py has the rules alone)."""
    from websockets.asyncio.client import connect

    from tests.conftest import partial_message
    from tests.live_server import open_streams, ws_url

    async with serving(translator) as server:
        for _ in range(5):
            async with connect(ws_url(server)) as ws:
                await ws.send(partial_message("s", 0, "Tom reads a book", final=True))
                await ws.send('{"type": "close_stream", "stream_id": "s"}')
                for seq in range(1, 4):
                    await ws.send(partial_message("s", seq, "Tom reads"))
                finals = 0
                with anyio.fail_after(20):
                    while not finals:
                        reply = json.loads(await ws.recv())
                        finals += bool(reply.get("is_final")) and reply["seq"] == 0
                        # Refused as closing; or, if the close had finished already, a
                        # new stream of this connection's (closed again when it leaves).
                        assert reply.get("code") in (None, "unknown_stream"), reply
        with anyio.fail_after(10):
            while open_streams(server):
                await anyio.sleep(0.01)


# -- a final over the rate limit still gets an update or an error --------------------------


def test_error_replies_about_finals_are_never_shed() -> None:
    from engine.server.outbox import Outbox
    from protocol import ErrorMessage

    outbox = Outbox(max_updates=4, max_errors=2, max_kept_errors=3)
    assert outbox.put_error(ErrorMessage("rate_limited", "a"))
    assert outbox.put_error(ErrorMessage("rate_limited", "b"))
    assert not outbox.put_error(ErrorMessage("rate_limited", "c"))  # surplus: shed
    for seq in range(3):  # replies about finals still go in, up to their own bound
        assert outbox.put_error(ErrorMessage("rate_limited", "final", seq=seq), keep=True)
    assert not outbox.put_error(ErrorMessage("rate_limited", "final", seq=9), keep=True)
    assert (len(outbox), outbox.dropped_errors) == (5, 2)


def test_a_rate_limited_final_is_a_kept_reply() -> None:
    from engine.server.connection import ConnectionCore, Reply
    from engine.server.limits import Limits
    from engine.server.state import ServerState
    from tests.conftest import partial_message

    core = ConnectionCore(1, Limits(rate_limit=1.0, rate_burst=1.0), ServerState())
    core.receive(partial_message("s", 0), 0.0)
    partial = core.receive(partial_message("s", 1), 0.0)
    final = core.receive(partial_message("s", 2, "I will go", final=True), 0.0)
    assert isinstance(partial, Reply) and not partial.about_final
    assert isinstance(final, Reply) and final.about_final
    assert final.error.code == "rate_limited" and final.error.seq == 2


@pytest.mark.anyio
async def test_a_burst_ending_in_a_final_gets_a_reply_about_the_final(
    translator: Translator,
) -> None:
    """84 messages at once, over the rate limit, the last a final: the final's seq gets
    its final update or an error, whatever the burst did to the other replies."""
    import json

    from websockets.asyncio.client import connect

    from engine.server.limits import Limits
    from tests.conftest import partial_message
    from tests.live_server import ws_url

    for attempt in range(3):
        limits = Limits(rate_limit=20.0)
        async with serving(translator, limits=limits) as server, connect(ws_url(server)) as ws:
            burst = [partial_message("b", seq, "I will meet Tom") for seq in range(83)]
            burst.append(partial_message("b", 83, "I will meet Tom at three", final=True))
            for message in burst:
                await ws.send(message)
            with anyio.fail_after(20):
                while True:
                    reply = json.loads(await ws.recv())
                    if reply.get("seq") == 83:
                        break
        assert reply["type"] in ("translation_update", "error"), (attempt, reply)


# -- a final whose translation raises gets an `internal` error -----------------------------


@pytest.mark.anyio
async def test_a_final_that_fails_to_translate_gets_an_internal_error(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from websockets.asyncio.client import connect

    from engine.streaming.session import StreamSession
    from tests.conftest import partial_message
    from tests.live_server import ws_url

    real = StreamSession.steps  # what the engine runs, its decodes awaited

    def failing(self: StreamSession, event: object, *args: object, **kwargs: object) -> object:
        if getattr(event, "text", "") == "boom":
            raise RuntimeError("a bug in the engine")
        return real(self, event, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(StreamSession, "steps", failing)
    async with serving(translator) as server, connect(ws_url(server)) as ws:
        await ws.send(partial_message("f", 0, "boom", final=True))
        # The next segment (a final ends its segment).
        for seq, text, final in ((1, "I will meet Tom", False), (2, "I will go", True)):
            message = partial_message("f", seq, text, final=final)
            await ws.send(message.replace('"segment_id": 0', '"segment_id": 1'))
        replies = []
        with anyio.fail_after(20):
            while not any(r.get("seq") == 2 and r.get("is_final") for r in replies):
                replies.append(json.loads(await ws.recv()))
    about_first = [r for r in replies if r.get("seq") == 0]
    assert [(r["type"], r["code"]) for r in about_first] == [("error", "internal")]
    # The stream goes on: the next final is translated as usual.
    assert any(r["type"] == "translation_update" and r["is_final"] for r in replies)


# -- a shutdown past its timeout answers every final and raises nothing --------------------


@pytest.mark.anyio
async def test_shutdown_past_its_timeout_answers_every_final(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 writers x 6 finals, translations slowed to 50 ms each, shutdown timeout 0.2 s:
    most finals cannot be translated in time. Each still gets exactly one reply, an update
    or `unavailable`, and the shutdown raises nothing."""
    import json

    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from tests.conftest import partial_message
    from tests.live_server import ws_url

    slow_decodes(monkeypatch, 0.05)
    replies: dict[str, list[dict[str, object]]] = {}

    async def writer(server: object, name: str, ready: anyio.Event) -> None:
        async with connect(ws_url(server)) as ws:  # type: ignore[arg-type]
            for seg in range(6):
                text = "Tom will play tennis with Lucy at three tomorrow"
                message = partial_message(name, seg, text, final=True)
                await ws.send(message.replace('"segment_id": 0', f'"segment_id": {seg}'))
            ready.set()
            got = replies.setdefault(name, [])
            try:
                async for data in ws:
                    got.append(json.loads(data))
            except ConnectionClosed:
                pass

    async with (
        serving(translator, shutdown_timeout=0.2) as server,
        anyio.create_task_group() as tg,
    ):
        events = []
        for i in range(8):
            ready = anyio.Event()
            events.append(ready)
            tg.start_soon(writer, server, f"w{i}", ready)
        for ready in events:
            await ready.wait()
        await anyio.sleep(0.1)
        await server.shutdown()  # the writers' sockets close with 1001
    codes = []
    for name, got in replies.items():
        about = {}
        for reply in got:
            if reply["type"] == "error" or reply.get("is_final"):
                assert reply["seq"] not in about, (name, reply)  # exactly one reply
                about[reply["seq"]] = reply
        assert sorted(about) == list(range(6)), (name, got)
        codes += [r.get("code", "update") for r in about.values()]
    assert "unavailable" in codes and set(codes) <= {"update", "unavailable"}


# -- a stream at the largest seq can be closed and started again ---------------------------


@pytest.mark.anyio
async def test_a_stream_at_the_largest_seq_can_be_closed_and_started_again(
    translator: Translator,
) -> None:
    import json

    from websockets.asyncio.client import connect

    from protocol.messages import MAX_ID
    from tests.conftest import partial_message
    from tests.live_server import ws_url

    async with serving(translator) as server, connect(ws_url(server)) as ws:
        await ws.send(partial_message("m", MAX_ID, "I will"))
        await ws.send(partial_message("m", 5, "I will meet"))
        with anyio.fail_after(20):
            while (reply := json.loads(await ws.recv()))["type"] != "error":
                pass
        assert reply["code"] == "out_of_order" and "close_stream" in reply["message"]
        await ws.send('{"type": "close_stream", "stream_id": "m"}')
        engine = server.engine
        assert engine is not None
        with anyio.fail_after(10):
            while "m" in engine.streams:
                await anyio.sleep(0.01)
        await ws.send(partial_message("m", 0, "I will meet Tom at three", final=True))
        with anyio.fail_after(20):
            while not (reply := json.loads(await ws.recv())).get("is_final"):
                pass
        assert reply["seq"] == 0 and reply["stable_text"]


# -- churn does not cost bystanders --------------------------------------------------------
# A partial whose stream began closing while it waited for a worker is not translated, so
# connections that left do not queue work ahead of live streams
# (`examples/benchmarks/chaos_soak.py` measures a bystander's latency under churn).


@pytest.mark.anyio
async def test_a_partial_of_a_closing_stream_gets_no_worker(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from engine.streaming.controller import IncrementalTranslator
    from engine.streaming.session import StreamSession
    from protocol import PartialTranscript
    from tests.live_server import STREAMING

    real = StreamSession.steps  # what the engine runs, its decodes awaited
    release = threading.Event()
    translated: list[str] = []

    def seen(self: StreamSession, event: PartialTranscript, *args: object, **kw: object) -> object:
        translated.append(event.stream_id)
        return real(self, event, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(StreamSession, "steps", seen)
    slow_decodes(monkeypatch, until=release)  # "busy" holds its slot until released
    async with IncrementalTranslator(translator, STREAMING, decode_slots=1) as nmt:
        await nmt.push(PartialTranscript("busy", 0, 0, "I will meet Tom", is_final=False))
        with anyio.fail_after(10):
            while "busy" not in translated:  # the one worker is taken
                await anyio.sleep(0.01)
        await nmt.push(PartialTranscript("gone", 0, 0, "I will", is_final=False))
        await anyio.sleep(0.05)  # "gone" now waits for the worker
        async with anyio.create_task_group() as tg:
            tg.start_soon(nmt.close_stream, "gone")  # its writer left
            await anyio.sleep(0.05)
            release.set()
    assert translated.count("gone") == 0
    assert nmt.stats["superseded"] >= 1


@pytest.mark.anyio
async def test_an_update_is_encoded_once_for_all_its_viewers(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    import functools
    import json

    from websockets.asyncio.client import connect

    import protocol
    from engine.server import client
    from tests.conftest import wait_for
    from tests.live_server import send_sentence, until_final, ws_url

    calls: list[str] = []

    def counting(message: protocol.Message) -> str:
        calls.append(type(message).__name__)
        return protocol.serialize(message)

    monkeypatch.setattr(client, "_encoded", functools.lru_cache(maxsize=64)(counting))
    async with (
        serving(translator) as server,
        connect(ws_url(server)) as writer,
        connect(ws_url(server)) as viewer_a,
        connect(ws_url(server)) as viewer_b,
    ):
        for viewer in (viewer_a, viewer_b):
            await viewer.send(json.dumps({"type": "subscribe", "stream_id": "s1"}))
        await wait_for(lambda: server.role_counts()["viewer"] == 2)
        await send_sentence(writer)
        written = await until_final(writer)
        seen = [await until_final(viewer_a), await until_final(viewer_b)]
    sent = len(written) + sum(len(s) for s in seen)
    assert sent >= 2 * len(written)  # the viewers got the updates too...
    assert calls.count("TranslationUpdate") == len(written)  # ...each encoded once


@pytest.mark.anyio
async def test_each_event_is_tokenised_once_from_admission_to_decoding(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.streaming.controller import IncrementalTranslator
    from protocol import PartialTranscript
    from tests.live_server import STREAMING

    calls: list[str] = []
    real = translator.source_ids

    def counting(text: str, *, partial: bool = False) -> list[int]:
        calls.append(text)
        return real(text, partial=partial)

    monkeypatch.setattr(translator, "source_ids", counting)
    texts = ["I will", "I will meet", "I will meet Tom at three"]
    async with IncrementalTranslator(translator, STREAMING) as nmt:
        for seq, text in enumerate(texts):
            await nmt.push(PartialTranscript("t", 0, seq, text, is_final=seq == 2))
            await nmt.wait_idle("t")
    assert calls == texts  # admission's ids went on to the encoder


# -- connection caps -----------------------------------------------------------------------
# Silent or idle connections must not exhaust descriptors and lock out /healthz and real
# writers: the caps derive from the descriptor limit, a silent connect is dropped at the
# handshake deadline (or for a newcomer), a handshake past a cap is answered 503/429 at
# once, and refusals are counted by reason in /metrics and logged once per interval
# (examples/benchmarks/fd_limit.py attacks a real `serve`).


def test_connection_caps_fit_in_the_descriptor_limit() -> None:
    from engine.server.admission import ConnectionCaps, descriptor_reserve

    for limit in (64, 256, 1024, 20000, 2**20):
        caps = ConnectionCaps.derive(limit)
        # A reserve for files and two bursts of accepts (a tiny limit gets a floor).
        fits = caps.descriptors() + descriptor_reserve(limit) <= limit
        assert fits or caps.descriptors() == 16, limit
        assert caps.max_per_address == caps.max_connections // 2
        assert caps.max_connections <= 10_000 and caps.max_pending >= 8
    assert ConnectionCaps.derive(1024).max_connections == 480  # 1024 - 384 reserve - 160
    given = ConnectionCaps.derive(1024, max_connections=40, max_per_address=0)
    assert (given.max_connections, given.max_per_address) == (40, None)
    assert given.max_pending == 20  # at most half the connections
    assert ConnectionCaps.derive(1024, handshake_timeout=2.0).handshake_timeout == 2.0
    with pytest.raises(ValueError, match="handshake_timeout"):
        ConnectionCaps(handshake_timeout=0.0)


def test_the_gate_caps_connections_in_all_and_per_address() -> None:
    from engine.server.admission import ConnectionCaps, ConnectionGate, client_key

    gate = ConnectionGate(ConnectionCaps(max_connections=3, max_per_address=2))
    assert gate.admit(1, "10.0.0.1") is None and gate.admit(2, "10.0.0.1") is None
    per_address = gate.admit(3, "10.0.0.1")
    assert per_address is not None and per_address.status == 429
    assert per_address.counted_as == "per_address" and ("Retry-After", "5") in per_address.headers
    assert gate.admit(4, "10.0.0.2") is None
    full = gate.admit(5, "10.0.0.3")
    assert full is not None and (full.status, full.counted_as) == (503, "max_connections")
    gate.leave(1)
    gate.leave(1)  # idempotent
    assert gate.open == 2 and gate.admit(6, "10.0.0.1") is None
    # One IPv6 host holds a /64; an IPv4-mapped address is its IPv4 one.
    assert client_key("2001:db8::1") == client_key("2001:db8::ffff") == "2001:db8::/64"
    assert client_key("::ffff:10.0.0.1") == "10.0.0.1" and client_key(None) == "local"


def test_the_gate_drops_a_silent_handshake_for_a_newcomer_or_at_its_deadline() -> None:
    from engine.server.admission import ConnectionCaps, ConnectionGate

    gate = ConnectionGate(ConnectionCaps(max_pending=2, handshake_timeout=5.0))
    assert gate.arrive(1, 0.0) == (True, [])
    assert gate.arrive(2, 0.0) == (True, [])
    # Both pending ones are young (a request may be on its way): the newcomer waits out.
    assert gate.arrive(3, 0.05) == (False, [])
    # Past the eviction age the oldest silent one makes room.
    assert gate.arrive(4, 0.2) == (True, [1])
    gate.request(2)  # its request came: no longer pending, never dropped
    assert gate.pending == 1 and gate.arrive(5, 0.3) == (True, [])
    assert gate.expired(4) and not gate.expired(2) and gate.pending == 1


def test_refusals_are_logged_once_per_interval_with_their_counts() -> None:
    from engine.server.admission import Tally

    tally = Tally(interval=10.0)
    assert tally.add("fd_limit", 0.0) == {"fd_limit": 1}  # the first at once
    for i in range(1000):
        assert tally.add("fd_limit" if i % 2 else "max_connections", 1.0 + i / 1000) is None
    assert tally.next_due == 10.0 and tally.due(9.9) is None
    assert tally.due(10.0) == {"fd_limit": 500, "max_connections": 500}
    assert tally.due(30.0) is None and tally.next_due is None
    assert tally.total == {"fd_limit": 501, "max_connections": 500}


@pytest.mark.anyio
async def test_past_the_connection_caps_a_handshake_gets_503_or_429_at_once(
    translator: Translator,
) -> None:
    from websockets.asyncio.client import connect

    from engine.server.admission import ConnectionCaps
    from tests.live_server import http_get, refused_with, ws_url

    caps = ConnectionCaps(max_connections=2, max_per_address=None)
    async with serving(translator, connections=caps) as server:
        async with connect(ws_url(server)), connect(ws_url(server)):
            with anyio.fail_after(5), refused_with(503):
                async with connect(ws_url(server)):
                    pass
            assert (await http_get(server, "/healthz")).status == 200  # probes get in
        async with connect(ws_url(server)), connect(ws_url(server)):  # room again
            pass
        body = (await http_get(server, "/metrics")).body
    assert 'nmt_server_connections_rejected_total{reason="max_connections"} 1.0' in body
    assert "nmt_server_max_connections 2.0" in body

    caps = ConnectionCaps(max_connections=10, max_per_address=1)
    async with serving(translator, connections=caps) as server, connect(ws_url(server)):
        with anyio.fail_after(5), refused_with(429):
            async with connect(ws_url(server)):
                pass
        body = (await http_get(server, "/metrics")).body
    assert 'nmt_server_connections_rejected_total{reason="per_address"} 1.0' in body


@pytest.mark.anyio
async def test_a_silent_connection_is_dropped_at_the_handshake_deadline(
    translator: Translator,
) -> None:
    """With a token set, an unauthenticated socket that sends nothing holds its descriptor
    only until `handshake_timeout`, not for websockets' own, much longer open timeout."""
    import contextlib
    import time

    from engine.server.admission import ConnectionCaps
    from tests.live_server import http_get

    caps = ConnectionCaps(handshake_timeout=0.3)
    async with serving(translator, token="w", connections=caps) as server:
        started = time.monotonic()
        async with await anyio.connect_tcp("127.0.0.1", server.port) as silent:
            closed = (anyio.EndOfStream, anyio.BrokenResourceError, OSError)
            with anyio.fail_after(3), contextlib.suppress(*closed):  # closed, or reset
                pytest.fail(f"the server sent {await silent.receive()!r}")
        assert time.monotonic() - started < 2.0
        assert server.gate.pending == 0
        body = (await http_get(server, "/metrics", Authorization="Bearer w")).body
    assert 'nmt_server_connections_rejected_total{reason="handshake_timeout"} 1.0' in body


_AT_THE_LIMIT = """
import anyio, sys
from engine.server.app import ServerOptions, SubtitleServer
from engine.server.admission import ConnectionCaps
from tests.conftest import slow_decodes

async def main() -> None:
    # Caps set past what the descriptor limit holds: accept() itself fails.
    caps = ConnectionCaps(max_connections=1000, max_pending=1000, handshake_timeout=30)
    async with SubtitleServer(None, ServerOptions(port=0, connections=caps)) as server:
        print(server.port, flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        print(dict(server._doors.tally.total), flush=True)

anyio.run(main)
"""


def test_at_the_descriptor_limit_failed_accepts_are_summed_up_and_answered() -> None:
    """A server under `ulimit -n 64` and 200 silent connects: failed accepts are counted
    and logged as a line per interval (not a traceback each), and the waiting connections
    are answered at once from a spare descriptor, also while asyncio's accept is paused,
    so /healthz does not wait in the backlog."""
    import ast
    import contextlib
    import resource
    import socket
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    proc = subprocess.Popen(
        [sys.executable, "-c", _AT_THE_LIMIT],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit,
    )
    held = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        for _ in range(200):  # bounded: 200 tries of at most 0.5 s
            # OSError: the backlog is full, the server does not take them off it.
            with contextlib.suppress(OSError):
                held.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
        time.sleep(1.5)
        waits = []
        for _ in range(12):  # bounded: 12 probes, 0.15 s apart, each within 5 s
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=5) as probe:
                probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                reply = probe.recv(4096)
            assert reply.startswith((b"HTTP/1.1 200", b"HTTP/1.1 503")), reply
            waits.append(time.monotonic() - started)
            time.sleep(0.15)
        # Answered also within the second asyncio stops accepting after a failed accept.
        assert max(waits) < 0.5, waits
        time.sleep(1.0)
    finally:
        for sock in held:
            sock.close()
        if proc.stdin is not None:
            proc.stdin.write("\n")
            proc.stdin.flush()
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    tally = ast.literal_eval(out.strip().splitlines()[-1])
    assert tally.get("fd_limit", 0) > 0, (out, err)
    assert "Traceback" not in err and "out of system resource" not in err, err[-3000:]
    summaries = [line for line in err.splitlines() if "connections refused" in line]
    assert 1 <= len(summaries) <= 3, err[-3000:]
    assert len(err) < 5000, err[-3000:]


# -- the page's stream-id rules are the server's -------------------------------------------
# (tests/test_browser.py shows the page itself in Chromium.)


def test_the_page_checks_stream_ids_with_the_servers_rules() -> None:
    import re

    import protocol
    from protocol.messages import _UNPRINTABLE
    from tests.conftest import ROOT

    script = (ROOT / "engine" / "server" / "static" / "subtitles.js").read_text("utf-8")
    limit = re.search(r"const MAX_STREAM_ID_CHARS = (\d+);", script)
    assert limit is not None and int(limit.group(1)) == protocol.messages.MAX_STREAM_ID_CHARS
    literal = re.search(r"const UNPRINTABLE =\s*/(\[[^\]]+\])/;", script)
    assert literal is not None
    page = re.compile(literal.group(1))  # \uXXXX classes read the same in Python
    for cp in range(0x110000):
        if 0xD800 <= cp < 0xE000:
            continue  # surrogates: never in a decoded URL parameter
        ch = chr(cp)
        assert bool(page.search(ch)) == bool(_UNPRINTABLE.search(ch)), hex(cp)
    assert 'rawStream.normalize("NFC")' in script  # compared as the server compares


def test_serve_options_for_the_caps_and_their_defaults() -> None:
    import argparse

    from engine.cli.main import build_parser
    from engine.cli.serve import options_from_args
    from engine.cli.serve_args import add_serve_parser
    from engine.server.admission import ConnectionCaps

    parser = build_parser()
    options = options_from_args(parser.parse_args(["serve", "--model", "m"]))
    assert options.connections == ConnectionCaps.derive()  # from the process's limit
    args = parser.parse_args(
        [
            "serve", "--model", "m", "--max-connections", "50",
            "--max-connections-per-address", "0", "--handshake-timeout", "2.5",
        ]
    )  # fmt: skip
    caps = options_from_args(args).connections
    assert (caps.max_connections, caps.max_per_address, caps.handshake_timeout) == (50, None, 2.5)
    subparsers = argparse.ArgumentParser().add_subparsers()
    add_serve_parser(subparsers)
    serve_help = subparsers.choices["serve"].format_help()
    for flag in ("--max-connections ", "--max-connections-per-address", "--handshake-timeout"):
        assert flag in serve_help
    assert "ulimit -n" in serve_help and "503" in serve_help and "429" in serve_help


def test_the_descriptor_limit_attack_script_passes_in_short() -> None:
    """`examples/benchmarks/fd_limit.py`, short: silent connects and connections past a
    cap set beyond `ulimit -n 128` against a real `serve`; the log stays quiet, /healthz
    answers during each attack and a writer gets through after it."""
    import subprocess
    import sys

    from tests.conftest import ROOT, needs_fixture

    needs_fixture()
    script = ROOT / "examples" / "benchmarks" / "fd_limit.py"
    args = ["--nofile", "128", "--connections", "300", "--silent", "200", "--hold", "2"]
    done = subprocess.run(
        [sys.executable, str(script), *args, "--attacks", "silent", "over-cap"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tracebacks logged: 0" in done.stdout
