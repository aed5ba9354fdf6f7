"""`serve --asr`: the speech side of the server's options: the recognizer, how many
recognition processes, and the audio limits that follow from them."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
from typing import Any

from engine.asr.memory import measure
from engine.asr.sphinx import KEEP_IDLE, SphinxOptions, SphinxRecognizer
from engine.cli.args import non_negative_float, non_negative_int, positive_int
from engine.cli.recognizer import RECOGNIZER_OPTIONS, add_recognizer_arguments, sphinx_options
from engine.distribution import install_hint
from engine.server.audio import ASR_KINDS, AudioInput, pocketsphinx_input
from engine.server.limits import AUDIO_STREAMS_PER_WORKER, STARTS_PER_WORKER, AudioLimits

log = logging.getLogger("engine.server")


CORES_PER_ASR_WORKER = 4
"""`--asr-workers`' default: one recognition process per this many cores. A live stream
costs pocketsphinx a small share of a core (examples/benchmarks/audio_streams.py measures
it), so one process carries many real-time speakers; the rest of the cores go to the
models, whose decoder steps are what grows with load."""


def default_asr_workers(cores: int | None = None) -> int:
    """Recognition processes for `cores` cores (default: the machine's): one per
    `CORES_PER_ASR_WORKER`, at least one."""
    return max(1, (cores or os.cpu_count() or 1) // CORES_PER_ASR_WORKER)


def add_audio_arguments(p: argparse.ArgumentParser) -> None:
    """Audio input: `--asr` and the recognizer's options (the same as `listen`'s)."""
    audio = p.add_argument_group("audio input (speech over /ws, and the speaker page /speak)")
    audio.add_argument(
        "--asr",
        choices=ASR_KINDS,
        default=None,
        help="take audio over the WebSocket (start_audio, then binary frames of 16-bit mono "
        f"PCM) and recognize it with this recognizer ({install_hint('asr')}); the speaker "
        "page /speak?stream=ID sends a browser's microphone (default: no audio; writers "
        "send partial_transcript)",
    )
    add_recognizer_arguments(audio)
    audio.add_argument(
        "--max-audio-streams",
        type=positive_int,
        default=None,
        metavar="N",
        help="audio streams at once, on all connections, each from its start_audio until its "
        "recognizer is gone (default: what the recognition processes serve, "
        f"{AUDIO_STREAMS_PER_WORKER} per --asr-workers, at least {AUDIO_STREAMS_PER_WORKER})",
    )
    audio.add_argument(
        "--max-audio-streams-per-address",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="audio streams at once from one client address (0: no cap; default half of "
        "--max-audio-streams)",
    )
    audio.add_argument(
        "--max-audio-starting",
        type=positive_int,
        default=None,
        metavar="N",
        help="audio streams whose recognizer is not made yet, at once; past it a start_audio "
        "is refused for now (rate_limited: send it again shortly), since making one holds up "
        "its process (default: "
        f"{STARTS_PER_WORKER} per --asr-workers, at least {STARTS_PER_WORKER})",
    )
    audio.add_argument(
        "--audio-idle-timeout",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="an audio stream that sends no audio for this long is ended with an error, its "
        "slot freed (0: never; default %(default)s)",
    )
    audio.add_argument(
        "--asr-memory",
        type=positive_int,
        default=None,
        metavar="MB",
        help="memory each recognition process may hold: its audio streams are capped at "
        "what fits, from the recognizer's cost per stream measured at start (the general "
        "en-US model: about 80 MB a stream; a domain model far less); default: no memory cap",
    )
    audio.add_argument(
        "--asr-workers",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="recognition processes; each audio stream is recognized in one of them, and "
        "their cores are taken off the models' share (default: one per "
        f"{CORES_PER_ASR_WORKER} cores, at least 1: {default_asr_workers()} here; 0: "
        "threads of the server process, which pocketsphinx's hold on the GIL keeps to one "
        "core with the event loop)",
    )


def audio_input(args: argparse.Namespace, stack: contextlib.ExitStack) -> AudioInput | None:
    """The audio input `--asr` asks for (None: none), its recognizer made once to check it
    (`RecognizerUnavailable`: a missing extra or an unreadable model file); a
    `--domain-text` model is built into a directory that `stack` removes."""
    given = [name for name in RECOGNIZER_OPTIONS if getattr(args, name, None)]
    if args.asr is None:
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ValueError(f"{flag} is a recognizer option: it needs --asr pocketsphinx")
        for flag in ("asr_workers", "asr_memory"):
            if getattr(args, flag) is not None:
                name = "--" + flag.replace("_", "-")
                raise ValueError(f"{name} is a recognizer option: it needs --asr pocketsphinx")
        return None
    options = sphinx_options(args, stack, log.warning)
    workers = default_asr_workers() if args.asr_workers is None else args.asr_workers
    chosen: dict[str, Any] = {"idle_timeout_s": args.audio_idle_timeout or None}
    if args.max_audio_streams is not None:
        chosen["max_streams"] = args.max_audio_streams
    if args.max_audio_streams_per_address is not None:
        chosen["max_streams_per_address"] = args.max_audio_streams_per_address
    if args.max_audio_starting is not None:
        chosen["max_starting"] = args.max_audio_starting
    if args.asr_memory is not None:
        chosen["streams_per_worker"] = streams_within_memory(options, args.asr_memory)
    limits = AudioLimits.for_workers(workers, **chosen)
    return pocketsphinx_input(options, workers=workers, limits=limits)


def streams_within_memory(options: SphinxOptions, budget_mb: int) -> int:
    """Audio streams one recognition process holds within `budget_mb`, its recognizer's
    cost measured in a process like it (with the idle decoders it keeps for the next
    streams); `ValueError` when not one fits, saying how much one needs."""
    cost = measure(functools.partial(SphinxRecognizer, options))
    if cost is None:
        raise ValueError("--asr-memory needs /proc to measure a recognizer's memory (Linux)")
    streams = cost.streams_within(budget_mb, KEEP_IDLE)
    if streams < 1:
        raise ValueError(
            f"--asr-memory {budget_mb}: one audio stream needs {cost.needs(1, KEEP_IDLE):.0f} "
            "MB in a recognition process with this recognizer"
        )
    log.info(
        "audio: %.0f MB per stream in a recognition process (%.0f MB before the first): "
        "%d streams within --asr-memory %d",
        cost.per_stream,
        cost.base + cost.shared,
        streams,
        budget_mb,
    )
    return streams
