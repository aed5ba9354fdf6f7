"""The live-subtitle server: its sans-I/O rules, then a real server on loopback with real
`websockets` clients (skipped without the fixture model)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from engine.decoding.translator import Translator
from engine.server.app import ServerOptions, SubtitleServer
from engine.server.connection import Close, ConnectionCore, Ignore, Push, Reply, Role, Watch
from engine.server.credentials import Credentials, authorize, presented_token
from engine.server.handshake import Refusal, Route, route
from engine.server.limits import Limits, TokenBucket
from engine.server.outbox import Outbox
from engine.server.state import ServerPhase, ServerState
from protocol import ErrorMessage, PartialTranscript, TranslationUpdate
from tests.conftest import partial_message, wait_for
from tests.live_server import (
    PREFIXES,
    SENTENCE,
    STREAMING,
    http_get,
    open_streams,
    recv,
    refused_with,
    send_sentence,
    serving,
    until_final,
    ws_url,
)

# --- sans-I/O rules (no model, no network) ----------------------------------------------


def _core(state: ServerState | None = None, cid: int = 1, **limits: Any) -> ConnectionCore:
    limits = {"rate_limit": None, **limits}
    return ConnectionCore(cid, Limits(**limits), state or ServerState())


def test_token_bucket_allows_bursts_then_the_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(0.4) is False  # 0.8 of a token
    assert bucket.take(0.5) is True
    assert bucket.take(100.0) and bucket.take(100.0) and bucket.take(100.0)
    assert bucket.take(100.0) is False  # refills only up to the burst


def test_token_from_header_or_query_compared_exactly() -> None:
    assert presented_token("/ws", "Bearer abc") == "abc"
    assert presented_token("/ws?token=x%20y", None) == "x y"
    assert presented_token("/ws?token=q", "Basic Zm9v") == "q"
    # A viewer token too: nobody gets in without one of the two.
    kwargs: dict[str, Any] = {
        "credentials": Credentials(writer="abc", viewer="v"),
        "allowed_origins": None,
    }
    assert not isinstance(authorize("/ws", "Bearer abc", None, **kwargs), Refusal)
    assert not isinstance(authorize("/ws?token=abc", None, None, **kwargs), Refusal)
    for path, header in [("/ws", None), ("/ws", "Bearer abcd"), ("/ws?token=ab", None)]:
        refusal = authorize(path, header, None, **kwargs)
        assert isinstance(refusal, Refusal) and refusal.status == 401


def test_origin_allowlist_applies_to_browsers_only() -> None:
    kwargs: dict[str, Any] = {
        "credentials": Credentials(),
        "allowed_origins": frozenset({"http://ok"}),
    }
    assert not isinstance(authorize("/ws", None, "http://ok", **kwargs), Refusal)
    assert not isinstance(authorize("/ws", None, None, **kwargs), Refusal)  # no Origin
    refusal = authorize("/ws", None, "http://evil", **kwargs)
    assert isinstance(refusal, Refusal) and refusal.status == 403


def test_routes() -> None:
    assert route("/ws?token=a") is Route.WEBSOCKET
    assert route("/?stream=s1") is Route.PAGE
    assert route("/subtitles.js") is Route.STATIC
    assert route("/metrics") is Route.METRICS
    assert route("/../etc/passwd") is Route.NOT_FOUND


def test_core_roles_and_shutdown() -> None:
    """Roles are the connection's; ownership and stream limits are the engine's lifecycle
    (tests/test_lifecycle.py), so the core hands every partial and close on."""
    state = ServerState()
    writer, viewer = _core(state, 1, max_streams_per_connection=2), _core(state, 2)
    assert writer.owner.max_streams == 2 and writer.owner != viewer.owner
    action = writer.receive(partial_message("a", 0), 0)
    assert isinstance(action, Push) and action.event.stream_id == "a"
    close = writer.receive(json.dumps({"type": "close_stream", "stream_id": "a"}), 0)
    assert isinstance(close, Close) and close.stream_id == "a"
    subscribe = json.dumps({"type": "subscribe", "stream_id": "a"})
    reply = writer.receive(subscribe, 0)
    assert isinstance(reply, Reply) and reply.error.code == "forbidden"
    assert isinstance(viewer.receive(subscribe, 0), Watch) and viewer.role is Role.VIEWER
    assert isinstance(viewer.receive(subscribe, 0), Ignore)
    reply = viewer.receive(partial_message("z", 0), 0)
    assert isinstance(reply, Reply) and reply.error.code == "forbidden"
    assert state.stop() and not state.stop()  # the one flag: stopping, once
    reply = writer.receive(partial_message("a", 9), 0)
    assert isinstance(reply, Reply) and reply.error.code == "unavailable"


def test_server_state_decides_every_loading_and_stopping_refusal() -> None:
    state = ServerState()
    assert state.phase is ServerPhase.LOADING and not state.ready
    assert state.readyz() == (503, "not ready: model loading\n")
    refusal = state.handshake_refusal()
    assert refusal is not None and refusal.reason == "Not ready: the model is loading.\n"
    state.attach(["zh", "de"])
    assert state.ready and state.languages == ("zh", "de")
    assert state.readyz() == (200, "ready\n") and state.handshake_refusal() is None
    core = _core(state)
    assert state.stop()
    state.attach(["zh"])  # a model loaded after the stop makes nothing ready
    assert state.stopping and not state.ready
    assert state.readyz() == (404, "not ready: draining (shutting down)\n")
    refusal = state.handshake_refusal()
    assert refusal is not None and refusal.status == 503
    assert refusal.reason == "Not ready: the server is shutting down.\n"
    frames = [
        partial_message("a", 0, final=True),
        json.dumps({"type": "close_stream", "stream_id": "a"}),
        json.dumps({"type": "subscribe", "stream_id": "a"}),
    ]
    replies = [core.receive(frame, 0) for frame in frames]
    assert all(isinstance(r, Reply) for r in replies)
    errors = [r.error for r in replies if isinstance(r, Reply)]
    assert {(e.code, e.message) for e in errors} == {
        ("unavailable", "the server is shutting down and takes no new messages")
    }
    assert [e.stream_id for e in errors] == ["a", "a", "a"] and errors[0].seq == 0
    assert [r.about_final for r in replies if isinstance(r, Reply)] == [True, False, False]
    assert errors[0] == state.shutting_down(PartialTranscript("a", 0, 0, "x", True))


def test_core_bad_frames_and_rate_limit() -> None:
    core = ConnectionCore(1, Limits(rate_limit=2.0, max_text_chars=10), ServerState())
    cases = {
        "{oops": "invalid_json",
        '{"type": "hello"}': "unknown_type",
        '{"type": "translation_update"}': "invalid_message",  # not for clients to send
    }
    for i, (data, code) in enumerate(cases.items()):
        reply = core.receive(data, float(i))
        assert isinstance(reply, Reply) and reply.error.code == code
    reply = core.receive(b"\x00\x01", 10.0)
    assert isinstance(reply, Reply) and "binary" in reply.error.message
    reply = core.receive(partial_message("s", 0, text="x" * 11), 20.0)
    assert isinstance(reply, Reply) and reply.error.code == "too_large"
    assert reply.error.field == "text"
    assert isinstance(core.receive(partial_message("s", 1), 30.0), Push)
    assert isinstance(core.receive(partial_message("s", 2), 30.0), Push)
    reply = core.receive(partial_message("s", 3), 30.0)
    assert isinstance(reply, Reply) and reply.error.code == "rate_limited"
    assert (reply.error.stream_id, reply.error.seq) == ("s", 3)


def _update(stream: str, seq: int, final: bool = False, segment: int = 0) -> TranslationUpdate:
    return TranslationUpdate(stream, segment, seq, "x", "" if final else "y", final, 1.0, 1.0)


async def _drain(outbox: Outbox) -> list[Any]:
    outbox.end()
    items = []
    while (item := await outbox.get()) is not None:
        items.append(item)
    return items


@pytest.mark.anyio
async def test_outbox_sheds_superseded_updates_never_finals() -> None:
    outbox = Outbox(max_updates=3, max_errors=1)
    outbox.put_update(_update("a", 0))
    outbox.put_update(_update("b", 0))
    outbox.put_update(_update("a", 1))
    outbox.put_update(_update("a", 2, final=True))  # sheds a/0, superseded by a/1
    outbox.put_update(_update("a", 3, final=True, segment=1))  # sheds b/0, the oldest
    outbox.put_update(_update("a", 4, final=True, segment=2))  # sheds a/1
    outbox.put_update(_update("a", 5, final=True, segment=3))  # all finals: kept
    assert outbox.put_error(ErrorMessage("internal", "x"))
    assert not outbox.put_error(ErrorMessage("internal", "y"))
    items = await _drain(outbox)
    assert [(u.stream_id, u.seq) for u in items[:4]] == [("a", 2), ("a", 3), ("a", 4), ("a", 5)]
    assert isinstance(items[4], ErrorMessage)
    assert (outbox.dropped_updates, outbox.dropped_errors) == (3, 1)


@pytest.mark.anyio
async def test_outbox_supersedes_within_a_language_only() -> None:
    """With fan-out, a newer zh update of a segment does not make the de one stale."""
    outbox = Outbox(max_updates=3)
    for stream, seq, lang in [("a", 0, "de"), ("a", 0, "zh"), ("a", 1, "zh"), ("b", 2, "zh")]:
        outbox.put_update(dataclasses.replace(_update(stream, seq), lang=lang))
    items = await _drain(outbox)  # the fourth shed zh a/0, superseded by zh a/1
    assert [(u.stream_id, u.seq, u.lang) for u in items] == [
        ("a", 0, "de"),
        ("a", 1, "zh"),
        ("b", 2, "zh"),
    ]


# --- a real server on loopback -----------------------------------------------------------


@pytest.fixture(scope="module")
def expected(translator: Translator) -> str:
    return translator.translate([SENTENCE], STREAMING.decode)[0].text


@pytest.mark.anyio
async def test_round_trip_and_viewer(translator: Translator, expected: str) -> None:
    async with (
        serving(translator) as server,
        connect(ws_url(server)) as writer,
        connect(ws_url(server)) as viewer,
    ):
        await viewer.send(json.dumps({"type": "subscribe", "stream_id": "s1"}))
        await wait_for(lambda: server.role_counts()["viewer"] == 1)
        await send_sentence(writer)
        written = await until_final(writer)
        viewed = await until_final(viewer)
    assert all(m["type"] == "translation_update" for m in written)
    final = written[-1]
    assert final["stable_text"] == expected == "我三点见汤姆" and final["unstable_text"] == ""
    assert viewed[-1] == final  # the same final, field for field
    # The viewer saw the writer's updates (it may skip superseded ones, never add any).
    assert all(m in written for m in viewed)
    stable = [m["stable_text"] for m in written]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(stable))


@pytest.mark.anyio
async def test_token_required_by_header_or_query(translator: Translator) -> None:
    # With a viewer token too, nobody gets in without a token (tests/test_roles.py: roles).
    async with serving(translator, token="s3cret", viewer_token="v1ew") as server:
        with refused_with(401):
            async with connect(ws_url(server)):
                pass
        with refused_with(401):
            async with connect(ws_url(server, "?token=wrong")):
                pass
        with refused_with(401):
            async with connect(ws_url(server), additional_headers={"Authorization": "Bearer x"}):
                pass
        async with connect(ws_url(server), additional_headers={"Authorization": "Bearer s3cret"}):
            pass
        async with connect(ws_url(server, "?token=s3cret")) as ws:
            await send_sentence(ws)
            assert (await until_final(ws))[-1]["is_final"]
        assert (await http_get(server, "/metrics")).status == 401
        ok = await http_get(server, "/metrics", Authorization="Bearer s3cret")
        assert ok.status == 200
        assert (await http_get(server, "/healthz")).status == 200  # probes need no token
        assert (await http_get(server, "/")).status == 200  # the page holds no data


@pytest.mark.anyio
async def test_origin_allowlist(translator: Translator) -> None:
    async with serving(translator, allowed_origins=("http://studio.example",)) as server:
        with refused_with(403):
            async with connect(ws_url(server), origin="http://evil.example"):  # type: ignore[arg-type]
                pass
        async with connect(ws_url(server), origin="http://studio.example"):  # type: ignore[arg-type]
            pass
        async with connect(ws_url(server)):  # no Origin: not a browser
            pass


@pytest.mark.anyio
async def test_bad_messages_get_errors_and_the_connection_goes_on(
    translator: Translator, expected: str
) -> None:
    limits = Limits(rate_limit=None, max_message_bytes=2000, max_text_chars=200)
    async with serving(translator, limits=limits) as server, connect(ws_url(server)) as ws:
        await ws.send(partial_message("s1", 0, "I will"))
        bad = {
            "{not json": ("invalid_json", None),
            '{"type": "shout", "stream_id": "s1"}': ("unknown_type", "type"),
            partial_message("s1", 1).replace('"seq": 1', '"seq": "one"'): (
                "invalid_message",
                "seq",
            ),
            partial_message("s1", 2, "x" * 300): ("too_large", "text"),
            partial_message("s1", 3, "y" * 3000): ("too_large", None),  # whole message > 2000 bytes
        }
        for data in bad:
            await ws.send(data)
        await ws.send(b"\x89PNG binary")
        await ws.send(partial_message("s1", 4, "I will meet"))
        await ws.send(partial_message("s1", 2, "I will meet Tom"))  # seq going back
        await ws.send(partial_message("s1", 9, SENTENCE, final=True))
        messages = await until_final(ws)
        errors = [m for m in messages if m["type"] == "error"]
        assert [(e["code"], e.get("field")) for e in errors[:5]] == list(bad.values())
        assert errors[5]["code"] == "invalid_message" and "binary" in errors[5]["message"]
        assert (errors[6]["code"], errors[6]["seq"]) == ("out_of_order", 2)
        assert messages[-1]["stable_text"] == expected
        # Over the socket's frame limit (4 x 2000 bytes) the connection is closed (1009).
        await ws.send("z" * 9000)
        with pytest.raises(ConnectionClosed) as closed:
            await recv(ws)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        metrics = (await http_get(server, "/metrics")).body
    assert 'nmt_server_errors_total{code="too_large"} 2.0' in metrics
    assert 'nmt_server_messages_received_total{type="invalid"} 6.0' in metrics


@pytest.mark.anyio
async def test_rate_limit_drops_messages_over_it(translator: Translator) -> None:
    async with (
        serving(translator, limits=Limits(rate_limit=2.0)) as server,
        connect(ws_url(server)) as ws,
    ):
        for seq, text in enumerate(PREFIXES * 3):  # 15 messages at once; bursts of 2
            await ws.send(partial_message("s1", seq, text))
        await anyio.sleep(1.2)  # refill
        await ws.send(partial_message("s1", 20, SENTENCE, final=True))
        messages = await until_final(ws)
    limited = [m["seq"] for m in messages if m.get("code") == "rate_limited"]
    assert len(limited) >= 8 and limited == sorted(limited) and limited[-1] == 14
    assert messages[-1]["is_final"] and messages[-1]["seq"] == 20


@pytest.mark.anyio
async def test_stream_ownership(translator: Translator) -> None:
    async with (
        serving(translator) as server,
        connect(ws_url(server)) as owner,
        connect(ws_url(server)) as intruder,
    ):
        await owner.send(partial_message("s1", 0))
        await wait_for(lambda: "s1" in open_streams(server))
        await intruder.send(partial_message("s1", 1, "injected"))
        await intruder.send(json.dumps({"type": "close_stream", "stream_id": "s1"}))
        codes = [(await recv(intruder))["code"] for _ in range(2)]
        assert codes == ["forbidden", "forbidden"]
        await owner.send(partial_message("s1", 1, SENTENCE, final=True))
        messages = await until_final(owner)
        assert "injected" not in json.dumps(messages)


@pytest.mark.anyio
async def test_stream_limits_per_connection_and_in_total(translator: Translator) -> None:
    limits = Limits(rate_limit=None, max_streams_per_connection=2)
    async with (
        serving(translator, limits=limits, max_streams=3) as server,
        connect(ws_url(server)) as a,
        connect(ws_url(server)) as b,
    ):
        for stream in ("a1", "a2", "a3"):
            await a.send(partial_message(stream, 0))
        error = await recv(a)
        while error["type"] != "error":
            error = await recv(a)
        assert (error["code"], error["stream_id"]) == ("limit_exceeded", "a3")
        for stream in ("b1", "b2"):
            await b.send(partial_message(stream, 0))
        error = await recv(b)
        while error["type"] != "error":
            error = await recv(b)
        assert (error["code"], error["stream_id"]) == ("limit_exceeded", "b2")  # 3 in total
        await wait_for(lambda: sorted(open_streams(server)) == ["a1", "a2", "b1"])
        await a.send(json.dumps({"type": "close_stream", "stream_id": "a1"}))
        await wait_for(lambda: "a1" not in open_streams(server))
        await b.send(partial_message("b2", 1, SENTENCE, final=True))
        assert (await until_final(b, "b2"))[-1]["is_final"]


@pytest.mark.anyio
async def test_disconnect_mid_stream_frees_streams_and_finishes_finals(
    translator: Translator, expected: str
) -> None:
    async with serving(translator) as server, connect(ws_url(server)) as viewer:
        await viewer.send(json.dumps({"type": "subscribe", "stream_id": "s1"}))
        async with connect(ws_url(server)) as writer:
            await send_sentence(writer)
            await writer.send(
                json.dumps(
                    {
                        "type": "partial_transcript",
                        "stream_id": "s1",
                        "segment_id": 1,
                        "seq": 10,
                        "text": "Tom reads",
                        "is_final": False,
                    }
                )
            )
        # Gone without close_stream, its last segment unfinished.
        finals = [m for m in await until_final(viewer) if m["is_final"]]
        assert finals[-1]["stable_text"] == expected
        await wait_for(lambda: server.engine is not None and not open_streams(server))
        assert server.engine is not None
        await wait_for(lambda: server.engine is not None and not server.engine.streams)
        async with connect(ws_url(server)) as other:  # the id is free for anyone now
            await send_sentence(other)
            assert (await until_final(other))[-1]["stable_text"] == expected


@pytest.mark.anyio
async def test_shutdown_delivers_pending_finals_then_closes_1001(
    translator: Translator, expected: str
) -> None:
    async with serving(translator) as server:
        writer = await connect(ws_url(server))
        viewer = await connect(ws_url(server))
        await viewer.send(json.dumps({"type": "subscribe", "stream_id": "s2"}))
        await wait_for(lambda: server.role_counts()["viewer"] == 1)
        await send_sentence(writer, "s1")
        await send_sentence(writer, "s2")
        await wait_for(lambda: len(open_streams(server)) == 2)
        await server.shutdown()
        assert not server.ready
        finals: dict[str, list[str]] = {}
        for ws, name in ((writer, "writer"), (viewer, "viewer")):
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    message = await recv(ws)
                    if message.get("is_final"):
                        finals.setdefault(name, []).append(message["stream_id"])
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    assert sorted(finals["writer"]) == ["s1", "s2"] and finals["viewer"] == ["s2"]


@pytest.mark.anyio
async def test_http_endpoints(translator: Translator) -> None:
    async with serving(translator) as server:
        health = await http_get(server, "/healthz")
        ready = await http_get(server, "/readyz")
        assert (health.status, ready.status) == (200, 200)
        page = await http_get(server, "/?stream=s1&bg=transparent")
        assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")
        assert "subtitles.js" in page.body and "Content-Security-Policy" in page.headers
        script = await http_get(server, "/subtitles.js")
        assert script.status == 200 and "javascript" in script.headers["Content-Type"]
        assert (await http_get(server, "/missing")).status == 404
        async with connect(ws_url(server)) as ws:
            await send_sentence(ws)
            await ws.send("{")
            await until_final(ws)
            metrics = await http_get(server, "/metrics")
    assert metrics.status == 200 and metrics.headers["Content-Type"].startswith("text/plain")
    body = metrics.body
    for line in (
        'nmt_server_connections{role="writer"} 1.0',
        "nmt_server_open_streams 1.0",
        'nmt_server_messages_received_total{type="partial_transcript"} 6.0',
        'nmt_server_messages_received_total{type="invalid"} 1.0',
        'nmt_server_errors_total{code="invalid_json"} 1.0',
        "nmt_server_dropped_updates_total 0.0",
        'nmt_engine_events_total{kind="events"} 6.0',
    ):
        assert line in body, line
    assert 'nmt_server_messages_sent_total{type="translation_update"}' in body
    steps = next(
        x
        for x in body.splitlines()
        if 'nmt_scheduler_work_total{kind="decoder_steps",lang="zh"}' in x
    )
    assert float(steps.split()[1]) >= 1  # the decode scheduler's counters too, by language
    count = next(
        x for x in body.splitlines() if x.startswith('nmt_update_latency_seconds_count{lang="zh"}')
    )
    assert float(count.split()[1]) >= 1
    info = next(x for x in body.splitlines() if x.startswith("nmt_model_info{"))
    assert 'lang="zh"' in info and 'source_lang="en"' in info and 'default="true"' in info


@pytest.mark.anyio
async def test_not_ready_until_a_model_is_attached() -> None:
    async with SubtitleServer(None, ServerOptions(port=0)) as server:
        assert (await http_get(server, "/healthz")).status == 200
        ready = await http_get(server, "/readyz")
        assert ready.status == 503 and "loading" in ready.body
        with refused_with(503):
            async with connect(ws_url(server)):
                pass
