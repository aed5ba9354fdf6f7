"""`nmt-incremental serve`: run the live-subtitle server until SIGINT/SIGTERM.

`run_serve` (with `engine.cli.serve_args.add_serve_parser`, its command line) is wired
into the main `nmt-incremental` command; `python -m engine.server` runs the same thing on
its own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import signal
import sys
from pathlib import Path
from typing import cast
from urllib.parse import quote

import anyio

from engine.cli.args import (
    bind_error,
    load_targets,
    streaming_options,
)
from engine.cli.parser import Parser
from engine.cli.serve_args import LOOPBACK, add_serve_parser
from engine.cli.serve_audio import audio_input
from engine.cli.workers import BUS_SCHEMES, run_workers
from engine.decoding.targets import Targets
from engine.decoding.translator import Translator
from engine.errors import EngineError
from engine.glossary import Glossary
from engine.server.admission import (
    ConnectionCaps,
    descriptor_limit,
    descriptor_reserve,
)
from engine.server.app import ServerOptions, SubtitleServer
from engine.server.limits import (
    Limits,
)
from engine.server.recorder import RecordDirectoryError, check_directory, record
from engine.streaming.bus import BusUnavailable, UpdateBus
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.redis_bus import RedisBus
from engine.streaming.redis_store import redacted
from engine.streaming.session import StreamingOptions
from engine.streaming.wakeups import coalescing_loop

log = logging.getLogger("engine.server")


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    """The server options a parsed `serve` command line asks for."""
    return ServerOptions(
        host=args.host,
        port=args.port,
        token=args.token or None,
        allowed_origins=tuple(args.allow_origin) if args.allow_origin else None,
        limits=Limits(
            max_message_bytes=args.max_message_bytes,
            max_streams_per_connection=args.max_streams_per_connection,
            rate_limit=args.rate_limit or None,
        ),
        shutdown_timeout=args.shutdown_timeout,
        viewer_token=args.viewer_token or None,
        stream_keys=stream_keys(args.stream_key),
        metrics_token=args.metrics_token or None,
        connections=ConnectionCaps.derive(
            max_connections=args.max_connections,
            max_per_address=args.max_connections_per_address,
            handshake_timeout=args.handshake_timeout,
        ),
        reuse_port=args.reuse_port,
    )


def stream_keys(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """`--stream-key STREAM=SECRET` options as a mapping; a stream given twice is an error."""
    keys: dict[str, str] = {}
    for stream, key in pairs:
        if stream in keys:
            raise ValueError(f"--stream-key names stream {stream!r} twice")
        keys[stream] = key
    return keys


DEFAULT_STREAM = "demo"
"""The stream id the banner's URLs show: the subtitle page's own default (`subtitles.js`)
and `examples/replay_client.py`'s, so that following any of them shows the same stream."""


def page_url(
    base: str, options: ServerOptions, query: str = f"stream={DEFAULT_STREAM}", page: str = ""
) -> str:
    """A viewer page's URL as the log prints it (`page`: "" the subtitle page,
    "transcript" the transcript): with the viewer token when there is one, never with a
    writer's secret."""
    token = f"&token={quote(options.viewer_token, safe='')}" if options.viewer_token else ""
    return f"{base}{page}?{query}{token}"


def describe_roles(options: ServerOptions) -> str:
    """Who may write, watch and read /metrics, for the startup log."""
    writers = "anyone" if options.token is None else "--token"
    if options.stream_keys:
        writers += f" (and {len(options.stream_keys)} stream keys, one stream each)"
    viewers = "anyone" if options.viewer_token is None else "--viewer-token or --token"
    if options.metrics_token is not None:
        metrics = "--metrics-token"
    else:
        metrics = "--token" if options.token is not None else "anyone"
    return f"roles: writers {writers}; viewers {viewers}; /metrics {metrics}"


def describe_connections(caps: ConnectionCaps) -> tuple[str, bool]:
    """The caps on connections for the startup log, and whether they may run the process
    out of descriptors (an explicit --max-connections past what the limit holds)."""
    limit = descriptor_limit()
    tight = caps.descriptors() + descriptor_reserve(limit) > limit
    return f"connections: {caps.describe()} (descriptor limit {limit})", tight


def setup_logging(level: str) -> None:
    """Log at `level` on stderr. `nmt-incremental` installs its handler (WARNING) before it
    knows the command, so the level is set here whatever handlers exist; a server's log
    lines carry a timestamp. websockets' own INFO lines (one per connection) stay off."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root.setLevel(level.upper())
    logging.getLogger("websockets").setLevel(max(logging.WARNING, root.level))


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until a signal; 0 after a graceful stop, 2 on a bad model/option."""
    setup_logging(args.log_level)
    try:
        streaming = streaming_options(args)
        options = options_from_args(args)
        # Before the models: a bad line fails fast (`GlossaryError` is a ValueError).
        args.glossaries = [Glossary.read(path) for path in args.glossary]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.record:
        try:  # before serving: a directory that cannot be written is a bad option
            check_directory(Path(args.record))
        except RecordDirectoryError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.workers > 1:
        return run_workers(args, run_serve)
    if options.host not in LOOPBACK and options.token is None:
        log.warning("listening on %s without --token: anyone reaching it may use it", args.host)
    with contextlib.ExitStack() as stack:
        try:  # before the model: a missing extra or a bad recognizer file fails fast
            audio = audio_input(args, stack)
        except (ValueError, OSError, EngineError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        options = dataclasses.replace(options, audio=audio)
        try:
            loop = coalescing_loop(args.coalesce_ms / 1000)
            return anyio.run(
                _serve, args, options, streaming, backend_options={"loop_factory": loop}
            )
        except KeyboardInterrupt:
            return 130
    return 2  # unreachable: the `with` returns (mypy cannot tell)


async def _serve(
    args: argparse.Namespace, options: ServerOptions, streaming: StreamingOptions
) -> int:
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_watch_signals, stop)
        try:
            status = await _serve_until(stop, args, options, streaming)
        except OSError as exc:  # e.g. the port is taken
            why = bind_error(exc, options.host, options.port, "--port")
            print(f"error: {why}", file=sys.stderr)
            status = 2
        tg.cancel_scope.cancel()
    return status


async def _serve_until(
    stop: anyio.Event,
    args: argparse.Namespace,
    options: ServerOptions,
    streaming: StreamingOptions,
) -> int:
    bus: UpdateBus | None = None
    if args.bus:
        if not args.bus.startswith(BUS_SCHEMES):
            shown = redacted(args.bus)
            print(f"error: --bus {shown!r}: expected redis://HOST:PORT/DB", file=sys.stderr)
            return 2
        bus = RedisBus(args.bus, lease_ms=args.lease_ms, queue_size=options.queue_size)
        try:  # before listening: a node that cannot reach its bus serves nothing
            await bus.start()
        except BusUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        log.info(
            "update bus: %s (node %s, lease %d ms)", redacted(args.bus), bus.node, args.lease_ms
        )
    try:
        return await _serve_with(stop, args, options, streaming, bus)
    finally:
        if bus is not None:
            await bus.aclose()


async def _serve_with(
    stop: anyio.Event,
    args: argparse.Namespace,
    options: ServerOptions,
    streaming: StreamingOptions,
    bus: UpdateBus | None,
) -> int:
    async with SubtitleServer(None, options) as server:
        ws_url = server.url.replace("http", "ws", 1) + "ws"
        log.info("subtitle page: %s (any stream id)", page_url(server.url, options))
        log.info(
            "transcript: %s (its finals, following live; VTT/SRT downloads)",
            page_url(server.url, options, page="transcript"),
        )
        log.info("websocket: %s (writers send partial_transcript, viewers subscribe)", ws_url)
        if options.audio is not None:
            workers = options.audio.workers
            limits = options.audio.limits
            idle = limits.idle_timeout_s
            log.info(
                "audio input: %s, at most %d streams at once (%s per address; %s), "
                "recognized in %s; speaker page: %s%s",
                options.audio.description,
                limits.max_streams,
                limits.per_address or "no cap",
                "no idle timeout" if idle is None else f"ended after {idle:g} s without audio",
                f"{workers} worker process{'es' if workers > 1 else ''}"
                if workers
                else "threads of this process",
                f"{server.url}speak?stream={DEFAULT_STREAM}",
                " (add &token= with the writer token)" if options.token is not None else "",
            )
        log.info("%s", describe_roles(options))
        connections, tight = describe_connections(options.connections)
        log.log(logging.WARNING if tight else logging.INFO, "%s", connections)
        if tight:
            log.warning("the connection caps may exceed the descriptor limit: raise `ulimit -n`")
        for spec in args.model:
            log.info("loading model %s", spec)
        # The recognition processes' cores come off the models' share of the machine.
        targets = await _load(args, stop, options.audio.workers if options.audio else 0)
        if targets is None:
            return 0 if stop.is_set() else 2
        async with (
            IncrementalTranslator(
                targets,
                streaming,
                max_streams=args.max_streams,
                bus=bus,
                glossaries=args.glossaries,
            ) as nmt,
            anyio.create_task_group() as recorders,
        ):
            if args.record:
                # Subscribed before anything is pushed; ends when the engine closes.
                recorders.start_soon(record, nmt, Path(args.record), args.record_format)
                log.info("recording finals to %s (%s)", args.record, args.record_format)
            server.attach(nmt)
            for translator in targets.values():
                log.info("model: %s", describe_model(translator))
            if len(targets) > 1:
                log.info(
                    "languages: %s; subtitle pages: %s",
                    ", ".join(
                        f"{lang} (default)" if lang == targets.default else lang for lang in targets
                    ),
                    ", ".join(
                        page_url(server.url, options, f"stream={DEFAULT_STREAM}&lang={lang}")
                        for lang in targets
                    ),
                )
            log.info("ready")
            if args.worker_ready is not None:
                args.worker_ready.set()
            await stop.wait()
            log.info(
                "shutting down: finishing pending finals (--shutdown-timeout %gs)",
                options.shutdown_timeout,
            )
            await server.shutdown()
            await nmt.aclose()  # ends the recorder's subscription after the last final
        stats = nmt.stats
    log.info(
        "delivered %d updates (%d finals) for %d transcripts; %d errors; stopped",
        stats["updates"],
        stats["finals"],
        stats["events"],
        stats["errors"] + stats["rejected"],
    )
    return 0


def describe_model(translator: Translator) -> str:
    """One line on what was loaded: where from, the language pair, the decoder layout and
    the files it runs (which of merged/split and fp32/int8 a directory offers is chosen at
    load, so the user should see it)."""
    model, config = translator.model, translator.config
    pair = f"{config.source_lang or '?'}->{config.target_lang or '?'}"
    lanes = translator.scheduler.lanes
    threads = model.options.intra_op_threads or translator.scheduler.threads_per_lane
    files = ", ".join(sorted({path.name for path in model.files.values()}))
    how = " (split at load)" if model.split_at_load else ""
    batching = f"{translator.scheduler.batching} batching"
    rows = translator.scheduler.options.max_rows
    head = ""
    if model.masked is not None and model.masked.head is not None:
        head = f", output projection on {model.options.head_threads}"
        if model.masked.steps.alone is not None:
            head += f" ({model.options.alone_head_threads} alone)"
    if model.int8_activations:
        head += f"; int8 activations {model.int8_activations}"
    return (
        f"{model.model_dir} ({pair}, {model.layout.value} decoder{how}: {files}; "
        f"{batching}, up to {rows} rows per step; "
        f"{lanes} lane{'s' if lanes > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"
        f"{head})"
    )


async def _load(args: argparse.Namespace, stop: anyio.Event, recognizers: int) -> Targets | None:
    """Load every model in a thread (health checks answer meanwhile), their scheduler
    told of the `recognizers` cores that recognition processes take; None if a signal
    came first or a model cannot be loaded (the error names it: nothing is served with
    fewer languages than asked for)."""

    def load() -> Targets:
        # Resolving a catalog name may download: in the thread too, not on the event loop.
        return load_targets(args, recognizers=recognizers, machine=args.worker_cores)

    result: Targets | None = None
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            nonlocal result
            try:
                result = await anyio.to_thread.run_sync(load, abandon_on_cancel=True)
            except EngineError as exc:
                print(f"error: {exc}", file=sys.stderr)
            tg.cancel_scope.cancel()

        async def cancel_on_stop() -> None:
            await stop.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(cancel_on_stop)
    return result


async def _watch_signals(stop: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if stop.is_set():
                log.info(
                    "%s again: still shutting down (bounded by --shutdown-timeout)",
                    signal.Signals(signum).name,
                )
            stop.set()


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.server ARGS` (the same options as `nmt-incremental serve`)."""
    parser = Parser(prog="python -m engine.server")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(cast("argparse._SubParsersAction[argparse.ArgumentParser]", commands))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return run_serve(args)
