"""`ServerState`: the server's one record of whether it takes work.

Every connection shares it, and it is the one place that decides what a loading or
stopping server refuses (handshakes, `/readyz`, messages), so the HTTP answers and the
connections' rules cannot disagree.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from engine.server.handshake import Refusal
from engine.server.limits import AudioSlots
from protocol import ErrorCode, ErrorMessage, Message


class ServerPhase(Enum):
    """Where the server is in its life."""

    LOADING = "loading"  # no model yet: health checks answer, /readyz and /ws do not
    READY = "ready"
    STOPPING = "stopping"  # a shutdown began: nothing new is taken, from then on


@dataclass
class ServerState:
    """What every connection of a server shares: its phase, the one record of whether it
    takes work, and the target languages it translates into, the default (first) one
    first (empty until a model is loaded). Every refusal that a server loading or
    stopping sends is decided here."""

    phase: ServerPhase = ServerPhase.LOADING
    languages: tuple[str, ...] = ()
    # The models' source language (None: unknown): a glossary's header names it first.
    source_language: str | None = None
    # Whether the update bus publishes now (a shared one: Redis reachable); set when an
    # engine is attached. A node cut off from it is not ready: a load balancer sends
    # writers elsewhere.
    bus_ready: Callable[[], bool] | None = field(default=None, repr=False)
    # The close code a stopping server sends: 1001 (going away) alone, 1012 (service
    # restart: reconnect, to another node) when other nodes serve the same streams.
    close_code: int = 1001
    # A stream's glossary terms over its finals, per target language: (matched, placed),
    # from whichever node holds its writer (through the bus); empty for a stream no node
    # has open. Set when an engine is attached.
    stream_terms: Callable[[str], Awaitable[dict[str, tuple[int, int]]]] | None = field(
        default=None, repr=False
    )
    # Audio streams on all connections, from each start_audio until its recognizer is
    # gone (`AudioLimits` caps them).
    audio: AudioSlots = field(default_factory=AudioSlots)

    def attach(self, languages: Iterable[str], source_language: str | None = None) -> None:
        """A model is loaded: ready, unless a shutdown began meanwhile."""
        self.languages = tuple(languages)
        self.source_language = source_language
        if self.phase is ServerPhase.LOADING:
            self.phase = ServerPhase.READY

    def stop(self) -> bool:
        """Begin stopping; False when the server was stopping already."""
        if self.phase is ServerPhase.STOPPING:
            return False
        self.phase = ServerPhase.STOPPING
        return True

    @property
    def ready(self) -> bool:
        """Model loaded, not stopping, and the bus publishing: what `/readyz` reports."""
        return self.phase is ServerPhase.READY and self.bus_up

    @property
    def bus_up(self) -> bool:
        return self.bus_ready is None or self.bus_ready()

    @property
    def stopping(self) -> bool:
        return self.phase is ServerPhase.STOPPING

    def readyz(self) -> tuple[int, str]:
        """`/readyz`'s status and body: 200 ready; 503 loading or cut off from the bus;
        404 draining."""
        if self.ready:
            return 200, "ready\n"
        if self.stopping:
            # 404, not 503: "draining", which a load balancer can tell from "failed"
            # (HAProxy's `http-check disable-on-404` then sends nothing new but keeps the
            # node's connections until it closes them itself, each after its owed finals).
            return 404, "not ready: draining (shutting down)\n"
        why = "model loading"
        if self.phase is ServerPhase.READY:
            why = "the update bus (Redis) cannot take updates (unreachable, or out of memory)"
        return 503, f"not ready: {why}\n"

    def handshake_refusal(self) -> Refusal | None:
        """A 503 for a WebSocket handshake while loading or stopping, else None (a node
        cut off from its bus still lets viewers and writers in: they hear why)."""
        if self.phase is ServerPhase.READY:
            return None
        why = "the server is shutting down" if self.stopping else "the model is loading"
        return Refusal(503, f"Not ready: {why}.\n")

    def shutting_down(self, context: Message | None = None) -> ErrorMessage:
        """The reply to a message that a stopping server (or its closed engine) refuses."""
        return ErrorMessage(
            ErrorCode.UNAVAILABLE,
            "the server is shutting down and takes no new messages",
            stream_id=getattr(context, "stream_id", None),
            seq=getattr(context, "seq", None),
        )
