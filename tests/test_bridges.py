"""Bridges (engine/bridges): recognisers' servers to `nmt-incremental serve`.

First each kind's mapper on its recorded message sequence (tests/fixtures/bridges/, written
from the recogniser's source; see the README there): the exact events. Then end to end:
a fake recogniser server on loopback replays the same sequence (dropping the connection
mid-segment where the recording says so), the bridge streams audio to it or relays a
client, and a real `SubtitleServer` with the fixture model translates: every final comes
back translated, the interrupted segment's too, and nothing the recogniser finished is
lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import wave
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

import protocol
from engine.bridges.audio import AudioSource
from engine.bridges.cloud import Dialect
from engine.bridges.errors import BridgeError
from engine.bridges.events import EventWriter, Interrupted
from engine.bridges.kinds import Kind, MapperOptions, make_mapper
from engine.bridges.options import BridgeOptions, BridgeResult
from engine.bridges.runner import Bridge
from engine.bridges.whisper_streaming import LineSplitter, Segmentation
from engine.bridges.whisperlive import WhisperLiveMapper, float32_audio
from engine.cli.bridge import add_bridge_parser, bridge_options, exit_status, run_bridge
from engine.decoding.translator import Translator
from engine.glossary import Glossary
from engine.server.app import SubtitleServer
from engine.server.limits import Limits
from protocol import Backoff, ErrorMessage, PartialTranscript
from tests.live_server import STREAMING, serving

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "bridges"
QUICK = Backoff(first=0.02, most=0.1, total=5.0)

Event = tuple[int, int, str, bool, float | None, float | None, int | None]
"""(segment_id, seq, text, is_final, start_ms, end_ms, stable_chars)"""


def steps(name: str) -> list[dict[str, Any]]:
    """The recording's lines (comments left out)."""
    lines = (FIXTURES / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip() and not line.startswith("#")]


def sessions(name: str) -> list[list[str]]:
    """The messages of each connection, as the server sends them (split at disconnects)."""
    out: list[list[str]] = [[]]
    for step in steps(name):
        if "disconnect" in step:
            out.append([])
        else:
            message = step["send"]
            out[-1].append(message if isinstance(message, str) else json.dumps(message))
    return out


def mapped(kind: Kind, name: str, **options: Any) -> list[Event]:
    """The recording through a fresh mapper: each disconnect and the end close the
    session."""
    mapper = make_mapper(kind, "s", MapperOptions(**options))
    if isinstance(mapper, WhisperLiveMapper):
        mapper.uid = "UID"
    events: list[PartialTranscript] = []
    for i, messages in enumerate(sessions(name)):
        if i:
            events += mapper.end_session()
        for message in messages:
            events += mapper.feed(message)
    events += mapper.end_session()
    return [as_tuple(event) for event in events]


def as_tuple(e: PartialTranscript) -> Event:
    return (e.segment_id, e.seq, e.text, e.is_final, e.start_ms, e.end_ms, e.stable_chars)


# --- the mappers, on the recordings ---------------------------------------------------------

WHISPERLIVE: list[Event] = [
    (0, 0, "I will", False, 0.0, 1100.0, None),
    (0, 1, "I will meet Tom", False, 0.0, 1900.0, None),
    (0, 2, "I will meet Tom at three.", True, 0.0, 2600.0, None),
    (1, 3, "Tom reads", False, 2600.0, 3300.0, None),
    (1, 4, "Tom reads a book", False, 2600.0, 4000.0, None),
    (1, 5, "Tom reads a book", True, 2600.0, 4000.0, None),  # cut off: its last partial
    (2, 6, "Lucy meets", False, 4000.0, 4800.0, None),
    (2, 7, "Lucy meets my friend.", True, 4000.0, 5700.0, None),
    (3, 8, "Does Tom", False, 5700.0, 6300.0, None),
    (3, 9, "Does Tom draw a horse?", True, 5700.0, 7100.0, None),
]

VOSK: list[Event] = [
    (0, 0, "i will", False, None, None, None),
    (0, 1, "i will meet tom", False, None, None, None),
    (0, 2, "i will meet tom at three", True, 210.0, 2010.0, None),
    (1, 3, "the", False, None, None, None),  # then an empty result: abandoned
    (2, 4, "tom reads", False, None, None, None),
    (2, 5, "tom reads a book", False, None, None, None),
    (2, 6, "tom reads a book", True, None, None, None),  # cut off: its last partial
    (3, 7, "lucy meets", False, None, None, None),
    (3, 8, "lucy meets my friend", False, None, None, None),
    (3, 9, "lucy meets my friend", True, 2310.0, 3510.0, None),
]

WHISPER_STREAMING: list[Event] = [
    (0, 0, "I will meet", False, 0.0, 1180.0, 11),
    (0, 1, "I will meet Tom at three.", True, 0.0, 2284.444, None),  # split inside a line
    (1, 2, "Tom", False, 2284.444, 2600.0, 3),
    (1, 3, "Tom reads a book", False, 2284.444, 3400.0, 16),
    (1, 4, "Tom reads a book", True, 2284.444, 3400.0, None),  # 1.5 s pause
    (2, 5, "Lucy meets my friend", False, 4900.0, 6100.0, 20),
    (2, 6, "Lucy meets my friend", True, 4900.0, 6100.0, None),  # cut off: committed
    (3, 7, "Does Tom draw", False, 6100.0, 7000.0, 13),
    (3, 8, "Does Tom draw a horse?", True, 6100.0, 7600.0, None),
    (4, 9, "Peter will find", False, 7800.0, 8600.0, 15),
    (4, 10, "Peter will find", True, 7800.0, 8600.0, None),  # the end
]

SIMULSTREAMING: list[Event] = [
    (0, 0, "I will", False, 332.0, 832.0, 6),
    (0, 1, "I will meet Tom", False, 332.0, 1712.0, 15),
    (0, 2, "I will meet Tom", True, 332.0, 1712.0, None),  # is_final: the voice ended
    (1, 3, "Lucy meets", False, 4200.0, 4900.0, 10),
    (1, 4, "Lucy meets, my friend.", True, 4200.0, 5400.0, None),  # glued ", my"
]

GOOGLE: list[Event] = [
    (0, 0, "I will", False, 0.0, 900.0, 0),
    (0, 1, "I will meet Tom", False, 0.0, 1600.0, 11),  # "I will meet" at stability 0.9
    (0, 2, "I will meet Tom at three", True, 0.0, 2450.0, None),
    (1, 3, "Tom reads", False, 2450.0, 3200.0, 0),
    (1, 4, "Tom reads a book", False, 2450.0, 3800.0, 9),
    (1, 5, "Tom reads a book", True, 2450.0, 3800.0, None),  # cut off
    (2, 6, "Lucy meets", False, 3800.0, 4500.0, 0),
    (2, 7, "Lucy meets my friend", True, 3800.0, 5300.0, None),
]

DEEPGRAM: list[Event] = [
    (0, 0, "I will", False, 0.0, 1000.0, 0),
    (0, 1, "I will meet Tom", False, 0.0, 1400.0, 15),  # an is_final window: settled
    (0, 2, "I will meet Tom at", False, 0.0, 2000.0, 15),
    (0, 3, "I will meet Tom at three", True, 0.0, 2400.0, None),  # speech_final
    (1, 4, "Tom reads", False, 2400.0, 3200.0, 9),
    (1, 5, "Tom reads a book", False, 2400.0, 3700.0, 9),
    (1, 6, "Tom reads a book", True, 2400.0, 3700.0, None),  # cut off
    (2, 7, "Lucy meets my friend", False, 3700.0, 5200.0, 20),
    (2, 8, "Lucy meets my friend", True, 3700.0, 5200.0, None),  # UtteranceEnd
]

AZURE: list[Event] = [
    (0, 0, "I will", False, 300.0, 900.0, None),
    (0, 1, "I will meet Tom", False, 300.0, 1700.0, None),
    (0, 2, "I will meet Tom at three.", True, 300.0, 2500.0, None),
    (1, 3, "Tom", False, 2700.0, 3100.0, None),
    (1, 4, "Tom reads a book", False, 2700.0, 3900.0, None),  # the service's own JSON
    (1, 5, "Tom reads a book", True, 2700.0, 3900.0, None),  # cut off
    (2, 6, "Lucy meets", False, 4500.0, 5200.0, None),  # after a NoMatch: nothing
    (2, 7, "Lucy meets my friend.", True, 4500.0, 6000.0, None),
]


@pytest.mark.parametrize(
    ("kind", "name", "options", "expected"),
    [
        (Kind.WHISPERLIVE, "whisperlive.jsonl", {}, WHISPERLIVE),
        (Kind.VOSK, "vosk.jsonl", {}, VOSK),
        (Kind.WHISPER_STREAMING, "whisper_streaming.jsonl", {}, WHISPER_STREAMING),
        (Kind.WHISPER_STREAMING, "simulstreaming.jsonl", {}, SIMULSTREAMING),
        (Kind.CLOUD, "cloud_google.jsonl", {"dialect": Dialect.GOOGLE}, GOOGLE),
        (Kind.CLOUD, "cloud_deepgram.jsonl", {"dialect": Dialect.DEEPGRAM}, DEEPGRAM),
        (Kind.CLOUD, "cloud_azure.jsonl", {"dialect": Dialect.AZURE}, AZURE),
    ],
    ids=[
        "whisperlive",
        "vosk",
        "whisper-streaming",
        "simulstreaming",
        "google",
        "deepgram",
        "azure",
    ],
)
def test_each_recording_maps_to_its_events(
    kind: Kind, name: str, options: dict[str, Any], expected: list[Event]
) -> None:
    assert mapped(kind, name, **options) == expected


def test_drop_keeps_only_what_the_recogniser_committed() -> None:
    """`--interrupted drop`: a cut-off segment's uncommitted hypothesis is abandoned (no
    final, the next segment takes the next id); committed text is still a final."""
    whisperlive = mapped(Kind.WHISPERLIVE, "whisperlive.jsonl", interrupted=Interrupted.DROP)
    assert [e[2] for e in whisperlive if e[3]] == [
        "I will meet Tom at three.",
        "Lucy meets my friend.",
        "Does Tom draw a horse?",
    ]
    assert whisperlive[5] == (2, 5, "Lucy meets", False, 4000.0, 4800.0, None)
    deepgram = mapped(
        Kind.CLOUD, "cloud_deepgram.jsonl", dialect=Dialect.DEEPGRAM, interrupted=Interrupted.DROP
    )
    assert deepgram[6] == (1, 6, "Tom reads", True, 2400.0, 3700.0, None)  # the settled part
    streaming = mapped(
        Kind.WHISPER_STREAMING, "whisper_streaming.jsonl", interrupted=Interrupted.DROP
    )
    assert streaming == WHISPER_STREAMING  # all of it was committed


def test_the_writer_keeps_the_protocols_rules() -> None:
    writer = EventWriter("s")
    assert writer.partial("") == []  # nothing to say yet
    assert writer.partial(" hello ", 100, 50, 3)[0].text == "hello"  # stripped, end >= start
    assert writer.partial("hello", stable_chars=2) == []  # unchanged: not sent again
    assert writer.final("") == []  # an empty end abandons: no empty final exists
    assert (writer.segment_id, writer.abandoned, writer.seq) == (1, 1, 1)
    (final,) = writer.final("bye", 0, 10)
    assert (final.segment_id, final.seq, final.is_final) == (1, 1, True)
    writer.end_session(5000.0)
    (later,) = writer.partial("again", 0, 10)
    assert (later.segment_id, later.seq, later.start_ms, later.end_ms) == (2, 2, 5000.0, 5010.0)
    long = writer.partial("x" * 10_000)[0]
    assert len(long.text) == 4096  # the protocol's limit, never a refused event
    with pytest.raises(ValueError, match="stream_id"):
        EventWriter("")
    # A hypothesis taken back to nothing, then ended empty: that segment id is spent.
    retracted = EventWriter("s")
    assert [e.text for e in retracted.partial("the") + retracted.partial("")] == ["the", ""]
    assert retracted.final("") == [] and retracted.segment_id == 1


def test_whisper_streaming_segmentation_and_lines() -> None:
    splitter = LineSplitter()
    data = "0 500  Grüße\n500 900 zwei\n".encode()
    assert splitter.feed(data[:9]) == []  # "ü" cut in two
    assert splitter.feed(data[9:] + b"900 1000 dr") == ["0 500  Grüße", "500 900 zwei"]
    assert splitter.close() == ["900 1000 dr"]

    # Lines without their own spaces (whisper_timestamped's sep " ") are joined with one,
    # or with nothing in a language written without spaces; idle and max_chars close.
    mapper = make_mapper(Kind.WHISPER_STREAMING, "s")
    mapper.feed("0 500 Tom reads")
    (partial,) = mapper.feed("500 900 a book")
    assert partial.text == "Tom reads a book"
    (final,) = mapper.idle()
    assert final.text == "Tom reads a book" and final.is_final
    assert mapper.idle() == []
    zh = make_mapper(Kind.WHISPER_STREAMING, "s", MapperOptions(lang="zh"))
    zh.feed("0 500 我们")
    assert [e.text for e in zh.feed("500 900 明天见。")] == ["我们明天见。"]
    short = make_mapper(
        Kind.WHISPER_STREAMING, "s", MapperOptions(segmentation=Segmentation(max_chars=10))
    )
    assert [e.is_final for e in short.feed("0 500 one two three four")] == [False, True]


def test_whisperlive_messages_for_another_client_or_backend() -> None:
    mapper = make_mapper(Kind.WHISPERLIVE, "s")
    assert isinstance(mapper, WhisperLiveMapper)
    mapper.uid = "me"
    other = {
        "uid": "else",
        "segments": [{"start": "0", "end": "1", "text": "x", "completed": True}],
    }
    assert mapper.feed(json.dumps(other)) == []
    assert mapper.feed(json.dumps({"uid": "me", "status": "WAIT", "message": 3})) == []
    assert mapper.status == ("WAIT", "3")
    trt = {"uid": "me", "segments": [{"text": "hello "}, {"text": "wor"}]}
    with pytest.raises(BridgeError, match="TensorRT"):
        mapper.feed(json.dumps(trt))
    pcm = np.array([0, 16384, -32768, 32767], dtype="<i2").tobytes()
    assert np.frombuffer(float32_audio(pcm), "<f4").tolist() == [0.0, 0.5, -1.0, 32767 / 32768]


def test_the_command_line_options() -> None:
    parser = argparse.ArgumentParser()
    add_bridge_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bridge", "cloud", "--listen", ":9000", "--stream-id", "m", "--dialect", "azure"]
    )
    options = bridge_options(args)
    assert (options.kind, options.listen, options.dialect) == (
        Kind.CLOUD,
        ("127.0.0.1", 9000),
        Dialect.AZURE,
    )
    missing_audio = parser.parse_args(["bridge", "vosk", "ws://h:2700", "--stream-id", "m"])
    err = _Lines()
    assert run_bridge(missing_audio, _Lines(), err) == 2
    assert "--audio" in err.text
    with pytest.raises(SystemExit):
        parser.parse_args(["bridge", "vosk", "--listen", "nonsense", "--stream-id", "m"])


class _Lines:
    """A text sink for the command's output."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


# --- fake recognisers ---------------------------------------------------------------------

SERVER_READY = "SERVER_READY"


@dataclass
class FakeRecogniser:
    """A recogniser's server that replays a recording: one list of messages per
    connection; it drops every connection but the last after its messages, without a
    close frame. Audio kinds send their next message per audio frame received (as Vosk
    answers every frame), everything left at the end of the audio, then close."""

    kind: Kind
    script: list[list[str]]
    received: list[list[str | bytes]] = field(default_factory=list)  # per connection
    port: int = 0

    def lines(self, n: int) -> list[str]:
        return list(self.script[n]) if n < len(self.script) else []

    async def ws_handler(self, ws: ServerConnection) -> None:
        n = len(self.received)
        self.received.append([])
        lines, last = self.lines(n), n >= len(self.script) - 1
        uid = "UID"
        if self.kind is Kind.CLOUD:
            for line in lines:
                await ws.send(line)
                await asyncio.sleep(0.005)
            if last:
                await ws.close(1000)
            else:
                ws.transport.close()  # dropped: no close frame
            return
        if self.kind is Kind.WHISPERLIVE:
            config = await ws.recv()
            self.received[n].append(config)
            uid = json.loads(config)["uid"]
            while lines and SERVER_READY in lines[0]:
                await ws.send(lines.pop(0).replace("UID", uid))
        end = b"END_OF_AUDIO" if self.kind is Kind.WHISPERLIVE else '{"eof" : 1}'
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                self.received[n].append(frame)
                if isinstance(frame, str) and '"config"' in frame:
                    continue
                if frame == end:
                    for line in lines or (['{"text": ""}'] if self.kind is Kind.VOSK else []):
                        await ws.send(line.replace("UID", uid))
                    await ws.close()
                    return
                if lines:
                    await ws.send(lines.pop(0).replace("UID", uid))
                    if not lines and not last:
                        ws.transport.close()  # dropped mid-segment
                        return
                elif self.kind is Kind.VOSK:
                    await ws.send('{"partial" : ""}')

    async def tcp_handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = len(self.received)
        self.received.append([])
        lines, last = self.lines(n), n >= len(self.script) - 1
        try:
            while True:
                data = await reader.read(65536)
                if not data:  # the client is done: the last lines, then close
                    writer.write("".join(line + "\n" for line in lines).encode())
                    await writer.drain()
                    return
                self.received[n].append(data)
                if lines:
                    writer.write((lines.pop(0) + "\n").encode())
                    await writer.drain()
                    if not lines and not last:
                        return  # dropped mid-segment
        finally:
            writer.close()

    @property
    def url(self) -> str:
        if self.kind is Kind.WHISPER_STREAMING:
            return f"127.0.0.1:{self.port}"
        return f"ws://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def fake_recogniser(kind: Kind, recording: str) -> AsyncIterator[FakeRecogniser]:
    fake = FakeRecogniser(kind, sessions(recording))
    if kind is Kind.WHISPER_STREAMING:
        server = await asyncio.start_server(fake.tcp_handler, "127.0.0.1", 0)
        fake.port = server.sockets[0].getsockname()[1]
        async with server:
            yield fake
        return
    async with serve(fake.ws_handler, "127.0.0.1", 0) as ws_server:
        fake.port = ws_server.sockets[0].getsockname()[1]
        yield fake


def sine_wav(path: Path, seconds: float, rate: int = 16000) -> np.ndarray[Any, np.dtype[np.int16]]:
    t = np.arange(int(seconds * rate))
    samples = (np.sin(2 * np.pi * 440 * t / rate) * 8000).astype("<i2")
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(samples.tobytes())
    return samples


def options(kind: Kind, url: str | None, server: SubtitleServer, **more: Any) -> BridgeOptions:
    more.setdefault("speed", 10.0)
    return BridgeOptions(
        kind=kind,
        url=url,
        stream_id="mic-1",
        to=f"ws://127.0.0.1:{server.port}/ws",
        end_wait=0.3,
        idle=30.0,
        backoff=QUICK,
        reconnect_for=5.0,
        drain_timeout=20.0,
        **more,
    )


def check_translated(result: BridgeResult, translator: Translator, finals: list[str]) -> None:
    """The bridge pushed exactly `finals` as finals, and our server answered each one,
    once, with the translation of its text: nothing refused, nothing left unanswered."""
    assert [e.text for e in result.finals] == finals
    assert not [r for r in result.replies if isinstance(r, ErrorMessage)]
    assert result.unanswered == [] and result.gave_up is None and exit_status(result) == 0
    answers = {u.seq: u for u in result.translated}
    assert len(result.translated) == len(answers) == len(finals)
    expected = translator.translate(finals, STREAMING.decode)
    for event, translation in zip(result.finals, expected, strict=True):
        update = answers[event.seq]
        assert (update.segment_id, update.source_text) == (event.segment_id, event.text)
        assert update.stable_text == translation.text and update.stable_text
    seqs = [e.seq for e in result.events]
    assert seqs == sorted(set(seqs))  # seq grows across the reconnect


def finals_of(expected: list[Event]) -> list[str]:
    return [e[2] for e in expected if e[3]]


# --- end to end, connect mode ---------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "recording", "expected", "cut"),
    [
        (Kind.WHISPERLIVE, "whisperlive.jsonl", WHISPERLIVE, "Tom reads a book"),
        (Kind.VOSK, "vosk.jsonl", VOSK, "tom reads a book"),
        (
            Kind.WHISPER_STREAMING,
            "whisper_streaming.jsonl",
            WHISPER_STREAMING,
            "Lucy meets my friend",
        ),
    ],
    ids=["whisperlive", "vosk", "whisper-streaming"],
)
async def test_audio_kinds_end_to_end_through_a_dropped_session(
    translator: Translator,
    tmp_path: Path,
    kind: Kind,
    recording: str,
    expected: list[Event],
    cut: str,
) -> None:
    """The bridge streams a WAV to the fake recogniser, which drops the connection in the
    middle of a segment: the bridge sends that segment's last hypothesis as its final,
    reconnects, streams the rest of the audio, and every final is translated."""
    samples = sine_wav(tmp_path / "speech.wav", 4.0)
    async with serving(translator) as server, fake_recogniser(kind, recording) as fake:
        opts = options(kind, fake.url, server, audio=str(tmp_path / "speech.wav"), lang="en")
        result = await Bridge(opts).run()
    check_translated(result, translator, finals_of(expected))
    assert [e[:4] for e in expected] == [as_tuple(e)[:4] for e in result.events]
    dropped = (
        "connection closed by the server"
        if kind is Kind.WHISPER_STREAMING
        else (
            "connection dropped"  # no close frame
        )
    )
    assert result.sessions == 2 and result.disconnects == [dropped]
    # The segment the drop cut off was closed with its last hypothesis, and translated.
    (closed,) = [e for e in result.finals if e.text == cut]
    last_partial = [e for e in result.events if e.segment_id == closed.segment_id][-2]
    assert (last_partial.text, last_partial.is_final) == (cut, False)
    assert cut in {u.source_text for u in result.translated}
    # What the recogniser got is what its own client would send.
    audio = [b for conn in fake.received for b in conn if isinstance(b, bytes)]
    if kind is Kind.WHISPERLIVE:
        config = json.loads(fake.received[0][0])
        assert {"uid", "language", "task", "model", "use_vad"} <= config.keys()
        assert config["language"] == "en" and config["task"] == "transcribe"
        assert audio[-1] == b"END_OF_AUDIO"
        first = np.frombuffer(audio[0], "<f4")  # float32, sample / 32768
        assert len(first) == 4096 and np.array_equal(first, samples[:4096] / np.float32(32768))
    elif kind is Kind.VOSK:
        assert json.loads(fake.received[0][0]) == {"config": {"sample_rate": 16000, "words": 1}}
        assert fake.received[1][-1] == '{"eof" : 1}'
        assert audio[0] == samples[:3200].tobytes()  # 0.2 s of 16-bit PCM, as it is
    else:
        assert b"".join(fake.received[0]).startswith(samples[:1600].tobytes())


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("dialect", "recording", "expected"),
    [
        (Dialect.GOOGLE, "cloud_google.jsonl", GOOGLE),
        (Dialect.DEEPGRAM, "cloud_deepgram.jsonl", DEEPGRAM),
        (Dialect.AZURE, "cloud_azure.jsonl", AZURE),
    ],
    ids=["google", "deepgram", "azure"],
)
async def test_cloud_forwarder_end_to_end_through_a_dropped_session(
    translator: Translator, dialect: Dialect, recording: str, expected: list[Event]
) -> None:
    async with serving(translator) as server, fake_recogniser(Kind.CLOUD, recording) as fake:
        result = await Bridge(options(Kind.CLOUD, fake.url, server, dialect=dialect)).run()
    check_translated(result, translator, finals_of(expected))
    assert [as_tuple(e) for e in result.events] == expected  # times too: no audio clock
    assert result.sessions == 2 and result.disconnects == ["connection dropped"]


@pytest.mark.anyio
async def test_the_command_prints_each_final_translation(translator: Translator) -> None:
    parser = argparse.ArgumentParser()
    add_bridge_parser(parser.add_subparsers(dest="command"))
    out, err = _Lines(), _Lines()
    async with (
        serving(translator) as server,
        fake_recogniser(Kind.CLOUD, "cloud_azure.jsonl") as fake,
    ):
        args = parser.parse_args(
            [
                "bridge",
                "cloud",
                fake.url,
                "--stream-id",
                "mic-1",
                "--dialect",
                "azure",
                "--to",
                f"ws://127.0.0.1:{server.port}/ws",
                "--reconnect-for",
                "5",
            ]
        )
        status = await anyio.to_thread.run_sync(run_bridge, args, out, err)
    finals = finals_of(AZURE)
    translations = translator.translate(finals, STREAMING.decode)
    assert status == 0, err.text
    assert out.text.splitlines() == [
        f"[{segment} zh] {t.text}  <- {text}"
        for segment, text, t in zip([0, 1, 2], finals, translations, strict=True)
    ]
    assert "3 finals sent, 3 translated, 0 refused, 0 unanswered" in err.text


@pytest.mark.anyio
async def test_the_command_sends_the_streams_glossary_first(
    translator: Translator, tmp_path: Path
) -> None:
    terms = "en\tzh\nTom\t爱丽丝\nbook\t报纸\n"
    glossary = tmp_path / "terms.tsv"
    glossary.write_text(terms, encoding="utf-8")
    parser = argparse.ArgumentParser()
    add_bridge_parser(parser.add_subparsers(dest="command"))
    out, err = _Lines(), _Lines()
    argv = ["bridge", "cloud", "--stream-id", "mic-1", "--dialect", "azure", "--glossary"]
    async with (
        serving(translator) as server,
        fake_recogniser(Kind.CLOUD, "cloud_azure.jsonl") as fake,
    ):
        to = ["--to", f"ws://127.0.0.1:{server.port}/ws", "--reconnect-for", "5"]
        args = parser.parse_args([*argv[:2], fake.url, *argv[2:], str(glossary), *to])
        status = await anyio.to_thread.run_sync(run_bridge, args, out, err)
    finals = finals_of(AZURE)
    translations = translator.translate(finals, STREAMING.decode, glossary=Glossary.parse(terms))
    assert status == 0, err.text
    assert [line.split("  <- ")[0] for line in out.text.splitlines()] == [
        f"[{segment} zh] {t.text}" for segment, t in zip([0, 1, 2], translations, strict=True)
    ]
    assert "爱丽丝" in out.text and "报纸" in out.text
    bad = tmp_path / "bad.tsv"
    bad.write_text("en\tzh\nTom\n\tx\n", encoding="utf-8")
    args = parser.parse_args([*argv[:2], "ws://h:1", *argv[2:], str(bad)])
    err = _Lines()
    assert run_bridge(args, _Lines(), err) == 2
    assert err.text.strip() == f"error: {bad}:3: empty source term"


# --- end to end, listen mode --------------------------------------------------------------


@pytest.mark.anyio
async def test_vosk_relay_maps_a_clients_sessions(translator: Translator) -> None:
    """--listen: the user's own Vosk client talks to the bridge, which relays both ways
    unchanged; when the recogniser drops the session, the client sees it closed, comes
    back, and the interrupted segment was closed with a final."""
    port: list[int] = []
    stop = anyio.Event()
    async with (
        serving(translator) as server,
        fake_recogniser(Kind.VOSK, "vosk.jsonl") as fake,
        anyio.create_task_group() as tg,
    ):
        bridge = Bridge(
            options(Kind.VOSK, fake.url, server, listen=("127.0.0.1", 0)),
            on_listening=port.append,
        )
        results: list[BridgeResult] = []

        async def run() -> None:
            results.append(await bridge.run(stop))

        tg.start_soon(run)
        with anyio.fail_after(10):
            while not port:
                await anyio.sleep(0.01)
        heard: list[list[str]] = []
        for _ in range(2):  # the client's two sessions
            heard.append([])
            async with connect(f"ws://127.0.0.1:{port[0]}") as client:
                await client.send('{ "config" : { "sample_rate" : 16000 } }')
                with contextlib.suppress(ConnectionClosed):
                    for _ in range(12):
                        await client.send(b"\0\0" * 3200)
                        heard[-1].append(str(await client.recv()))
                    await client.send('{"eof" : 1}')
                    heard[-1].append(str(await client.recv()))
            with anyio.fail_after(10):
                while bridge.relaying:  # the bridge saw the session end
                    await anyio.sleep(0.01)
        stop.set()
    (result,) = results
    check_translated(result, translator, finals_of(VOSK))
    script = sessions("vosk.jsonl")
    assert heard[0] == script[0]  # relayed as the recogniser sent them
    assert heard[1][: len(script[1])] == script[1]
    assert fake.received[0][0] == '{ "config" : { "sample_rate" : 16000 } }'


@dataclass
class Listening:
    """A listen-mode bridge running: its `url`; `results` holds its result once stopped."""

    bridge: Bridge
    url: str
    results: list[BridgeResult]


@contextlib.asynccontextmanager
async def listening(opts: BridgeOptions) -> AsyncIterator[Listening]:
    """Run a listen-mode bridge until the block is left."""
    port: list[int] = []
    stop = anyio.Event()
    bridge = Bridge(opts, on_listening=port.append)
    results: list[BridgeResult] = []

    async def run() -> None:
        results.append(await bridge.run(stop))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.fail_after(10):
            while not port:
                await anyio.sleep(0.01)
        yield Listening(bridge, f"ws://127.0.0.1:{port[0]}", results)
        stop.set()


@pytest.mark.anyio
async def test_one_relayed_session_at_a_time(translator: Translator) -> None:
    script = sessions("cloud_azure.jsonl")
    async with serving(translator) as server:
        opts = options(Kind.CLOUD, None, server, dialect=Dialect.AZURE, listen=("127.0.0.1", 0))
        async with listening(opts) as running:
            async with connect(running.url) as forwarder:
                for line in script[0]:
                    await forwarder.send(line)
                async with connect(running.url) as second:
                    with pytest.raises(ConnectionClosed):
                        await second.recv()
                    assert second.close_code == 1013
            with anyio.fail_after(10):
                while running.bridge.relaying:
                    await anyio.sleep(0.01)
            async with connect(running.url) as forwarder:
                await forwarder.send("\n".join(script[1]))  # several JSON lines in one message
    (result,) = running.results
    check_translated(result, translator, finals_of(AZURE))
    assert result.sessions == 2


@pytest.mark.anyio
async def test_whisper_streaming_relay(translator: Translator) -> None:
    """--listen for the TCP server: `arecord | nc bridge` instead of `nc server`."""
    port: list[int] = []
    stop = anyio.Event()
    async with (
        serving(translator) as server,
        fake_recogniser(Kind.WHISPER_STREAMING, "whisper_streaming.jsonl") as fake,
        anyio.create_task_group() as tg,
    ):
        opts = options(Kind.WHISPER_STREAMING, fake.url, server, listen=("127.0.0.1", 0))
        bridge = Bridge(opts, on_listening=port.append)
        results: list[BridgeResult] = []

        async def run() -> None:
            results.append(await bridge.run(stop))

        tg.start_soon(run)
        with anyio.fail_after(10):
            while not port:
                await anyio.sleep(0.01)
        got: list[bytes] = []

        async def read(client: anyio.abc.SocketStream) -> None:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                while True:
                    got.append(await client.receive())

        for _ in range(2):  # `arecord | nc`, twice
            async with (
                await anyio.connect_tcp("127.0.0.1", port[0]) as client,
                anyio.create_task_group() as session,
            ):
                session.start_soon(read, client)
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    for _ in range(10):
                        await client.send(b"\0\0" * 1600)
                        await anyio.sleep(0.02)
                    await client.send_eof()
            with anyio.fail_after(10):
                while bridge.relaying:
                    await anyio.sleep(0.01)
        stop.set()
    (result,) = results
    check_translated(result, translator, finals_of(WHISPER_STREAMING))
    assert b"".join(got).decode().splitlines() == [m for s in fake.script for m in s]


# --- failures -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_our_server_gone_answers_every_final_with_an_error() -> None:
    """Our server takes the first final and vanishes for good: `RemoteTranslator` gives
    up after `reconnect_for`, every final the bridge had is answered `unavailable` (none
    is lost silently), the bridge stops and its exit status says so."""
    got: list[PartialTranscript] = []

    async with fake_recogniser(Kind.CLOUD, "cloud_google.jsonl") as fake:

        async def silent(ws: ServerConnection) -> None:
            async for data in ws:
                message = protocol.parse(data)
                if isinstance(message, PartialTranscript):
                    got.append(message)
                    if message.is_final:
                        ours.close()  # the node dies; nothing listens any more
                        return

        async with serve(silent, "127.0.0.1", 0) as ours:
            port = ours.sockets[0].getsockname()[1]
            opts = BridgeOptions(
                kind=Kind.CLOUD,
                url=fake.url,
                stream_id="mic-1",
                to=f"ws://127.0.0.1:{port}/ws",
                dialect=Dialect.GOOGLE,
                backoff=QUICK,
                reconnect_for=1.0,
                drain_timeout=10.0,
            )
            with anyio.fail_after(20):
                result = await Bridge(opts).run()
    assert got and got[-1].is_final
    assert result.finals  # pushed: the first before the server went, others held
    errors = {r.seq: r for r in result.replies if isinstance(r, ErrorMessage)}
    assert {e.seq for e in result.finals} <= errors.keys()
    assert {errors[e.seq].code for e in result.finals} == {"unavailable"}
    assert result.gave_up is not None or result.unanswered
    assert exit_status(result) == 1


@pytest.mark.anyio
async def test_an_unreachable_recogniser_is_an_error(
    translator: Translator, tmp_path: Path
) -> None:
    sine_wav(tmp_path / "a.wav", 0.5)
    with socket_port() as free:
        async with serving(translator) as server:
            opts = options(
                Kind.VOSK, f"ws://127.0.0.1:{free}", server, audio=str(tmp_path / "a.wav")
            )
            with pytest.raises(BridgeError, match="cannot reach the vosk server"):
                await Bridge(opts).run()


@pytest.mark.anyio
async def test_a_wav_the_bridge_cannot_read(translator: Translator, tmp_path: Path) -> None:
    text = tmp_path / "text.wav"
    text.write_text("not audio")
    async with serving(translator) as server:
        opts = options(Kind.WHISPERLIVE, "ws://127.0.0.1:9", server, audio=str(text))
        with pytest.raises(BridgeError, match="not a WAV file"):
            await Bridge(opts).run()


def test_a_wav_at_another_rate_is_resampled_for_the_recogniser(tmp_path: Path) -> None:
    sine_wav(tmp_path / "8k.wav", 0.5, rate=8000)
    audio = AudioSource(str(tmp_path / "8k.wav"), rate=16000)
    assert audio.sample_rate == 16000
    audio.close()


@contextlib.contextmanager
def socket_port() -> Iterator[int]:
    """A port nothing listens on (taken, then freed)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield port


# --- hostile or failing recognisers --------------------------------------------------------


def _google(text: str, *, final: bool = False) -> str:
    result: dict[str, Any] = {"alternatives": [{"transcript": text}]}
    if final:
        result["isFinal"] = True
    return json.dumps({"results": [result]})


def _whisperlive(*segments: tuple[str, object, object, bool]) -> str:
    keys = ("text", "start", "end", "completed")
    return json.dumps(
        {"uid": "UID", "segments": [dict(zip(keys, s, strict=True)) for s in segments]}
    )


READY = json.dumps({"uid": "UID", "message": SERVER_READY, "backend": "faster_whisper"})


def test_whisperlive_segments_without_usable_times_are_taken_once() -> None:
    """Segment times that are "nan" or missing cannot tell a repeated segment from a new
    one: each completed segment is still one final, however many windows repeat it."""
    mapper = make_mapper(Kind.WHISPERLIVE, "s")
    assert isinstance(mapper, WhisperLiveMapper)
    mapper.uid = "UID"
    first = (" I will meet Tom.", "nan", "nan", True)
    second = (" Tom reads a book.", None, None, True)
    third = (" Lucy meets my friend.", "inf", "1.500", True)
    windows = [[first]] * 5 + [[first, second]] * 5 + [[first, second, third]] * 3
    windows += [[second, third, (" Does Tom", "nan", "nan", False)]] * 2
    events = [e for window in windows for e in mapper.feed(_whisperlive(*window))]
    assert [e.text for e in events if e.is_final] == [
        "I will meet Tom.",
        "Tom reads a book.",
        "Lucy meets my friend.",
    ]
    assert [e.text for e in events if not e.is_final] == ["Does Tom"]
    assert all(e.start_ms is None for e in events)  # no number: unknown, not 0
    assert [e.end_ms for e in events if e.is_final] == [None, None, 1500.0]
    # The same text said again later is a new segment when the window shows it twice.
    again = mapper.feed(_whisperlive(third, (" Does Tom draw?", None, None, True)))
    again += mapper.feed(_whisperlive(third, (" Does Tom draw?", None, None, True), first))
    assert [e.text for e in again if e.is_final] == ["Does Tom draw?", "I will meet Tom."]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", [Kind.WHISPERLIVE, Kind.CLOUD], ids=["whisperlive", "cloud"])
async def test_a_lone_surrogate_from_the_recogniser_is_dropped_and_the_bridge_goes_on(
    translator: Translator, tmp_path: Path, kind: Kind
) -> None:
    """JSON can spell a lone surrogate ("\\ud800"), which no UTF-8 text may hold and the
    server refuses: the bridge drops it from the text and goes on, and the finals after
    it are sent and translated."""
    bad = "I will meet Tom\ud800 at three."
    if kind is Kind.WHISPERLIVE:
        script = [
            READY,
            _whisperlive((" I will\udc00", "0.000", "1.000", False)),
            _whisperlive((" " + bad, "0.000", "2.000", True), (" Tom", "2.000", "2.500", False)),
            _whisperlive(
                (" " + bad, "0.000", "2.000", True), (" Tom reads a book.", "2.000", "3.000", True)
            ),
        ]
    else:
        script = [_google("I will\udc00"), _google(bad, final=True)]
        script += [_google("Tom"), _google("Tom reads a book.", final=True)]
    assert any("\\ud800" in line for line in script)  # as JSON writes it
    sine_wav(tmp_path / "a.wav", 2.0)
    audio = {"audio": str(tmp_path / "a.wav")} if kind is Kind.WHISPERLIVE else {}
    fake = FakeRecogniser(kind, [script])
    async with (
        serving(translator) as server,
        serve(fake.ws_handler, "127.0.0.1", 0) as upstream,
    ):
        fake.port = upstream.sockets[0].getsockname()[1]
        with anyio.fail_after(30):
            result = await Bridge(options(kind, fake.url, server, **audio)).run()
    check_translated(result, translator, ["I will meet Tom at three.", "Tom reads a book."])
    assert result.events[0].text == "I will"


@pytest.mark.anyio
async def test_a_forwarder_sending_a_lone_surrogate_keeps_its_session(
    translator: Translator,
) -> None:
    async with serving(translator) as server:
        opts = options(Kind.CLOUD, None, server, listen=("127.0.0.1", 0))
        async with listening(opts) as running, connect(running.url) as forwarder:
            await forwarder.send(_google("I will meet Tom at three.\ud800", final=True))
            await forwarder.send(_google("Tom reads a book.", final=True))
            with anyio.fail_after(10):
                while len(running.bridge.result.finals) < 2:
                    await anyio.sleep(0.01)
            assert forwarder.close_code is None  # not closed 1011 by an error
    (result,) = running.results
    check_translated(result, translator, ["I will meet Tom at three.", "Tom reads a book."])


@pytest.mark.anyio
@pytest.mark.parametrize("rate", [4.0, None], ids=["paced-within", "paced-above"])
async def test_a_burst_of_partials_over_the_servers_rate_loses_no_final(
    translator: Translator, rate: float | None
) -> None:
    """A forwarder bursts hundreds of partials at a server that takes 5 messages a
    second: the bridge coalesces them (the latest of each burst goes), and its finals
    are answered by their translations, never refused. Paced within the server's rate,
    nothing is refused at all; paced above it, the bridge slows down at the first
    `rate_limited` and sends a final the server dropped again."""
    script: list[str] = []
    for sentence in ("I will meet Tom at three.", "Tom reads a book."):
        words = sentence.split()
        for n in range(200):
            script.append(_google(" ".join(words[: 1 + n % len(words)]) + f" {n}"))
        script.append(_google(sentence, final=True))
    fake = FakeRecogniser(Kind.CLOUD, [script])
    more = {"rate": rate} if rate is not None else {}
    async with (
        serving(translator, limits=Limits(rate_limit=5.0)) as server,
        serve(fake.ws_handler, "127.0.0.1", 0) as upstream,
    ):
        fake.port = upstream.sockets[0].getsockname()[1]
        with anyio.fail_after(60):
            result = await Bridge(options(Kind.CLOUD, fake.url, server, **more)).run()
    assert [e.text for e in result.finals] == ["I will meet Tom at three.", "Tom reads a book."]
    assert result.refused == [] and result.unanswered == [] and result.gave_up is None
    assert {u.source_text for u in result.translated} == {e.text for e in result.finals}
    assert len(result.translated) == 2


class _EarlyCloser:
    """A WhisperLive that answers each session with the same partial, then drops it."""

    def __init__(self) -> None:
        self.sessions = 0

    async def handler(self, ws: ServerConnection) -> None:
        self.sessions += 1
        config = json.loads(await ws.recv())
        await ws.send(READY.replace("UID", config["uid"]))
        partial = _whisperlive((" Hello there", "0.000", "0.500", False))
        await ws.send(partial.replace("UID", config["uid"]))
        await asyncio.sleep(0.1)
        ws.transport.close()  # dropped, before the end of the audio


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("seconds", "policy", "sessions"),
    [(60.0, {}, 5), (0.3, {"short_session": 0.0}, 1)],
    ids=["short-sessions-give-up", "the-audio-ended"],
)
async def test_a_recogniser_that_keeps_closing_early_is_given_up(
    translator: Translator,
    tmp_path: Path,
    seconds: float,
    policy: dict[str, Any],
    sessions: int,
) -> None:
    """Every session answers one partial and is dropped at once: the bridge gives up
    after `max_short_sessions` such sessions in a row, or stops when the audio is over,
    and the partial that each session left open is one final, not one per session."""
    sine_wav(tmp_path / "a.wav", seconds)
    fake = _EarlyCloser()
    async with (
        serving(translator) as server,
        serve(fake.handler, "127.0.0.1", 0) as upstream,
    ):
        url = f"ws://127.0.0.1:{upstream.sockets[0].getsockname()[1]}"
        opts = options(Kind.WHISPERLIVE, url, server, audio=str(tmp_path / "a.wav"), **policy)
        with anyio.fail_after(20):
            result = await Bridge(opts).run()
    assert result.sessions == fake.sessions == sessions
    assert [e.text for e in result.finals] == ["Hello there"]
    assert [u.source_text for u in result.translated] == ["Hello there"]
    if policy:
        assert result.gave_up is None
    else:
        assert result.gave_up is not None and "5 sessions in a row" in result.gave_up
