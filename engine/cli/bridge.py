"""`nmt-incremental bridge`: connect a speech recogniser's server to a running
`nmt-incremental serve`, so that its transcripts are translated live without an adapter
of the user's own.

The work is `engine.bridges` (one sans-I/O mapper per recogniser, `Bridge` for the I/O);
this module reads the options, prints each final translation to stdout as it comes
(`[SEGMENT] translation  <- source`), notices and a summary to stderr, and turns the first
Ctrl-C into a clean end: the open segment is closed, and the finals already sent are
waited for.

Exit status: 0 when every final was translated, 1 when one was refused or left
unanswered or a connection was given up, 2 for what a person must fix (a bad option, an
audio file it cannot read, a server that cannot be reached at all).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import anyio
from websockets.exceptions import InvalidHandshake

import protocol
from engine.bridges.cloud import Dialect
from engine.bridges.errors import BridgeError
from engine.bridges.events import Interrupted
from engine.bridges.kinds import Kind
from engine.bridges.options import DEFAULT_TO, BridgeOptions, BridgeResult, Reply
from engine.bridges.runner import Bridge
from engine.bridges.whisper_streaming import Segmentation
from engine.cli.args import (
    audio_rate,
    non_negative_float,
    positive_float,
    positive_int,
    probability,
)
from engine.errors import unwrapped
from engine.glossary import Glossary, GlossaryError
from engine.remote import RATE
from protocol import ErrorMessage, InvalidMessage, SetGlossary, TranslationUpdate


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def add_bridge_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bridge = subparsers.add_parser(
        "bridge",
        help="translate a speech recogniser's live transcripts (WhisperLive, "
        "whisper_streaming / SimulStreaming, Vosk, cloud recognisers)",
        description=(
            "Connect to the server of a speech recogniser and to a running "
            "`nmt-incremental serve` (--to), and push the recogniser's hypotheses as "
            "partial_transcript events on one stream (--stream-id). whisperlive, vosk and "
            "whisper-streaming transcribe audio from their client: stream it with --audio, "
            "or relay your own client with --listen. cloud reads the JSON lines a process "
            "of yours forwards from a cloud recogniser's SDK (--dialect), from URL or on "
            "--listen. Final translations are printed as they come. Exits 1 when a final "
            "was refused or left unanswered, or a server was given up."
        ),
    )
    bridge.add_argument("kind", choices=[kind.value for kind in Kind], help="the recogniser")
    bridge.add_argument(
        "url",
        nargs="?",
        help="the recogniser's server: ws://HOST:PORT for whisperlive, vosk and a cloud "
        "forwarder, HOST:PORT for whisper-streaming (TCP); with --listen, where the relayed "
        "sessions go (not needed for cloud)",
    )
    bridge.add_argument("--stream-id", required=True, help="the stream to write to")
    bridge.add_argument(
        "--to", default=DEFAULT_TO, help="our server's WebSocket (default: %(default)s)"
    )
    bridge.add_argument("--token", help="our server's writer token")
    bridge.add_argument(
        "--lang",
        help="the spoken language (WhisperLive's `language`; also how pieces of text that "
        "carry no spaces are joined: none for zh, ja, th...; default: detected / spaces)",
    )
    bridge.add_argument(
        "--audio",
        metavar="FILE.wav|-",
        help="stream this audio to the recogniser at real time: a WAV file (any rate, "
        "8-32 bit, channels mixed down; resampled to the 16 kHz the recognisers take, "
        "vosk takes it as it is), or - for raw s16le mono PCM on stdin at --audio-rate",
    )
    bridge.add_argument(
        "--audio-rate",
        type=audio_rate,
        default=16000,
        metavar="HZ",
        help="the sample rate of raw audio on stdin (default: %(default)s; a WAV file says "
        "its own)",
    )
    bridge.add_argument(
        "--listen",
        type=_host_port,
        metavar="HOST:PORT",
        help="take one session at a time here instead: your recogniser client connects to "
        "the bridge, which relays it to URL and maps the answers (for cloud: the forwarder "
        "connects here)",
    )
    bridge.add_argument(
        "--speed",
        type=positive_float,
        default=1.0,
        help="play --audio this many times faster than real time (default: 1)",
    )
    bridge.add_argument(
        "--dialect",
        choices=[dialect.value for dialect in Dialect],
        default=Dialect.GOOGLE.value,
        help="cloud: whose results the forwarder sends (default: %(default)s)",
    )
    bridge.add_argument(
        "--interrupted",
        choices=[rule.value for rule in Interrupted],
        default=Interrupted.FINAL.value,
        help="a segment cut off by a lost recogniser session: send its last hypothesis as "
        "its final (final), or only the part the recogniser had committed (drop) "
        "(default: %(default)s)",
    )
    bridge.add_argument(
        "--whisper-model",
        default="small",
        help="whisperlive: the Whisper model the server should load (default: %(default)s)",
    )
    bridge.add_argument(
        "--pause-ms",
        type=positive_float,
        default=Segmentation().pause_ms,
        help="whisper-streaming: a gap this long between committed lines ends a segment "
        "(default: %(default)g)",
    )
    bridge.add_argument(
        "--max-chars",
        type=positive_int,
        default=Segmentation().max_chars,
        help="whisper-streaming: end a segment that reaches this length (default: %(default)s)",
    )
    bridge.add_argument(
        "--idle",
        type=positive_float,
        default=2.0,
        help="whisper-streaming: seconds without a line that end the open segment "
        "(default: %(default)g)",
    )
    bridge.add_argument(
        "--min-stability",
        type=probability,
        default=0.9,
        help="cloud, google: interim results at least this stable count as settled text "
        "(default: %(default)g)",
    )
    bridge.add_argument(
        "--end-wait",
        type=non_negative_float,
        default=10.0,
        help="after the audio: seconds of recogniser silence before the session is ended, "
        "and the wait for it to close (default: %(default)g)",
    )
    bridge.add_argument(
        "--reconnect-for",
        type=non_negative_float,
        default=30.0,
        help="give up a lost server (the recogniser's or ours) after this many seconds of "
        "failed reconnects (default: %(default)g)",
    )
    bridge.add_argument(
        "--rate",
        type=positive_float,
        default=RATE,
        help="messages per second to our server at most (partials beyond it are coalesced; "
        "keep it within the server's --rate-limit; default: %(default)g)",
    )
    bridge.add_argument(
        "--glossary",
        metavar="FILE",
        help="the stream's own glossary (TSV naming its languages first: docs/glossaries.md), "
        "sent to our server before the first partial; merged over the server's --glossary",
    )
    bridge.add_argument(
        "--quiet", action="store_true", help="print no translations, only the summary"
    )
    bridge.add_argument(
        "--unanswered",
        metavar="FILE",
        help="when the bridge ends, write the finals our server never answered to FILE, "
        "one partial_transcript message a line (to send again later); empty when none",
    )


def bridge_options(args: argparse.Namespace) -> BridgeOptions:
    """The `BridgeOptions` the parsed arguments ask for (`BridgeError` when they do not
    fit together)."""
    return BridgeOptions(
        kind=Kind(args.kind),
        url=args.url,
        stream_id=args.stream_id,
        to=args.to,
        token=args.token,
        lang=args.lang,
        audio=args.audio,
        audio_rate=args.audio_rate,
        listen=args.listen,
        speed=args.speed,
        dialect=Dialect(args.dialect),
        interrupted=Interrupted(args.interrupted),
        model=args.whisper_model,
        segmentation=Segmentation(pause_ms=args.pause_ms, max_chars=args.max_chars),
        min_stability=args.min_stability,
        idle=args.idle,
        end_wait=args.end_wait,
        reconnect_for=args.reconnect_for,
        rate=args.rate,
        glossary=_glossary_text(args.glossary),
    )


def _glossary_text(path: str | None) -> str | None:
    """The glossary file's text, checked here as our server will (a bad line, or a file
    past what one stream may send, is a `GlossaryError` naming it, before anything
    connects)."""
    if path is None:
        return None
    Glossary.read(path)
    text = Path(path).read_bytes().decode("utf-8-sig")
    try:
        SetGlossary("stream", text)
    except InvalidMessage as exc:
        raise GlossaryError(f"{path}: {exc.message} (a stream's own glossary)") from None
    return text


def _printer(
    out: TextIO, err: TextIO, quiet: bool
) -> tuple[Callable[[Reply], None], Callable[[str], None]]:
    def reply(message: Reply) -> None:
        if isinstance(message, ErrorMessage):
            print(f"refused (seq {message.seq}): {message.code}: {message.message}", file=err)
        elif isinstance(message, TranslationUpdate) and message.is_final and not quiet:
            source = f"  <- {message.source_text}" if message.source_text else ""
            lang = f" {message.lang}" if message.lang else ""
            print(f"[{message.segment_id}{lang}] {message.stable_text}{source}", file=out)
            out.flush()

    def notice(line: str) -> None:
        print(f"bridge: {line}", file=err)

    return reply, notice


def summary(result: BridgeResult) -> str:
    unanswered = {event.seq for event in result.unanswered}
    translated = {update.seq for update in result.translated}
    refused = {error.seq for error in result.refused} - unanswered  # each counted once
    return (
        f"{len(result.finals)} finals sent, {len(translated)} translated, {len(refused)} "
        f"refused, {len(result.unanswered)} unanswered; {result.sessions} recogniser "
        f"session(s), {len(result.disconnects)} ended before the input"
    )


def unanswered_lines(result: BridgeResult) -> list[str]:
    """One line per final never answered, naming it (segment, seq, text)."""
    return [
        f"unanswered: segment {event.segment_id} seq {event.seq}: {event.text}"
        for event in result.unanswered
    ]


def write_unanswered(path: str, result: BridgeResult) -> None:
    """The finals never answered, as `partial_transcript` messages, one a line."""
    with open(path, "w", encoding="utf-8") as f:
        for event in result.unanswered:
            f.write(protocol.serialize(event) + "\n")


def exit_status(result: BridgeResult) -> int:
    return 1 if result.refused or result.unanswered or result.gave_up else 0


def run_bridge(
    args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        options = bridge_options(args)
    except (BridgeError, ValueError) as exc:
        print(f"error: {exc}", file=err)
        return 2
    if args.unanswered:
        try:  # now, not after the session: a path that cannot be written loses nothing
            open(args.unanswered, "w", encoding="utf-8").close()
        except OSError as exc:
            print(f"error: {args.unanswered}: {exc.strerror or exc}", file=err)
            return 2
    on_reply, notice = _printer(out, err, args.quiet)
    try:
        bridge = Bridge(options, on_reply=on_reply, on_notice=notice)
    except BridgeError as exc:
        print(f"error: {exc}", file=err)
        return 2

    async def main() -> BridgeResult | None:
        stop = anyio.Event()
        result: BridgeResult | None = None
        async with anyio.create_task_group() as tg:

            async def signals() -> None:
                if threading.current_thread() is not threading.main_thread():
                    return  # signals reach the main thread only (an embedding caller's)
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
                    async for _ in received:
                        if stop.is_set():
                            tg.cancel_scope.cancel()  # a second Ctrl-C: stop waiting
                            return
                        notice(
                            "stopping: closing the stream, up to "
                            f"{options.stop_timeout:g} s (Ctrl-C again to quit now)"
                        )
                        stop.set()

            tg.start_soon(signals)
            result = await bridge.run(stop)
            tg.cancel_scope.cancel()
        return result

    notice(f"connecting to {options.to} (retrying for up to {options.reconnect_for:g} s)")
    try:
        with unwrapped():  # a task group's one failure, as itself
            result = anyio.run(main)
    except BridgeError as exc:
        print(f"error: {exc}", file=err)
        return 2
    except (OSError, InvalidHandshake) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(
            f"error: cannot reach nmt-incremental at {options.to} ({why}): is "
            "`nmt-incremental serve` running there?",
            file=err,
        )
        return 2
    quit_now = result is None  # a second Ctrl-C: what is known so far
    result = bridge.result if result is None else result
    if result.gave_up:
        notice(f"gave up: {result.gave_up}")
    notice(summary(result))
    for line in unanswered_lines(result):
        notice(line)
    if args.unanswered:
        try:
            write_unanswered(args.unanswered, result)
        except OSError as exc:
            print(f"error: {args.unanswered}: {exc.strerror or exc}", file=err)
            return 2
        notice(f"{len(result.unanswered)} unanswered final(s) written to {args.unanswered}")
    return 130 if quit_now else exit_status(result)
