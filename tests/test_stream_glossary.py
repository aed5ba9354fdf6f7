"""A stream's own glossary from its writer (`set_glossary`): acknowledged, applied from the
next partial merged over the server's (the stream's entries winning), refused for a viewer,
past its bounds and for a bad line; kept with the stream so that another node that takes
the stream over (Redis) applies it too, and so does a restarted writer's new life."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import ClientConnection, connect

from engine.decoding.translator import Translator
from engine.glossary import Glossary, merged
from engine.server.app import ServerOptions, SubtitleServer
from engine.server.limits import Limits
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.lifecycle import Owner
from engine.streaming.redis_bus import RedisBus
from engine.streaming.subscriptions import Subscription
from protocol import GlossarySet, InvalidEvent, PartialTranscript, SetGlossary, TranslationUpdate
from protocol.messages import MAX_GLOSSARY_BYTES
from tests.conftest import partial_message
from tests.live_server import ws_url
from tests.redis_server import RedisServer, redis_server

SERVER = Glossary.parse("en\tzh\nTom\t杰克\n")
OWN = "en\tzh\nTom\t爱丽丝\nbook\t报纸\n"
TEXT = "Tom reads a book in the library"


def offline(translator: Translator, glossary: Glossary | None) -> str:
    return translator.translate([TEXT], glossary=glossary)[0].text


async def recv(ws: ClientConnection) -> dict[str, Any]:
    with anyio.fail_after(20):
        reply: dict[str, Any] = json.loads(await ws.recv())
    return reply


async def final_of(ws: ClientConnection) -> dict[str, Any]:
    while not (reply := await recv(ws)).get("is_final"):
        assert reply["type"] == "translation_update", reply
    return reply


def set_glossary(stream: str, text: str) -> str:
    return json.dumps({"type": "set_glossary", "stream_id": stream, "glossary": text})


@contextlib.asynccontextmanager
async def serving(translator: Translator) -> AsyncIterator[SubtitleServer]:
    async with (
        IncrementalTranslator(translator, glossaries=SERVER) as nmt,
        SubtitleServer(nmt, ServerOptions(port=0, limits=Limits(rate_limit=None))) as server,
    ):
        yield server


@pytest.mark.anyio
async def test_acknowledged_and_applied_from_the_next_partial(translator: Translator) -> None:
    own = Glossary.parse(OWN)
    assert "爱丽丝" not in offline(translator, SERVER)  # the model does not write it alone
    async with serving(translator) as server, connect(ws_url(server)) as ws:
        nmt = server.engine
        assert nmt is not None
        await ws.send(partial_message("s1", 0, TEXT, final=True))
        before = await final_of(ws)
        await ws.send(set_glossary("s1", OWN))
        ack = await recv(ws)
        await ws.send(partial_message("s1", 1, TEXT + " ", final=False, segment=1))
        first = await recv(ws)
        await ws.send(partial_message("s1", 2, TEXT, final=True, segment=1))
        after = await final_of(ws)
        terms = nmt.stream_terms("s1")
    assert ack == {"type": "glossary_set", "stream_id": "s1", "lang": "zh", "entries": 2}
    assert before["stable_text"] == offline(translator, SERVER)  # the server's only
    # From the next partial: the stream's own over the server's, its "Tom" winning.
    assert "爱丽丝" in first["stable_text"] + first["unstable_text"]
    assert after["stable_text"] == offline(translator, merged([SERVER, own]))
    assert "爱丽丝" in after["stable_text"] and "报纸" in after["stable_text"]
    assert "杰克" not in after["stable_text"]
    assert terms == {"zh": (3, 3)}  # Tom in the first final, Tom and book in the second


@pytest.mark.anyio
async def test_sent_before_the_first_partial_it_applies_to_it(translator: Translator) -> None:
    async with serving(translator) as server, connect(ws_url(server)) as ws:
        await ws.send(set_glossary("s1", OWN))
        assert (await recv(ws))["type"] == "glossary_set"
        await ws.send(partial_message("s1", 0, TEXT, final=True))
        final = await final_of(ws)
    assert final["stable_text"] == offline(translator, merged([SERVER, Glossary.parse(OWN)]))


@pytest.mark.anyio
async def test_refusals_leave_the_stream_going(translator: Translator) -> None:
    async with (
        serving(translator) as server,
        connect(ws_url(server)) as ws,
        connect(ws_url(server)) as viewer,
        connect(ws_url(server)) as other,
    ):
        await ws.send(partial_message("s1", 0, "Tom reads", final=False))
        await recv(ws)
        replies = []
        for text in (
            "en\tzh\nTom\t爱丽丝\n\tx\n",  # a bad line
            "en\tfr\nTom\tThomas\n",  # a language the server does not translate into
            "en\tzh\n" + "# padding\n" * (MAX_GLOSSARY_BYTES // 10 + 1),  # too large
        ):
            await ws.send(set_glossary("s1", text))
            replies.append(await recv(ws))
        await viewer.send(json.dumps({"type": "subscribe", "stream_id": "s1"}))
        await viewer.send(set_glossary("s1", OWN))
        while (refused := await recv(viewer))["type"] != "error":
            pass
        await other.send(set_glossary("s1", OWN))  # another writer's stream
        foreign = await recv(other)
        await ws.send(partial_message("s1", 1, TEXT, final=True))
        final = await final_of(ws)
    codes = [(r["type"], r.get("code"), r.get("field")) for r in replies]
    assert codes == [
        ("error", "invalid_message", "glossary"),
        ("error", "invalid_message", "glossary"),
        ("error", "too_large", "glossary"),
    ]
    assert replies[0]["message"] == "glossary:3: empty source term"
    assert "into 'fr', but the models translate into zh" in replies[1]["message"]
    assert f"the limit is {MAX_GLOSSARY_BYTES}" in replies[2]["message"]
    assert (refused["code"], refused["stream_id"]) == ("forbidden", "s1")
    assert "viewer" in refused["message"]
    assert foreign["code"] == "forbidden"
    assert final["stable_text"] == offline(translator, SERVER)  # nothing of the refused ones


# --- the embedding API, and two nodes on Redis ---------------------------------------------


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


async def final_update(sub: Subscription) -> TranslationUpdate:
    with anyio.fail_after(30):
        async for reply in sub:
            if isinstance(reply, TranslationUpdate) and reply.is_final:
                return reply
    raise AssertionError("no final")


async def left(nmt: IncrementalTranslator, writer: Owner) -> None:
    await nmt.wait_idle("s1")
    nmt.owner_left(writer)
    with anyio.fail_after(10):
        while "s1" in nmt.streams:
            await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_two_nodes_apply_the_same_stream_glossary(
    translator: Translator, redis: RedisServer
) -> None:
    x, y, z = Owner("x"), Owner("y"), Owner("z")
    own = merged([SERVER, Glossary.parse(OWN)])

    def bus() -> RedisBus:
        return RedisBus(redis.url, lease_ms=600)

    async with (
        IncrementalTranslator(translator, bus=bus(), glossaries=SERVER) as a,
        IncrementalTranslator(translator, bus=bus(), glossaries=SERVER) as b,
    ):
        mine = a.updates(owner=x)
        await a.push(PartialTranscript("s1", 0, 0, "Tom reads", is_final=False), x)
        ack = await a.set_glossary(SetGlossary("s1", OWN), x)
        await a.push(PartialTranscript("s1", 0, 1, TEXT, is_final=True), x)
        on_a = await final_update(mine)
        await left(a, x)  # the writer's connection drops; it comes back through node b
        theirs = b.updates(owner=y)
        await b.push(PartialTranscript("s1", 1, 2, TEXT, is_final=True), y)
        on_b = await final_update(theirs)
        # A restarted writer (seq 0 again: a new life) keeps the stream's glossary.
        await left(b, y)
        restarted = a.updates(owner=z)
        await a.push(PartialTranscript("s1", 0, 0, TEXT, is_final=True), z)
        on_restart = await final_update(restarted)
        assert a.stats["started_over"] == 1
        # Closing the stream ends it: the id opened anew has the server's only.
        await a.close_stream("s1", z)
        fresh = b.updates(owner=x)
        await b.push(PartialTranscript("s1", 0, 0, TEXT, is_final=True), x)
        on_fresh = await final_update(fresh)
    assert ack == GlossarySet("s1", "zh", 2)
    assert on_a.stable_text == on_b.stable_text == on_restart.stable_text
    assert on_a.stable_text == offline(translator, own)
    assert on_fresh.stable_text == offline(translator, SERVER)


@pytest.mark.anyio
async def test_embedding_api_refuses_another_owners_stream(translator: Translator) -> None:
    async with IncrementalTranslator(translator) as nmt:
        await nmt.push(PartialTranscript("s1", 0, 0, "Tom reads", is_final=False), Owner("x"))
        with pytest.raises(InvalidEvent) as refused:
            await nmt.set_glossary(SetGlossary("s1", OWN), Owner("y"))
        assert refused.value.error.code == "forbidden"
        ack = await nmt.set_glossary(SetGlossary("s1", "en\tzh\n"), Owner("x"))  # clears
        # One waiting for a stream its writer never opened is that writer's only.
        await nmt.set_glossary(SetGlossary("s2", OWN), Owner("x"))
        nmt.owner_left(Owner("x"))
        sub = nmt.updates(owner=Owner("y"))
        await nmt.push(PartialTranscript("s2", 0, 0, TEXT, is_final=True), Owner("y"))
        other = await final_update(sub)
    assert ack == GlossarySet("s1", "zh", 0)
    assert other.stable_text == offline(translator, None)


@pytest.mark.anyio
async def test_a_streams_terms_on_the_servers_terms_route(translator: Translator) -> None:
    """`/terms?stream=ID`: what `stream_terms` counts, for whoever may watch the stream."""
    from tests.live_server import http_get

    options = ServerOptions(
        port=0, limits=Limits(rate_limit=None), token="wr1te", viewer_token="v1ew"
    )
    async with (
        IncrementalTranslator(translator, glossaries=SERVER) as nmt,
        SubtitleServer(nmt, options) as server,
        connect(ws_url(server, "?token=wr1te")) as ws,
    ):
        await ws.send(set_glossary("s1", OWN))
        assert (await recv(ws))["type"] == "glossary_set"
        await ws.send(partial_message("s1", 0, TEXT, final=True))
        await final_of(ws)
        viewer = await http_get(server, "/terms?stream=s1&token=v1ew")
        writer = await http_get(server, "/terms?stream=s1", Authorization="Bearer wr1te")
        anyone = await http_get(server, "/terms?stream=s1")
        wrong = await http_get(server, "/terms?stream=s1&token=nope")
        other = await http_get(server, "/terms?stream=s2&token=v1ew")
        no_stream = await http_get(server, "/terms?token=v1ew")
        counted = nmt.stream_terms("s1")
    assert viewer.status == 200 and viewer.headers["Content-Type"] == "application/json"
    assert json.loads(viewer.body) == {
        "stream_id": "s1",
        "terms": {"zh": {"matched": 2, "placed": 2}},  # Tom and book, both placed
    }
    assert counted == {"zh": (2, 2)}
    assert writer.status == 200 and json.loads(writer.body) == json.loads(viewer.body)
    assert anyone.status == 401 and wrong.status == 401  # watching needs a token here
    assert other.status == 404 and "'s2' is not open" in other.body
    assert no_stream.status == 400


# --- a stream's counts on every node ---------------------------------------------------------


def counts_of(result: Any) -> dict[str, Any]:
    assert result.status == 200, result
    terms: dict[str, Any] = json.loads(result.body)["terms"]
    return terms


async def terms_on(server: SubtitleServer, token: str = "v1ew") -> Any:
    from tests.live_server import http_get

    return await http_get(server, f"/terms?stream=s1&token={token}")


async def gone(server: SubtitleServer) -> Any:
    """`/terms` for s1 until it answers 404 (a close mark is appended after the last reply)."""
    with anyio.fail_after(10):
        while (result := await terms_on(server)).status != 404:
            await anyio.sleep(0.02)
    return result


@pytest.mark.anyio
async def test_every_node_answers_a_streams_terms_from_the_bus(
    translator: Translator, redis: RedisServer
) -> None:
    """The writer on node A; `/terms` asked on node B answers A's counts, with the same
    token rules; a writer back through B after a drop, then restarted (seq 0) on A,
    counts on from them; closing the stream ends them on both nodes."""
    from tests.live_server import http_get

    options = ServerOptions(
        port=0, limits=Limits(rate_limit=None), token="wr1te", viewer_token="v1ew"
    )
    two = {"zh": {"matched": 2, "placed": 2}}  # Tom and book, both placed, per final
    async with (
        IncrementalTranslator(translator, bus=RedisBus(redis.url, lease_ms=600)) as nmt_a,
        IncrementalTranslator(translator, bus=RedisBus(redis.url, lease_ms=600)) as nmt_b,
        SubtitleServer(nmt_a, options) as a,
        SubtitleServer(nmt_b, options) as b,
    ):
        assert (await terms_on(b)).status == 404  # no node has it open yet
        async with connect(ws_url(a, "?token=wr1te")) as ws:
            await ws.send(set_glossary("s1", OWN))
            assert (await recv(ws))["type"] == "glossary_set"
            await ws.send(partial_message("s1", 0, "Tom reads", final=False))
            await ws.send(partial_message("s1", 1, TEXT, final=True))
            await final_of(ws)
            on_a, on_b = await terms_on(a), await terms_on(b)
            writer_b = await http_get(b, "/terms?stream=s1", Authorization="Bearer wr1te")
            anyone_b = await http_get(b, "/terms?stream=s1")
            wrong_b = await terms_on(b, "nope")
            other_b = await http_get(b, "/terms?stream=s2&token=v1ew")
            assert nmt_b.stream_terms("s1") == {}  # not open on B: B read the bus
        with anyio.fail_after(10):  # the writer dropped: handed over, counts kept
            while "s1" in nmt_a.streams:
                await anyio.sleep(0.02)
        kept = await terms_on(b)
        async with connect(ws_url(b, "?token=wr1te")) as ws:  # back, through node B
            await ws.send(partial_message("s1", 2, TEXT, final=True, segment=1))
            await final_of(ws)
            after_takeover = await terms_on(a)
        with anyio.fail_after(10):
            while "s1" in nmt_b.streams:
                await anyio.sleep(0.02)
        async with connect(ws_url(a, "?token=wr1te")) as ws:  # restarted: seq 0 again
            await ws.send(partial_message("s1", 0, TEXT, final=True))
            await final_of(ws)
            after_restart = await terms_on(b)
            await ws.send(json.dumps({"type": "close_stream", "stream_id": "s1"}))
            closed_b, closed_a = await gone(b), await gone(a)
        assert nmt_a.stats["started_over"] == 1
    assert counts_of(on_a) == counts_of(on_b) == counts_of(writer_b) == two
    assert anyone_b.status == 401 and wrong_b.status == 401
    assert other_b.status == 404 and "'s2' is not open" in other_b.body
    assert counts_of(kept) == two
    assert counts_of(after_takeover) == {"zh": {"matched": 4, "placed": 4}}
    assert counts_of(after_restart) == {"zh": {"matched": 6, "placed": 6}}
    assert closed_a.status == closed_b.status == 404


@pytest.mark.anyio
async def test_a_handed_over_stream_keeps_its_counts_in_one_process(
    translator: Translator,
) -> None:
    """The in-process bus: a stream whose writer left keeps its counts (`terms`) and a
    writer back counts on from them; a closed one has none."""
    x, y = Owner("x"), Owner("y")
    async with IncrementalTranslator(translator, glossaries=SERVER) as nmt:
        mine = nmt.updates(owner=x)
        await nmt.push(PartialTranscript("s1", 0, 0, TEXT, is_final=True), x)
        await final_update(mine)
        await left(nmt, x)
        kept = await nmt.terms("s1")
        theirs = nmt.updates(owner=y)
        await nmt.push(PartialTranscript("s1", 1, 1, TEXT, is_final=True), y)
        await final_update(theirs)
        on = await nmt.terms("s1"), nmt.stream_terms("s1")
        await nmt.close_stream("s1", y)
        closed = await nmt.terms("s1")
    assert kept == {"zh": (1, 1)}  # Tom, the server's glossary's one term
    assert on == ({"zh": (2, 2)}, {"zh": (2, 2)})
    assert closed == {}
