"""`nmt-incremental listen`: speech in, live subtitles out.

A WAV file, or raw 16-bit mono PCM on stdin (`-`, e.g. from `arecord` or `ffmpeg`), goes
through a recognizer (pocketsphinx, the `[asr]` extra) into the incremental translator:
`engine.streaming.recognizer.Transcriber` runs the recognizer off the event loop and
pushes its partial transcripts, as a speech pipeline would. On a terminal the subtitles
form in place (stable text, then the tentative tail dimmed; each final as a line); to a
file or a pipe the updates go as JSON Lines (the wire's `translation_update` messages).
`--vtt`/`--srt` write the finals as subtitles, timed by the audio; `--serve` also shows
them on the subtitle page of a `SubtitleServer` run in this process.

`feed_audio` and the audio sources are what `examples/speech/evaluate.py` uses too, so
the evaluation measures this pipeline and not a copy of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import secrets
import signal
import sys
import time
import wave
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol, TextIO

import anyio
import numpy as np
from tqdm import tqdm  # type: ignore[import-untyped]

import protocol
from engine import subtitles
from engine.asr import SphinxRecognizer
from engine.cli.args import (
    add_decode_arguments,
    add_model_arguments,
    add_policy_argument,
    decode_options,
    load_translator,
)
from engine.cli.recognizer import add_recognizer_arguments, sphinx_options
from engine.cli.replay import LiveView, _columns
from engine.cli.serve import DEFAULT_STREAM, page_url
from engine.decoding.translator import Translator
from engine.errors import EngineError
from engine.replay import TimedUpdate
from engine.streaming import IncrementalTranslator, StreamingOptions, Subscription, parse_policy
from engine.streaming.recognizer import (
    RecognizerFailed,
    Transcriber,
    check_rate,
)
from protocol import ErrorMessage, PartialTranscript, TranslationUpdate

if sys.version_info < (3, 11):  # pragma: no cover (anyio brings the backport there)
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger(__name__)

DEFAULT_MODEL = "models/fixture/model"
CHUNK_MS = 100  # audio per recognizer call: a live microphone's usual buffer
PROGRESS_MIN_S = 30.0
"""Files shorter than this get no progress line unless asked (`--progress`)."""
SERVE_DEFAULT = "127.0.0.1:8765"


class AudioFileError(EngineError, ValueError):
    """An audio file this command cannot read (the message says how to convert it)."""


# -- audio sources ----------------------------------------------------------------------


class AudioSource(Protocol):
    """16-bit little-endian mono PCM at `rate`, read `frames` at a time (b"" at the end).
    `duration_s`: None when unknown (a pipe). `blocking`: reads may wait for the data to
    be made (a live pipe), so they run in a worker thread."""

    rate: int
    duration_s: float | None
    blocking: bool

    def read(self, frames: int) -> bytes: ...

    def close(self) -> None: ...


class WavSource:
    """A WAV file of integer PCM (8, 16, 24 or 32 bits; several channels are mixed down
    to one), at any rate the recognizer seam takes."""

    blocking = False

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        convert = f"convert it, e.g. ffmpeg -i {self.path} -ac 1 -ar 16000 -c:a pcm_s16le OUT.wav"
        try:
            # Open across reads, closed by `close` (the caller's ExitStack).
            self._wav = wave.open(str(self.path), "rb")  # noqa: SIM115
        except (wave.Error, EOFError) as exc:
            raise AudioFileError(
                f"{self.path}: not a WAV file of integer PCM ({exc}); {convert}"
            ) from None
        self.channels = self._wav.getnchannels()
        self.width = self._wav.getsampwidth()
        if self.width not in (1, 2, 3, 4):
            self._wav.close()
            raise AudioFileError(f"{self.path}: {8 * self.width}-bit samples; {convert}")
        try:
            self.rate = check_rate(self._wav.getframerate())
        except EngineError as exc:
            self._wav.close()
            raise AudioFileError(f"{self.path}: {exc}") from None
        self.duration_s: float | None = self._wav.getnframes() / self.rate

    def read(self, frames: int) -> bytes:
        raw = self._wav.readframes(frames)
        if not raw:
            return b""
        return to_mono16(raw, self.width, self.channels)

    def close(self) -> None:
        self._wav.close()


class RawSource:
    """Raw 16-bit little-endian mono PCM from a binary stream (stdin), at `rate` Hz."""

    blocking = True
    duration_s: float | None = None

    def __init__(self, stream: IO[bytes], rate: int) -> None:
        self.stream = stream
        self.rate = check_rate(rate)

    def read(self, frames: int) -> bytes:
        data: bytes | None = self.stream.read(frames * 2)
        return data or b""

    def close(self) -> None:
        pass


def to_mono16(raw: bytes, width: int, channels: int) -> bytes:
    """WAV frames of `width`-byte integer samples and `channels` channels as 16-bit mono
    (channels averaged; 8-bit WAV is unsigned, the others signed little-endian)."""
    if width == 2 and channels == 1:
        return raw
    count = len(raw) // width
    data = np.frombuffer(raw[: count * width], dtype=np.uint8).reshape(count, width)
    if width == 1:
        samples = (data[:, 0].astype(np.int32) - 128) << 8
    else:  # the two most significant bytes of a little-endian sample
        top = data[:, width - 2 :].copy()
        samples = top.view("<i2").reshape(count).astype(np.int32)
    frames = samples[: len(samples) // channels * channels].reshape(-1, channels)
    mono = np.rint(frames.mean(axis=1)) if channels > 1 else frames[:, 0]
    out: bytes = np.clip(mono, -32768, 32767).astype("<i2").tobytes()
    return out


# -- the pipeline: audio into the transcriber ------------------------------------------


@dataclass
class Fed:
    """What `feed_audio` did: the audio it fed, the recognizer's failures, and each
    batch of events with the audio heard when they were made (their `emit_ms`)."""

    heard_ms: float = 0.0
    failures: list[RecognizerFailed] = field(default_factory=list)
    events: list[tuple[PartialTranscript, float]] = field(default_factory=list)
    started: float = 0.0  # `time.perf_counter()` when the first chunk was read
    wall_s: float = 0.0


async def feed_audio(
    transcriber: Transcriber,
    source: AudioSource,
    *,
    realtime: bool = False,
    stop: anyio.Event | None = None,
    close: bool = True,
    chunk_ms: int = CHUNK_MS,
    on_events: Callable[[list[PartialTranscript], float], None] | None = None,
    on_audio: Callable[[float], None] | None = None,
) -> Fed:
    """Feed `source` to `transcriber` chunk by chunk, then finish it (`close`: close the
    translator's stream too, which returns once its finals are published).

    `realtime`: a chunk is fed once its audio would have been captured (a file played as
    a live microphone); else as fast as recognition goes. `stop`: when set, the input
    ends there (what was heard is still finished). A failing recognizer is logged and
    the audio goes on (`Fed.failures`). `on_events` sees each batch of events with the
    audio heard; `on_audio` the audio heard after each chunk.
    """
    fed = Fed()
    frames = max(1, source.rate * chunk_ms // 1000)
    fed.started = started = time.perf_counter()

    def report(events: list[PartialTranscript]) -> None:
        heard = transcriber.stream.heard_ms
        fed.events += [(event, heard) for event in events]
        if on_events is not None and events:
            on_events(events, heard)

    def failed(exc: RecognizerFailed) -> list[PartialTranscript]:
        log.error("%s: %s", exc, exc.__cause__)
        fed.failures.append(exc)
        return exc.events

    while stop is None or not stop.is_set():
        data = await _read(source, frames, stop)
        if not data:
            break
        if realtime:
            due = started + (transcriber.stream.heard_ms + len(data) * 500 / source.rate) / 1000
            await anyio.sleep(max(0.0, due - time.perf_counter()))
        try:
            events = await transcriber.feed(data)
        except RecognizerFailed as exc:
            events = failed(exc)
        report(events)
        fed.heard_ms = transcriber.stream.heard_ms
        if on_audio is not None:
            on_audio(fed.heard_ms)
    try:
        events = await transcriber.finish(close=close)
    except RecognizerFailed as exc:
        events = failed(exc)
    report(events)
    fed.heard_ms = transcriber.stream.heard_ms
    fed.wall_s = time.perf_counter() - started
    return fed


async def _read(source: AudioSource, frames: int, stop: anyio.Event | None) -> bytes:
    """The next chunk; a blocking source is read in a thread, given up when `stop` is set
    (b"": the input ends)."""
    if not source.blocking:
        return source.read(frames)
    data = b""
    async with anyio.create_task_group() as group:

        async def read() -> None:
            nonlocal data
            data = await anyio.to_thread.run_sync(source.read, frames, abandon_on_cancel=True)
            group.cancel_scope.cancel()

        async def wait_stop() -> None:
            if stop is not None:
                await stop.wait()
                group.cancel_scope.cancel()

        group.start_soon(read)
        group.start_soon(wait_stop)
    return data


# -- the command ------------------------------------------------------------------------


def add_listen_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "listen",
        help="live subtitles from speech: a WAV file, or raw PCM on stdin",
        description=(
            "Recognize speech (pocketsphinx: pip install -e '.[asr]') and translate it as "
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
    for action in p._actions:  # the fixture by default, as in the README's first steps
        if action.dest == "model":
            action.required = False
            action.default = DEFAULT_MODEL
            action.help = f"{action.help} (default: {DEFAULT_MODEL})"
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


def audio_rate(value: str) -> int:
    """A sample rate the recognizer seam takes, checked while parsing."""
    try:
        return check_rate(int(value))
    except ValueError as exc:  # AudioFormatError is one, and int("x") raises one
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def open_source(args: argparse.Namespace, stdin: IO[bytes]) -> AudioSource:
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
    streaming = StreamingOptions(
        policy=parse_policy(args.policy) if args.policy else None,
        decode=decode_options(args),
        forced_length_ratio=args.forced_length_ratio,
        source_agreement=args.source_agreement,
        settled_source=args.settled_source,
        drafts=args.drafts,
    )
    with contextlib.ExitStack() as stack:
        options = sphinx_options(args, stack, lambda line: print(f"warning: {line}", file=stderr))
        recognizer = SphinxRecognizer(options)  # before the model: a missing extra fails fast
        source = open_source(args, stdin)
        stack.callback(source.close)
        translator = load_translator(args)
        view = not args.out and (stdout.isatty() if terminal is None else terminal)
        listener = _Listener(args, stdout, stderr, view=view, duration_s=source.duration_s)
        try:
            return anyio.run(listener.run, translator, streaming, recognizer, source, serve)
        except BaseExceptionGroup as group:
            raise _sole(group) from None
    return 2  # unreachable: the `with` returns (mypy cannot tell)


def _sole(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception inside task groups' wrappers (e.g. the port `--serve` asked for
    is taken: an `OSError` that `main` reports in one line), else the group itself."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else group


class ListenView(LiveView):
    """`replay`'s live view for one stream being heard: the count line says how much
    audio was heard (of how much, for a file) instead of a log's events."""

    def __init__(self, out: TextIO, stream_id: str, duration_s: float | None, **kw: Any) -> None:
        super().__init__(out, segments=0, streams=[stream_id], log_span_ms=0.0, **kw)
        self.duration_s = duration_s
        self.heard_ms = 0.0

    @classmethod
    def on_terminal(
        cls,
        out: TextIO,
        stream_id: str,
        duration_s: float | None,
        env: Mapping[str, str] | None = None,
    ) -> ListenView:
        env = os.environ if env is None else env
        return cls(
            out,
            stream_id,
            duration_s,
            width=_columns(out, env),
            ansi=env.get("TERM", "") != "dumb",
            color="NO_COLOR" not in env,
        )

    def tick(self, heard_ms: float) -> None:
        """More audio was heard: redraw the count now and then."""
        self.heard_ms = heard_ms
        now = time.monotonic()
        if self.ansi and now - self._last_draw >= max(self.interval, 0.2):
            self._draw(now)

    def _count(self) -> str:
        heard = f"heard {self.heard_ms / 1000:.1f} s"
        if self.duration_s:
            heard += f" of {self.duration_s:.1f} s"
        return f"{heard} · {self.final_count} finals · {self.updates} updates"


class _Listener:
    """One `listen` run: the engine, the recognizer's feed, the outputs."""

    def __init__(
        self,
        args: argparse.Namespace,
        stdout: TextIO,
        stderr: TextIO,
        *,
        view: bool,
        duration_s: float | None,
    ) -> None:
        self.args = args
        self.stdout = stdout
        self.stderr = stderr
        self.view = ListenView.on_terminal(stdout, args.stream_id, duration_s) if view else None
        self.duration_s = duration_s
        self.finals: list[subtitles.Final] = []
        self.errors = 0
        self.stop = anyio.Event()

    async def run(
        self,
        translator: Translator,
        streaming: StreamingOptions,
        recognizer: SphinxRecognizer,
        source: AudioSource,
        serve: tuple[str, int] | None,
    ) -> int:
        args = self.args
        with contextlib.ExitStack() as files:
            out: TextIO | None = None
            if args.out:
                out = files.enter_context(open(args.out, "w", encoding="utf-8"))
            elif self.view is None:
                out = self.stdout
            events_log = None
            if args.transcript_log:
                events_log = files.enter_context(open(args.transcript_log, "w", encoding="utf-8"))
            progress = self._progress(source)
            async with IncrementalTranslator(translator, streaming) as nmt:
                sub = nmt.updates(args.stream_id)  # before the first push: nothing missed
                transcriber = Transcriber(nmt, recognizer, args.stream_id, sample_rate=source.rate)
                server = await self._serve(nmt, serve) if serve else None
                try:
                    async with anyio.create_task_group() as signals:
                        signals.start_soon(self._watch_signals)
                        fed = await self._feed(
                            nmt, sub, out, events_log, progress, transcriber, source, server
                        )
                        signals.cancel_scope.cancel()
                finally:
                    if server is not None:
                        await server.__aexit__(None, None, None)
        if self.view is not None:
            self.view.close()
        for path, kind in ((args.vtt, "vtt"), (args.srt, "srt")):
            if path:
                written = subtitles.write(path, subtitles.layout(self.finals), kind)
                print(f"subtitles: {written}", file=self.stderr)
        self._summary(fed, transcriber)
        failed = fed.failures or transcriber.refused or self.errors
        return 1 if failed else 0

    async def _feed(
        self,
        nmt: IncrementalTranslator,
        sub: Subscription,
        out: TextIO | None,
        events_log: TextIO | None,
        progress: Any,
        transcriber: Transcriber,
        source: AudioSource,
        server: Any,
    ) -> Fed:
        """Feed the audio while the updates are shown; returns once the last is shown."""
        args = self.args

        def logged(events: list[PartialTranscript], heard: float) -> None:
            if events_log is not None:
                for event in events:
                    events_log.write(transcript_line(event, heard) + "\n")

        def heard(ms: float) -> None:
            if self.view is not None:
                self.view.tick(ms)
            if progress is not None:
                progress.update(ms / 1000 - progress.n)

        async with anyio.create_task_group() as group:
            group.start_soon(self._show, sub, out, transcriber)  # ends with the stream
            fed = await feed_audio(
                transcriber,
                source,
                realtime=args.realtime,
                stop=self.stop,
                close=server is None,
                on_events=logged,
                on_audio=heard,
            )
            if progress is not None:
                progress.close()
            if server is not None:
                await nmt.wait_idle(args.stream_id)
                print("input ended; serving the subtitle page until Ctrl-C", file=self.stderr)
                await self.stop.wait()
                if transcriber.opened:
                    await nmt.close_stream(args.stream_id)
            if not transcriber.opened:  # no stream: nothing would end the subscription
                nmt.unsubscribe(sub)
        return fed

    def _progress(self, source: AudioSource) -> Any:
        show = self.args.progress
        if show is None:
            long = source.duration_s is not None and source.duration_s >= PROGRESS_MIN_S
            show = long and self.view is None and self.stderr.isatty()
        if not show:
            return None
        return tqdm(
            total=round(source.duration_s, 1) if source.duration_s else None,
            unit="s",
            unit_scale=False,
            file=self.stderr,
            leave=False,
            desc="heard",
            bar_format="{desc} {n:.1f}/{total} s {bar} [{elapsed}<{remaining}, {rate_fmt}]",
        )

    async def _serve(self, nmt: IncrementalTranslator, where: tuple[str, int]) -> Any:
        """A `SubtitleServer` for `nmt` in this process. Only viewers are let in: the
        writer's token is a random one nobody knows (listen pushes in-process)."""
        from engine.server import ServerOptions, SubtitleServer

        host, port = where
        options = ServerOptions(host=host, port=port, token=secrets.token_urlsafe(24))
        server = SubtitleServer(nmt, options)
        await server.__aenter__()
        url = page_url(server.url, options, f"stream={self.args.stream_id}")
        print(f"subtitle page: {url}", file=self.stderr)
        if host not in ("127.0.0.1", "::1", "localhost"):
            print(f"warning: serving on {host}: anyone reaching it may watch", file=self.stderr)
        return server

    async def _watch_signals(self) -> None:
        """Ctrl-C once: the input ends, what was heard is finished; twice: quit now."""
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if self.stop.is_set():
                    raise KeyboardInterrupt
                self.stop.set()
                print(
                    "stopping: finishing what was heard (Ctrl-C again to quit)",
                    file=self.stderr,
                )

    async def _show(self, sub: Subscription, out: TextIO | None, transcriber: Transcriber) -> None:
        async for reply in sub:
            if isinstance(reply, ErrorMessage):
                self.errors += 1
                print(f"error: seq {reply.seq}: {reply.message}", file=self.stderr)
                if out is not None:
                    out.write(protocol.serialize(reply) + "\n")
                    out.flush()
                continue
            update: TranslationUpdate = reply
            if update.is_final:
                start = update.start_ms or 0.0
                end = update.end_ms if update.end_ms is not None else start
                self.finals.append(subtitles.Final(start, end, update.stable_text))
            if out is not None:
                out.write(protocol.serialize(update) + "\n")
                out.flush()  # live: each update as it comes
            if self.view is not None:
                heard = transcriber.stream.heard_ms
                self.view.update(TimedUpdate(update, heard, heard))

    def _summary(self, fed: Fed, transcriber: Transcriber) -> None:
        stream = transcriber.stream
        audio_s = fed.heard_ms / 1000
        rtf = stream.busy_s / audio_s if audio_s else math.nan
        print(
            f"heard {audio_s:.1f} s in {fed.wall_s:.1f} s: {len(self.finals)} finals; "
            f"recognition real-time factor {rtf:.3f}"
            + (f"; recognizer failures {len(fed.failures)}" if fed.failures else "")
            + (f"; refused events {len(transcriber.refused)}" if transcriber.refused else "")
            + (f"; errors {self.errors}" if self.errors else ""),
            file=self.stderr,
        )


def transcript_line(event: PartialTranscript, emit_ms: float) -> str:
    """One transcript-log line (`engine.logs`): the event's wire message and `emit_ms`."""
    obj = json.loads(protocol.serialize(event))
    obj["emit_ms"] = round(emit_ms, 3)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
