"""The speech layer's errors: audio it cannot take, a recognizer that cannot be made or
that failed, and the recognition processes' failures."""

from __future__ import annotations

import importlib
from types import ModuleType

from engine.distribution import install_hint
from engine.errors import EngineError
from protocol import PartialTranscript


class RecognizerUnavailable(EngineError):
    """A recognizer cannot be made: its library is not installed, or its model files
    cannot be read (the message says which, and how to fix it)."""


class AudioFormatError(EngineError, ValueError):
    """Audio the seam cannot take: a rate out of range, or data that is not bytes."""


class AudioFileError(EngineError, ValueError):
    """An audio file that cannot be read (the message says how to convert it)."""


class StreamFinished(EngineError, RuntimeError):
    """Audio (or a second flush) after `flush`: the stream's audio has ended."""


class RecognizerFailed(EngineError, RuntimeError):
    """The recognizer raised. The stream goes on (the next chunk is recognized as usual);
    `events` are what was already shown made final (the segment in progress, kept as its
    last partial said, so viewers do not keep a line that never ends) and must still be
    pushed. The recognizer's own exception is the `__cause__`."""

    def __init__(self, stream_id: str, at_ms: float, events: list[PartialTranscript]) -> None:
        super().__init__(
            f"stream {stream_id!r}: the recognizer failed at {at_ms / 1000:.2f} s of audio; "
            "the stream goes on"
        )
        self.stream_id = stream_id
        self.at_ms = at_ms
        self.events = events


class WorkerDied(EngineError, RuntimeError):
    """The worker process holding a stream ended (crashed, was killed, or the pool was
    closed) before answering: the stream's recognizer and the audio in flight are lost."""


class PoolClosed(EngineError, RuntimeError):
    """The pool is closed: no stream opens on it any more."""


class RemoteError(EngineError, RuntimeError):
    """An exception raised in a worker that could not come back as itself (it does not
    pickle): its type and message."""


def import_extra(module: str, extra: str = "asr", package: str | None = None) -> ModuleType:
    """Import an optional recognition library, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RecognizerUnavailable(
            f"speech recognition needs {package or module}, which is not installed: "
            f"{install_hint(extra)}"
        ) from exc
