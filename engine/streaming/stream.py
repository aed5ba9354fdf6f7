"""One stream as the controller runs it: its lifecycle (moved only by the stream table),
its queue of admitted events, one session per target language, and what latest-wins
needs to abort a superseded partial."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import anyio

from engine.decoding.policy import RequestId
from engine.glossary import Glossary
from engine.replies import Wake, new_event
from engine.streaming.lifecycle import StreamLifecycle
from engine.streaming.session import StreamSession
from protocol import PartialTranscript


@dataclass(frozen=True)
class Admission:
    """An admitted event with its normalised source and its token ids for each target
    language's model, computed once at admission and reused by decoding."""

    event: PartialTranscript
    source: str
    source_ids: Mapping[str, list[int]]


class Stream:
    """The controller's working state for one stream: its queue of admitted events, one
    session per target language and the events its task waits on. Its lifecycle (phase,
    owner, admission record) is held in `life`, which only the stream table moves."""

    def __init__(self, life: StreamLifecycle, sessions: Mapping[str, StreamSession]) -> None:
        self.life = life
        self.sessions = dict(sessions)
        # Admitted events waiting, each with its arrival time.
        self.pending: deque[tuple[Admission, float]] = deque()
        self.wake = Wake()
        self.done = anyio.Event()
        # Busy from an admitted event until its runner finds nothing pending; the event
        # that says it went idle is made only for a waiter (`wait_idle`), not per event.
        self.busy = False
        self._idle: anyio.Event | None = None
        self.current: PartialTranscript | None = None  # the event being translated
        self.answered: set[str] = set()  # languages that answered `current` already
        self.unshown: set[str] = set()  # languages answering `current` to its writer only
        self.cancelled_in_row = 0
        # The id of the current partial's decodes while a newer event may abort them.
        self.abortable: RequestId | None = None
        self.warned_script = False  # said once that its text is in another script
        # Its writer's glossaries (`engine.streaming.own_glossary`): language -> (text, glossary).
        self.own_glossaries: dict[str, tuple[str, Glossary]] = {}
        # Its term counts as last given to the bus (`UpdateBus.keep_terms`); None: not yet.
        self.kept_terms: dict[str, tuple[int, int]] | None = None

    def __repr__(self) -> str:
        return repr(self.life)

    @property
    def stream_id(self) -> str:
        return self.life.stream_id

    @property
    def taking_events(self) -> bool:
        return self.life.taking_events

    @property
    def closed(self) -> bool:
        """Released or aborted: nothing it does is published any more."""
        return self.life.closed

    def terms(self) -> dict[str, tuple[int, int]]:
        """Its glossary terms over its finals so far, per language: (matched, placed)."""
        return {lang: (s.terms_matched, s.terms_placed) for lang, s in self.sessions.items()}

    def carry_terms(self, counts: Mapping[str, tuple[int, int]]) -> None:
        """Go on from the counts an earlier life of the stream kept (a resumed life)."""
        for lang, (matched, placed) in counts.items():
            session = self.sessions.get(lang)
            if session is not None:
                session.terms_matched, session.terms_placed = matched, placed

    def went_idle(self) -> None:
        """Its runner found nothing pending: wake those waiting for it to be idle."""
        self.busy = False
        idle, self._idle = self._idle, None
        if idle is not None:
            idle.set()

    async def wait_idle(self) -> None:
        """Until its runner next finds nothing pending."""
        if self._idle is None:
            self._idle = new_event()
        await self._idle.wait()

    def drop_partials(self) -> int:
        """Latest wins: drop waiting partials (finals stay); returns how many."""
        if not self.pending:  # nearly every event finds none
            return 0
        kept = deque(item for item in self.pending if item[0].event.is_final)
        dropped = len(self.pending) - len(kept)
        self.pending = kept
        return dropped

    def supersede(self) -> None:
        """Latest wins: once a newer event waits, the partial being translated (if it may
        still be cancelled) is aborted in every language's scheduler; its row leaves the
        batch at the next step, or its decode is refused if not submitted yet."""
        if self.pending:
            self.abort_decoding()

    def abort_decoding(self) -> None:
        """Abort the current partial's decodes, when they may be aborted."""
        if self.abortable is not None:
            for session in self.sessions.values():
                session.translator.abort([self.abortable])
