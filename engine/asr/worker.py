"""The worker side of the recognition pool (`engine.asr.pool`): the messages down a
worker's pipe, the outcomes that come back, and the loop a worker process runs.

A worker holds the `RecognizerStream`s of the streams pinned to it and answers requests in
the order they come. Everything that crosses the pipe is a plain dataclass that pickles; an
exception that does not pickle comes back as a `RemoteError` with its type and message.
"""

from __future__ import annotations

import multiprocessing.connection
import pickle
import signal
from dataclasses import dataclass
from typing import TypeAlias

from engine.asr.errors import RecognizerFailed, RemoteError
from engine.asr.recognizer import RecognizerFactory, RecognizerStream
from protocol import PartialTranscript

# -- requests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Open:
    key: int
    stream_id: str
    sample_rate: int | None
    first_segment: int
    first_seq: int
    offset_ms: float


@dataclass(frozen=True)
class Accept:
    key: int
    pcm: bytes


@dataclass(frozen=True)
class Flush:
    key: int


@dataclass(frozen=True)
class Drop:
    """Forget a stream (no answer): its feed ended without a flush."""

    key: int


@dataclass(frozen=True)
class Stop:
    """Exit once everything sent before is answered."""


Request: TypeAlias = "Open | Accept | Flush | Drop | Stop"


# -- outcomes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Opened:
    """A stream was opened: the rate its audio comes at (the recognizer's, when the
    caller gave none)."""

    rate_in: int


@dataclass(frozen=True)
class Heard:
    """A call's events, and the wall and CPU time it took in the worker."""

    events: list[PartialTranscript]
    busy_s: float
    cpu_s: float


@dataclass(frozen=True)
class Failed:
    """The recognizer raised (`RecognizerFailed` in the worker): its events and cause."""

    events: list[PartialTranscript]
    at_ms: float
    cause: BaseException
    busy_s: float
    cpu_s: float


@dataclass(frozen=True)
class Raised:
    """The call itself was refused or broke (bad audio, a recognizer that cannot be
    made): the exception, re-raised in the caller."""

    error: BaseException


Outcome: TypeAlias = "Opened | Heard | Failed | Raised"


# -- the worker process --------------------------------------------------------------------


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling both ways (so the reader thread can load it), else a
    `RemoteError` with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RemoteError(f"{type(exc).__name__}: {exc}")
    return exc


def serve(conn: multiprocessing.connection.Connection, factory: RecognizerFactory) -> None:
    """A worker's loop: answer requests in order until `Stop` or the pipe closes.

    SIGINT and SIGTERM are ignored: a Ctrl-C or a service manager signals the whole
    process group, and the server still needs its workers to flush while it drains."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    streams: dict[int, RecognizerStream] = {}
    while True:
        try:
            rid, message = conn.recv()
        except (EOFError, OSError):
            return  # the server is gone
        if isinstance(message, Stop):
            return
        try:
            outcome = handle(streams, factory, message)
        except Exception as exc:  # a bug here: that call fails, the worker goes on
            outcome = Raised(RemoteError(f"{type(exc).__name__}: {exc}"))
        if rid is None or outcome is None:
            continue
        try:
            conn.send((rid, outcome))
        except (OSError, ValueError):
            return  # the server is gone
        except Exception as exc:  # an outcome that does not pickle: that call fails
            try:
                conn.send((rid, Raised(RemoteError(f"{type(exc).__name__}: {exc}"))))
            except OSError:
                return


def handle(
    streams: dict[int, RecognizerStream], factory: RecognizerFactory, message: Request
) -> Outcome | None:
    """One request's outcome (None: it has no answer)."""
    if isinstance(message, Open):
        try:
            made = RecognizerStream(
                factory(),
                message.stream_id,
                sample_rate=message.sample_rate,
                first_segment=message.first_segment,
                first_seq=message.first_seq,
                offset_ms=message.offset_ms,
            )
        except Exception as exc:
            return Raised(portable(exc))
        streams[message.key] = made
        return Opened(made.rate_in)
    if isinstance(message, Drop):
        dropped = streams.pop(message.key, None)
        if dropped is not None:
            dropped.close()
        return None
    assert isinstance(message, (Accept, Flush))
    stream = streams.get(message.key)
    if stream is None:
        return Raised(RemoteError(f"stream key {message.key} is not open in this worker"))
    busy, cpu = stream.busy_s, stream.cpu_s
    try:
        events = stream.accept(message.pcm) if isinstance(message, Accept) else stream.flush()
    except RecognizerFailed as exc:
        cause = portable(exc.__cause__ or exc)
        return Failed(exc.events, exc.at_ms, cause, stream.busy_s - busy, stream.cpu_s - cpu)
    except Exception as exc:
        return Raised(portable(exc))
    finally:
        if stream.finished:  # flushed: nothing more can be asked of it
            streams.pop(message.key, None)
            stream.close()
    return Heard(events, stream.busy_s - busy, stream.cpu_s - cpu)
