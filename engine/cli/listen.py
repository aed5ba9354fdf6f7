"""`nmt-incremental listen`: speech in, live subtitles out.

A WAV file, or raw 16-bit mono PCM on stdin (`-`, e.g. from `arecord` or `ffmpeg`), goes
through a recognizer (pocketsphinx, the `[asr]` extra) into the incremental translator,
as a speech pipeline would feed it (`engine.asr.transcriber`). On a terminal the subtitles
form in place (`listen_view`); to a file or a pipe the updates go as JSON Lines (the
wire's `translation_update` messages). `--vtt`/`--srt` write the finals as subtitles,
timed by the audio; `--serve` also shows them on the subtitle page of a `SubtitleServer`
run in this process. This module is the command: its options, checked, and the run
(`listen_session`).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import IO, BinaryIO, TextIO

import anyio

from engine.asr.audio import PcmSource, RawSource, WavSource
from engine.asr.errors import AudioFileError
from engine.asr.sphinx import SphinxRecognizer
from engine.cli.args import (
    add_decode_arguments,
    add_model_arguments,
    add_policy_argument,
    audio_rate,
    bind_error,
    is_bind_error,
    load_translator,
    read_glossary,
    streaming_options,
)
from engine.cli.listen_session import PROGRESS_MIN_S, ListenSession
from engine.cli.recognizer import add_recognizer_arguments, sphinx_options
from engine.cli.serve import DEFAULT_STREAM
from engine.distribution import install_hint
from engine.errors import EngineError, unwrapped

SERVE_DEFAULT = "127.0.0.1:8765"


# -- the command ------------------------------------------------------------------------


def add_listen_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "listen",
        help="live subtitles from speech: a WAV file, or raw PCM on stdin",
        description=(
            f"Recognize speech (pocketsphinx: {install_hint('asr')}) and translate it as "
            "it is heard. AUDIO is a WAV file, or - for raw 16-bit little-endian mono PCM "
            "on stdin at --rate Hz (e.g. arecord -f S16_LE -c 1 -r 16000 -t raw | "
            "nmt-incremental listen -). On a terminal the subtitles form in place (the "
            "tentative tail dimmed); otherwise stdout gets the updates as JSON Lines. "
            "Ctrl-C ends the input: what was heard is still finished and written. "
            "Exits 1 when the recognizer failed, an event was refused or a final could "
            "not be translated."
        ),
    )
    add_model_arguments(p)
    add_decode_arguments(p)
    add_policy_argument(p)
    p.add_argument("audio", help="a WAV file, or - for raw 16-bit mono PCM on stdin")
    p.add_argument(
        "--rate",
        type=audio_rate,
        default=None,
        metavar="HZ",
        help="the sample rate of raw audio on stdin (default 16000; a WAV file says its own)",
    )
    p.add_argument("--out", metavar="FILE", help="write the JSON Lines of updates here")
    p.add_argument("--vtt", metavar="FILE", help="write the finals as WebVTT subtitles")
    p.add_argument("--srt", metavar="FILE", help="write the finals as SubRip (.srt) subtitles")
    p.add_argument(
        "--transcript-log",
        metavar="FILE",
        help="write the recognizer's partial transcripts as a transcript log (emit_ms: the "
        "audio heard when each was made), for `nmt-incremental replay`",
    )
    p.add_argument("--stream-id", default=DEFAULT_STREAM, help="the stream's id (default: demo)")
    p.add_argument(
        "--realtime",
        action="store_true",
        help="feed the audio at its real speed, as a live microphone would (default: as "
        "fast as recognition goes)",
    )
    p.add_argument(
        "--serve",
        nargs="?",
        const=SERVE_DEFAULT,
        default=None,
        metavar="[HOST:]PORT",
        help=f"also show the subtitles on a subtitle page served from this process "
        f"(default {SERVE_DEFAULT}); it keeps serving after the input ends, until Ctrl-C",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"a progress line on stderr (default: for files over {PROGRESS_MIN_S:g} s "
        "when stderr is a terminal and stdout is not)",
    )
    add_recognizer_arguments(p.add_argument_group("recognizer (pocketsphinx)"))


def parse_serve(value: str) -> tuple[str, int]:
    """`[HOST:]PORT` (an IPv6 host in brackets) as (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", value
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--serve {value!r}: expected [HOST:]PORT") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"--serve {value!r}: the port must be between 0 and 65535")
    return host, number


def open_source(args: argparse.Namespace, stdin: IO[bytes]) -> PcmSource:
    if args.audio == "-":
        return RawSource(stdin, args.rate or 16_000)
    source = WavSource(args.audio)
    if args.rate is not None and args.rate != source.rate:
        source.close()
        raise AudioFileError(
            f"{args.audio} says {source.rate} Hz; --rate is for raw audio on stdin"
        )
    return source


def run_listen(
    args: argparse.Namespace,
    stdin: BinaryIO,
    stdout: TextIO,
    stderr: TextIO,
    *,
    terminal: bool | None = None,
) -> int:
    """Listen: check the options and the audio, make the recognizer, load the model, run.
    `terminal`: whether stdout is a person's terminal (None: ask it)."""
    try:
        return _run_listen(args, stdin, stdout, stderr, terminal=terminal)
    except ValueError as exc:  # an option out of range (AudioFileError is an EngineError)
        if isinstance(exc, EngineError):
            raise
        print(f"error: {exc}", file=stderr)
        return 2


def _run_listen(
    args: argparse.Namespace,
    stdin: BinaryIO,
    stdout: TextIO,
    stderr: TextIO,
    *,
    terminal: bool | None,
) -> int:
    serve = parse_serve(args.serve) if args.serve else None
    streaming = streaming_options(args)
    with contextlib.ExitStack() as stack:
        options = sphinx_options(args, stack, lambda line: print(f"warning: {line}", file=stderr))
        recognizer = SphinxRecognizer(options)  # before the model: a missing extra fails fast
        source = open_source(args, stdin)
        stack.callback(source.close)
        translator = load_translator(args, read_glossary(args))
        view = not args.out and (stdout.isatty() if terminal is None else terminal)
        session = ListenSession(args, stdout, stderr, view=view, duration_s=source.duration_s)
        try:
            with unwrapped():  # e.g. the port `--serve` asked for is taken: one OSError
                return anyio.run(session.run, translator, streaming, recognizer, source, serve)
        except OSError as exc:
            if serve is None or not is_bind_error(exc):
                raise
            host, port = serve
            print(f"error: {bind_error(exc, host, port, '--serve')}", file=stderr)
            return 2
    return 2  # unreachable: the `with` returns (mypy cannot tell)
