"""examples/replay_client.py: the page URL it prints, `--stream-id`, what counts as a lost
final, and reconnecting (resending unanswered finals) against tiny fake servers."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

import protocol
from protocol import Backoff, ErrorCode, ErrorMessage, PartialTranscript, TranslationUpdate
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))
from replay_client import page_url, read_log, renamer

LOGS = ROOT / "examples" / "logs"


def test_page_url_follows_the_websocket_url() -> None:
    assert page_url("ws://127.0.0.1:8765/ws", "mic-1") == "http://127.0.0.1:8765/?stream=mic-1"
    assert page_url("wss://subs.example:8443/ws", "a b", "s3cret") == (
        "https://subs.example:8443/?stream=a+b&token=s3cret"
    )


def test_stream_id_renames_one_stream_or_prefixes_several() -> None:
    one = read_log(LOGS / "fixture_en_zh.jsonl")
    renamed = read_log(LOGS / "fixture_en_zh.jsonl", renamer(one, "mic-1"))
    assert {line.event.stream_id for line in renamed} == {"mic-1"}
    assert [line.event.text for line in renamed] == [line.event.text for line in one]
    two = read_log(LOGS / "fixture_two_streams.jsonl")
    renamed = read_log(LOGS / "fixture_two_streams.jsonl", renamer(two, "talk"))
    assert {line.event.stream_id for line in renamed} == {"talk-left", "talk-right"}
    assert renamer(one, None)("s1") == "s1"


def test_a_final_is_lost_in_each_language_that_did_not_answer_it() -> None:
    """With fan-out a writer hears every language: a final counts as answered in a
    language by its final update there, or by an error about that language or about the
    message itself (no language)."""
    from replay_client import ReplayResult

    result = ReplayResult(finals_expected={("s", 3), ("s", 7), ("s", 9)})
    assert result.lost_finals == {("s", 3, None), ("s", 7, None), ("s", 9, None)}
    result.languages |= {"zh", "de"}
    result.finals_received |= {("s", 3, "zh"), ("s", 3, "de"), ("s", 7, "zh")}
    result.finals_refused |= {("s", 9, None)}  # refused as a message: every language
    assert result.lost_finals == {("s", 7, "de")}
    result.finals_refused.add(("s", 7, "de"))  # the German model failed on it
    assert result.lost_finals == set()


# --- reconnecting: against a tiny fake server --------------------------------------------


def _line(ms: float, seq: int, text: str, final: bool, segment: int = 0) -> Any:
    from replay_client import LogLine

    return LogLine(ms, PartialTranscript("s", segment, seq, text, final))


def _answer(event: PartialTranscript) -> str:
    return protocol.serialize(
        TranslationUpdate(
            event.stream_id,
            event.segment_id,
            event.seq,
            event.text if event.is_final else "",
            "" if event.is_final else event.text,
            event.is_final,
            1.0,
            1.0,
        )
    )


@contextlib.asynccontextmanager
async def _fake(
    first_final: Callable[[ServerConnection, PartialTranscript], Awaitable[None]],
    *,
    twice: bool = False,
    down_for: float = 0.0,
) -> AsyncIterator[tuple[str, list[list[PartialTranscript]]]]:
    """A server whose first connection meets its first final with `first_final` and says
    nothing more; later connections answer every event (`twice`: each final twice).
    `down_for`: after the first connection ends, handshakes get 503 for that long."""
    received: list[list[PartialTranscript]] = []
    first_ended: list[float] = []

    def gate(connection: ServerConnection, request: Request) -> Response | None:
        if first_ended and time.monotonic() < first_ended[0] + down_for:
            return connection.respond(503, "restarting\n")
        return None

    async def handler(ws: ServerConnection) -> None:
        n = len(received)
        received.append([])
        try:
            async for data in ws:
                event = protocol.parse(data)
                if not isinstance(event, PartialTranscript):
                    continue
                received[n].append(event)
                if n == 0 and event.is_final:
                    await first_final(ws, event)
                    return
                for _ in range(2 if twice and event.is_final else 1):
                    await ws.send(_answer(event))
        finally:
            if n == 0:
                first_ended.append(time.monotonic())

    async with serve(handler, "127.0.0.1", 0, process_request=gate) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}/ws", received


async def _restart(ws: ServerConnection, event: PartialTranscript) -> None:
    await ws.close(1012, "service restart")


async def _unavailable(ws: ServerConnection, event: PartialTranscript) -> None:
    error = ErrorMessage(ErrorCode.UNAVAILABLE, "no store", None, event.stream_id, event.seq)
    await ws.send(protocol.serialize(error))


QUICK = Backoff(first=0.02, most=0.1, total=5.0)


@pytest.mark.anyio
async def test_replay_resends_a_final_closed_on_and_goes_on_with_the_log() -> None:
    from replay_client import replay, summary

    lines = [
        _line(0, 0, "I", False),
        _line(10, 1, "I will", True),
        _line(300, 2, "Tom", False, 1),
        _line(310, 3, "Tom reads", True, 1),
    ]
    events: list[str] = []
    async with _fake(_restart) as (url, received):
        result = await replay(url, lines, backoff=QUICK, on_event=events.append)
    assert result.lost_finals == set() and result.finals_refused == set()
    assert [(u.seq, u.is_final) for u in result.updates if u.is_final] == [(1, True), (3, True)]
    # The final went again first on the new connection, with its ids and text.
    assert received[1][0] == lines[1].event
    assert result.disconnects == ["close 1012 service restart"] and not result.gave_up
    assert (result.reconnects, result.resent, result.duplicates) == (1, 1, 0)
    assert result.sent + result.skipped == 4  # the partial is skipped if the reconnect is slow
    assert events[0] == "reconnecting (close 1012 service restart)"
    assert "1 reconnect(s), 1 final(s) resent, 0 duplicate update(s)" in summary(result)


@pytest.mark.anyio
async def test_replay_an_unavailable_final_is_resent_not_refused_and_duplicates_drop() -> None:
    from replay_client import replay

    lines = [_line(0, 0, "I", False), _line(10, 1, "I will", True)]
    async with _fake(_unavailable, twice=True) as (url, _):
        result = await replay(url, lines, backoff=QUICK)
    assert result.lost_finals == set() and result.finals_refused == set()
    assert [e.code for e in result.errors] == ["unavailable"]
    assert [u.seq for u in result.updates if u.is_final] == [1]  # shown once
    assert result.duplicates == 1 and result.disconnects == ["unavailable: no store"]


@pytest.mark.anyio
async def test_replay_skips_partials_that_fell_due_while_away_but_never_a_final() -> None:
    from replay_client import replay

    lines = [
        _line(0, 0, "I will", True),
        *[_line(50 * i, i, "Tom " * i, False, 1) for i in range(1, 5)],
        _line(900, 5, "Tom reads", True, 1),
    ]
    async with _fake(_restart, down_for=0.4) as (url, received):
        result = await replay(url, lines, backoff=QUICK)
    assert result.lost_finals == set()
    assert result.skipped >= 3 and result.sent == len(lines) - result.skipped
    again = received[-1]
    assert again[0] == lines[0].event and again[-1] == lines[-1].event
    assert len([e for e in again if not e.is_final]) <= 1  # at most the latest partial


@pytest.mark.anyio
async def test_replay_gives_up_after_reconnect_for_and_counts_what_was_lost() -> None:
    from replay_client import replay, summary

    lines = [_line(0, 0, "I will", True), _line(400, 1, "Tom", True, 1)]
    async with _fake(_restart, down_for=60.0) as (url, _):
        result = await replay(url, lines, backoff=Backoff(0.02, 0.05, 0.2))
    assert result.gave_up and result.reconnects == 0
    assert result.lost_finals == {("s", 0, None), ("s", 1, None)}  # sent, and never sent
    assert "then gave up" in summary(result)


@pytest.mark.anyio
async def test_replay_nothing_listening_raises_the_connection_error() -> None:
    from replay_client import replay

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        await replay(f"ws://127.0.0.1:{port}/ws", [], backoff=Backoff(0.01, 0.02, 0.1))


# --- what the client prints ----------------------------------------------------------------

CLIENT = ROOT / "examples" / "replay_client.py"


def _client(log: Path, url: str, *args: str) -> list[str]:
    return [sys.executable, str(CLIENT), str(log), "--url", url, *args]


def _client_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_an_update_is_a_line_with_its_language_and_source_plain_off_a_terminal() -> None:
    from replay_client import format_message

    heard = "i will meet tom at three"
    partial = TranslationUpdate(
        "demo", 2, 7, "我三点", "见汤姆", False, 120.0, 80.0, source_text=heard, lang="zh"
    )
    plain = format_message(partial, color=False)
    assert "\x1b" not in plain
    assert plain.endswith(f"zh  我三点[见汤姆]  <- {heard}")
    final = dataclasses.replace(
        partial, stable_text="我三点见汤姆", unstable_text="", is_final=True
    )
    assert format_message(final, color=False).endswith(f"zh  我三点见汤姆  <- {heard}")
    colored = format_message(partial, color=True)
    assert "\x1b[2;3m见汤姆\x1b[0m" in colored and "[见汤姆]" not in colored
    german = dataclasses.replace(final, stable_text="Ich treffe Tom um drei", lang="de")
    assert "de  Ich treffe Tom um drei" in format_message(german, color=False)


@pytest.mark.anyio
async def test_the_client_writes_plain_lines_into_a_file(tmp_path: Path) -> None:
    """stdout not a terminal: every update on its line, no escape codes, languages named."""
    log = tmp_path / "log.jsonl"
    log.write_text(
        '{"type": "partial_transcript", "stream_id": "s", "segment_id": 0, "seq": 0, '
        '"text": "I will", "is_final": false, "emit_ms": 0}\n'
        '{"type": "partial_transcript", "stream_id": "s", "segment_id": 0, "seq": 1, '
        '"text": "I will meet Tom", "is_final": true, "emit_ms": 50}\n'
    )

    async def handler(ws: ServerConnection) -> None:
        async for data in ws:
            event = protocol.parse(data)
            if isinstance(event, PartialTranscript):
                for lang in ("zh", "de"):
                    tail = "" if event.is_final else "…"
                    update = TranslationUpdate(
                        event.stream_id, 0, event.seq, lang.upper(), tail, event.is_final,
                        1.0, 1.0, source_text=event.text, lang=lang,
                    )  # fmt: skip
                    await ws.send(protocol.serialize(update))

    async with serve(handler, "127.0.0.1", 0) as server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/ws"
        done = await anyio.run_process(_client(log, url), env=_client_env(), check=False)
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    assert "\x1b" not in out
    lines = out.splitlines()
    assert len(lines) == 4
    assert lines[0].endswith("zh  ZH[…]  <- I will") and lines[1].endswith("de  DE[…]  <- I will")
    assert lines[3].startswith("FINAL") and lines[3].endswith("de  DE  <- I will meet Tom")


def test_the_client_says_at_once_that_it_waits_for_a_server_and_for_how_long() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"ws://127.0.0.1:{s.getsockname()[1]}/ws"
    log = LOGS / "fixture_en_zh.jsonl"
    with subprocess.Popen(
        _client(log, url, "--reconnect-for", "4"),
        env=_client_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as client:
        assert client.stderr is not None
        said = [client.stderr.readline() for _ in range(2)]  # the page URL, then the wait
        still_waiting = client.poll() is None
        rest = client.stderr.read()
    assert said[0].startswith("subtitle page: ")
    assert f"no server answers at {url} yet" in said[1] and "waiting up to 4 s" in said[1]
    assert "nmt-incremental serve --model" in said[1]
    assert still_waiting  # said before giving up, not after
    assert client.returncode == 2
    assert rest.startswith(f"error: cannot connect to {url}: ") and "(tried for" in rest
