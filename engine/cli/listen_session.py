"""One `listen` run: the engine, the audio fed to its recognizer, and the outputs (JSON
Lines, the terminal view, a progress line, subtitle files, a subtitle page served from this
process), until the input ends or Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import secrets
import signal
from typing import Any, TextIO

import anyio
from tqdm import tqdm  # type: ignore[import-untyped]

import protocol
from engine import subtitles
from engine.asr.audio import PcmSource
from engine.asr.sphinx import SphinxRecognizer
from engine.asr.transcriber import Fed, Transcriber, feed_audio
from engine.cli.listen_view import ListenView
from engine.cli.serve import page_url
from engine.decoding.translator import Translator
from engine.logs.updates import TimedUpdate
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.session import StreamingOptions
from engine.streaming.subscriptions import Subscription
from protocol import ErrorMessage, PartialTranscript, TranslationUpdate

PROGRESS_MIN_S = 30.0
"""Files shorter than this get no progress line unless asked (`--progress`)."""


class ListenSession:
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
        source: PcmSource,
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
        transcriber: Transcriber[Any],
        source: PcmSource,
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

    def _progress(self, source: PcmSource) -> Any:
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
        from engine.server.app import ServerOptions, SubtitleServer

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

    async def _show(
        self, sub: Subscription, out: TextIO | None, transcriber: Transcriber[Any]
    ) -> None:
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

    def _summary(self, fed: Fed, transcriber: Transcriber[Any]) -> None:
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
