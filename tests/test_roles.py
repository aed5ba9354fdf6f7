"""Roles: the writer's secret (`--token`) is not the viewers'.

A subtitle page is shown to an audience, so what it carries must not let anyone take the
stream over as its writer: `--viewer-token` (or, without it, anyone) watches, `--token`
writes, `--stream-key` writes one stream, `--metrics-token` reads /metrics; a viewer
credential never writes, closes or takes over a stream, and the page URL the server
prints holds no writer secret.
"""

from __future__ import annotations

import json
import re
import signal
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import ClientConnection, connect

from engine.decoding.translator import Translator
from engine.server.connection import Close, ConnectionCore, Push, Reply, Watch
from engine.server.credentials import Access, Credentials
from engine.server.limits import Limits
from engine.server.state import ServerState
from tests.conftest import FIXTURE_MODEL, needs_fixture, partial_message, wait_for
from tests.live_server import (
    http_get,
    recv,
    refused_with,
    send_sentence,
    serving,
    until_final,
    ws_url,
)

SECRETS = Credentials(writer="w", viewer="v", stream_keys={"k": "key-k"}, metrics="m")


def test_each_credential_gets_its_rights() -> None:
    writer, viewer, key = SECRETS.access("w"), SECRETS.access("v"), SECRETS.access("key-k")
    assert writer is not None and viewer is not None and key is not None
    assert writer.may_write("s") and writer.may_write("k") and writer.may_view("s")
    assert viewer.may_view("s") and not viewer.may_write("s") and not viewer.may_write("k")
    assert key.may_write("k") and not key.may_write("s") and key.may_view("k")
    assert not key.may_view("s")  # viewing needs the viewer token here
    assert SECRETS.access(None) is None  # nobody anonymous: both roles have secrets
    assert SECRETS.access("wrong") is None
    # Only the writer's secret: anyone watches, nobody else writes.
    public = Credentials(writer="w").access(None)
    assert public is not None and public.may_view("s") and not public.may_write("s")
    assert Credentials(writer="w").access("nope") is None  # a wrong secret is refused
    # No secrets at all: everyone does everything, a token sent is ignored.
    assert Credentials().access("whatever") == Access()
    # Keys alone: anyone writes the streams without a key, nobody but the key its stream.
    keys = Credentials(stream_keys={"k": "key-k"}).access(None)
    assert keys is not None and keys.may_write("s") and not keys.may_write("k")


def test_metrics_has_its_own_guard() -> None:
    assert SECRETS.metrics_allowed("m")
    assert not SECRETS.metrics_allowed("w") and not SECRETS.metrics_allowed("v")
    assert Credentials(writer="w").metrics_allowed("w")
    assert not Credentials(writer="w", viewer="v").metrics_allowed("v")
    assert Credentials(viewer="v").metrics_allowed(None)


def test_secrets_that_would_mix_roles_are_refused() -> None:
    with pytest.raises(ValueError, match="viewer token must differ"):
        Credentials(writer="same", viewer="same")
    with pytest.raises(ValueError, match="viewer token must differ"):
        Credentials(viewer="same", stream_keys={"k": "same"})
    with pytest.raises(ValueError, match="writer token"):
        Credentials(writer="same", stream_keys={"k": "same"})
    with pytest.raises(ValueError, match="stream_id"):
        Credentials(stream_keys={"a\x00b": "key"})
    with pytest.raises(ValueError, match="empty"):
        Credentials(viewer="")
    # Stream ids are compared as the server compares them: in NFC.
    assert set(Credentials(stream_keys={"cafe\u0301": "x"}).stream_keys) == {"caf\u00e9"}


def test_a_viewer_credential_can_never_write_close_or_take_over() -> None:
    viewer = SECRETS.access("v")
    assert viewer is not None
    core = ConnectionCore(1, Limits(rate_limit=None), ServerState(), access=viewer)
    close = json.dumps({"type": "close_stream", "stream_id": "s"})
    frames = [(partial_message("s", 0), False), (partial_message("s", 1, final=True), True)]
    for frame, final in frames:
        reply = core.receive(frame, 0)
        assert isinstance(reply, Reply) and reply.error.code == "unauthorized"
        assert reply.about_final is final  # a final still gets its one reply
    reply = core.receive(close, 0)
    assert isinstance(reply, Reply) and reply.error.code == "unauthorized"
    assert isinstance(core.receive(json.dumps({"type": "subscribe", "stream_id": "s"}), 0), Watch)
    key = SECRETS.access("key-k")
    assert key is not None
    keyed = ConnectionCore(2, Limits(rate_limit=None), ServerState(), access=key)
    assert isinstance(keyed.receive(partial_message("k", 0), 0), Push)
    reply = keyed.receive(partial_message("other", 0), 0)
    assert isinstance(reply, Reply) and reply.error.code == "unauthorized"
    assert isinstance(keyed.receive(close.replace('"s"', '"k"'), 0), Close)


def _bearer(token: str) -> dict[str, Any]:
    return {"additional_headers": {"Authorization": f"Bearer {token}"}}


async def _errors_until(ws: ClientConnection, seq: int) -> list[dict[str, Any]]:
    """Replies until one about `seq`."""
    got = []
    while True:
        reply = await recv(ws)
        got.append(reply)
        if reply.get("seq") == seq:
            return got


@pytest.mark.anyio
async def test_over_the_wire_a_viewer_watches_and_cannot_write(translator: Translator) -> None:
    secrets = {"token": "w", "viewer_token": "v", "stream_keys": {"k": "key-k"}}
    async with (
        serving(translator, **secrets, metrics_token="m") as server,
        connect(ws_url(server, "?token=v")) as viewer,
    ):
        engine = server.engine
        assert engine is not None
        with refused_with(401):  # nobody anonymous: both roles have secrets
            async with connect(ws_url(server)):
                pass
        await viewer.send(json.dumps({"type": "subscribe", "stream_id": "s1"}))
        await wait_for(lambda: server.role_counts()["viewer"] == 1)
        async with connect(ws_url(server), **_bearer("w")) as writer:
            await send_sentence(writer)
            final = (await until_final(writer))[-1]
            assert (await until_final(viewer))[-1] == final  # it watches
            # ...and cannot write, close or take over (its role would not let it either,
            # so a second viewer connection that never subscribed tries).
            async with connect(ws_url(server, "?token=v")) as intruder:
                await intruder.send(partial_message("s1", 50, "I will go home", final=True))
                await intruder.send(json.dumps({"type": "close_stream", "stream_id": "s1"}))
                replies = [await recv(intruder), await recv(intruder)]
                assert [r["code"] for r in replies] == ["unauthorized", "unauthorized"]
                assert replies[0]["seq"] == 50  # the final's one reply
                assert "s1" in engine.streams
                await writer.close()  # the writer leaves: s1 is free to take over
                await wait_for(lambda: "s1" not in engine.streams)
                await intruder.send(partial_message("s1", 0, "I will go home", final=True))
                (reply,) = await _errors_until(intruder, 0)
                assert reply["code"] == "unauthorized"
                await anyio.sleep(0.2)
                assert "s1" not in engine.streams  # never opened again
        # A stream key writes its stream alone.
        async with connect(ws_url(server), **_bearer("key-k")) as keyed:
            await keyed.send(partial_message("s2", 0, "Tom reads a book", final=True))
            (reply,) = await _errors_until(keyed, 0)
            assert reply["code"] == "unauthorized"
            await send_sentence(keyed, "k")
            assert (await until_final(keyed, "k"))[-1]["is_final"]
        # /metrics is guarded apart: neither the viewer's nor the writer's secret opens it.
        for token, status in [("v", 401), ("w", 401), ("key-k", 401), ("m", 200)]:
            got = await http_get(server, "/metrics", Authorization=f"Bearer {token}")
            assert got.status == status, token


@pytest.mark.anyio
async def test_with_only_the_writer_token_anyone_may_watch(translator: Translator) -> None:
    async with (
        serving(translator, token="w") as server,
        connect(ws_url(server)) as viewer,
        connect(ws_url(server), **_bearer("w")) as writer,
    ):
        await viewer.send(json.dumps({"type": "subscribe", "stream_id": "s1"}))
        await wait_for(lambda: server.role_counts()["viewer"] == 1)
        await send_sentence(writer)
        assert (await until_final(viewer))[-1]["is_final"]
        async with connect(ws_url(server)) as anonymous:
            await anonymous.send(partial_message("s9", 0, "I will", final=True))
            (reply,) = await _errors_until(anonymous, 0)
            assert reply["code"] == "unauthorized" and "writer token" in reply["message"]
        assert (await http_get(server, "/metrics")).status == 401
        assert (await http_get(server, "/metrics", Authorization="Bearer w")).status == 200


def test_the_page_url_the_server_prints_never_holds_the_writer_secret() -> None:
    """`serve --token W --viewer-token V`: the page URL carries V, W appears nowhere in
    the log; without a viewer token the URL carries no token at all."""
    from tests.conftest import serving as serve

    needs_fixture()
    args = ["--model", str(FIXTURE_MODEL), "--token", "Wr1ter-s3cret"]
    for extra, want in [(["--viewer-token", "v1ewer"], "&token=v1ewer"), ([], "")]:
        with serve([*args, *extra], ready_within=60) as served:
            page = re.search(r"subtitle page: (\S+) \(any stream id\)", served.text)
            assert page, served.text
            assert page.group(1).endswith(f"/?stream=demo{want}"), page.group(1)
            assert "Wr1ter-s3cret" not in served.text
            assert "roles: writers --token; viewers " in served.text
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(timeout=30) == 0
