"""The async API an embedding speech pipeline programs against.

A `typing.Protocol` rather than a base class, so the engine, a remote client speaking the
wire format and test fakes all satisfy it without sharing an ancestor, and so this package
stays free of any engine import.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import Protocol, TypeVar, runtime_checkable

from protocol.messages import ErrorMessage, PartialTranscript, TranslationUpdate

_Engine = TypeVar("_Engine", bound="NmtIncremental")


class InvalidEvent(ValueError):
    """`push` refused an event; `error` is what a server would send back. The stream and
    everything it accepted before carry on."""

    def __init__(self, error: ErrorMessage) -> None:
        super().__init__(error)
        self.error = error

    def __str__(self) -> str:
        return self.error.message


class EngineClosed(RuntimeError):
    """`push` to an engine that is not running: not started, closed, or shut down (a
    server's `unavailable` "shutting down" reply). Nothing was accepted."""


@runtime_checkable
class NmtIncremental(Protocol):
    """A streaming incremental translator of partial ASR transcripts.

    Usage::

        async with engine as nmt:
            await nmt.push(PartialTranscript("mic-1", 0, 0, "hello", is_final=False))
            async for update in nmt.updates("mic-1"):
                show(update.stable_text, update.unstable_text)

    Guarantees, per stream and segment, and per target language for an engine that
    translates each stream into several (each update then says its `lang`, and every
    final transcript gets one reply per language; an `error` without `lang` answers it
    for every language):

    - `stable_text` only grows within a segment: each update's stable text starts with the
      previous one's, so a display may append it. The one exception is a final update with
      `revised=True`, which replaces the line.
    - An update never answers an older `seq` after a newer one: `seq` never decreases
      among a segment's updates, and a segment's updates precede the next segment's. A
      partial with a new `segment_id` abandons an unfinished earlier segment.
    - Every final transcript gets exactly one reply: its final update, whose `stable_text`
      is the offline (whole-sentence) translation of the final transcript, or, if
      translating it failed, an `internal` error about its `seq`; non-final partials may
      be skipped when the engine is busy (latest partial wins), finals never are.
    - Which partials are answered: one whose normalised text (whitespace collapsed)
      differs from the last answered one of its segment, which starts empty. A partial
      repeating the last text, empty or not, gets no update (nothing changed on screen);
      an empty one after text gets one (the line is cleared).
    - Streams are isolated: a bad event, a slow or failing stream never delays, alters or
      ends another stream's updates.
    """

    async def push(self, event: PartialTranscript) -> None:
        """Hand over a partial transcript and return at once, without waiting for
        translation work (a newer partial of the segment supersedes a pending one).

        Raises `InvalidEvent` for an event the stream cannot take (e.g. `out_of_order` for
        a `seq` not above the last one, `limit_exceeded` for too many streams); the stream
        continues as if the event had not been sent. Pushing to an engine that is not
        running raises `EngineClosed`.
        """
        ...

    def updates(
        self, stream_id: str | None = None
    ) -> AsyncIterator[TranslationUpdate | ErrorMessage]:
        """Subscribe to updates of one stream, or of every stream when `stream_id` is None.

        Besides updates it yields an `ErrorMessage` (code `internal`, naming the `seq`) in
        place of the final update of a final transcript whose translation failed, so that
        every final transcript gets exactly one reply.

        Each call is an independent subscription (viewers fan out), started by the call
        itself. It first replays, for each open stream, its last few final updates and the
        latest update of its current segment, so a late subscriber, such as a viewer
        joining mid-talk or a loop started just after the first `push`, shows the last
        lines as they stand; then it yields every later update in the order above. A
        subscriber that falls behind may miss superseded non-final updates but always
        receives final ones. A stream need not be open yet.
        Iteration ends when the stream is closed (for one stream) or the engine is closed.
        """
        ...

    async def close_stream(self, stream_id: str) -> None:
        """End a stream and free its state; its subscriptions end after its last update.

        Final transcripts already pushed are still translated and delivered first; a segment
        left without a final transcript gets no final update. Raises
        `InvalidEvent` (`unknown_stream`) for a stream that is not open. The id may be
        reused afterwards for a new stream, with `seq` starting afresh.
        """
        ...

    async def aclose(self) -> None:
        """Close every stream and release the engine; idempotent."""
        ...

    async def __aenter__(self: _Engine) -> _Engine:
        """Start the engine (load models, spawn workers) and return it."""
        ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """`aclose()`; exceptions are never suppressed."""
        ...
