"""What a recognition process's audio streams cost in memory, and giving freed memory
back to the system.

A recognizer holds tens of MB (pocketsphinx: its acoustic model, dictionary and search),
so a process's memory grows with its open streams; a server caps them per process from a
memory budget (`StreamMemory.streams_within`). The cost is measured, not guessed, in a
fresh process like a recognition worker (`measure`): what the process holds before any
recognizer, what the first recognizer adds (with what later ones share), and what each
further one adds once it has heard speech.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import multiprocessing
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.asr.recognizer import Closable, RecognizerFactory


@functools.cache
def _malloc_trim() -> Any:
    """glibc's `malloc_trim`, or None (another C library)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_memory() -> None:
    """Give the memory freed in the C heap back to the system. A recognizer's model is
    many small allocations among others; freed, they stay in the process (its RSS does
    not fall) until trimmed."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def rss_mb() -> float | None:
    """This process's resident memory in MB (None where /proc does not say)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass(frozen=True)
class StreamMemory:
    """A recognition process's memory, in MB: `base` before any recognizer, `shared` what
    the first recognizer loads that later ones share (the recognition library, a shared
    language model), `per_stream` what each stream adds."""

    base: float
    shared: float
    per_stream: float

    def streams_within(self, budget_mb: float, idle: int = 0) -> int:
        """Open streams a process holds within `budget_mb`, counting `idle` recognizers
        kept for the next streams (0: not even one fits)."""
        room = budget_mb - self.base - self.shared - idle * self.per_stream
        return max(0, math.floor(room / max(self.per_stream, 1.0)))

    def needs(self, streams: int, idle: int = 0) -> float:
        """The budget `streams` open streams need."""
        return self.base + self.shared + (streams + idle) * self.per_stream


def measure(factory: RecognizerFactory, heard_s: float = 1.0) -> StreamMemory | None:
    """What `factory`'s recognizers cost, measured in a fresh process (None where RSS
    cannot be read); each recognizer hears `heard_s` of noise, which its search decodes
    as it would speech."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        figures = pool.apply(_measure_here, (factory, heard_s))
    return None if figures is None else StreamMemory(*figures)


def _measure_here(factory: RecognizerFactory, heard_s: float) -> tuple[float, ...] | None:
    import engine.asr.worker  # noqa: F401  (what a worker imports)

    release_memory()
    sizes = [rss_mb()]
    recognizers = []
    pcm = b""
    for _ in range(3):
        recognizer = factory()
        if not pcm:
            noise = np.random.default_rng(0).normal(0, 3000, int(heard_s * recognizer.sample_rate))
            pcm = noise.clip(-32768, 32767).astype("<i2").tobytes()
        recognizer.accept(pcm)
        recognizers.append(recognizer)
        release_memory()
        sizes.append(rss_mb())
    for recognizer in recognizers:
        if isinstance(recognizer, Closable):
            recognizer.close()
    if any(size is None for size in sizes):
        return None
    base, one, _, three = (float(size or 0.0) for size in sizes)
    per_stream = (three - one) / 2
    return base, max(0.0, one - base - per_stream), per_stream
