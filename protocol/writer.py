"""What a writer owes itself across reconnects: the ledger of its final transcripts.

The service may run as several identical nodes behind a load balancer. A node can die
(its connections drop without a close frame), drain (it closes its writers with 1012,
"service restart"; a single server closes with 1001), or lose the shared store (it then
answers a final it cannot publish with an `unavailable` error). None of these may cost a
final transcript, so a writer follows one rule:

    Keep each final until it is answered. On a dropped connection, a close frame, or an
    `unavailable` or `rate_limited` error about a final, reconnect (through the balancer,
    with a short backoff, bounded in total time) and resend every final not yet answered,
    in order, with its original stream_id, segment_id and seq; then carry on.

A final the server did not take (`rate_limited`) cannot be sent again on the same
connection once a later event of its stream was taken there (a stream takes seqs only in
increasing order); on a new connection the stream starts over and takes it. A writer that
keeps within the server's rate (`Pacer`) meets that rarely.

The server answers a resent final exactly once: from the stream's history if it was
translated already (on any node), else by translating it. Partials are never kept or
resent: the next one supersedes them.

`FinalLedger` is that rule's bookkeeping, without I/O (like `h11` or `websockets`' sans-I/O
core): the connection code tells it what it `sent` and what it `received`, and asks it what
is `owed`. It is shared by `examples/replay_client.py` and `engine/remote.py`. `Pacer` is
the rate a writer keeps, also without I/O: when a message may go, and which partials wait.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from protocol.messages import ErrorCode, ErrorMessage, PartialTranscript, TranslationUpdate

_Key = tuple[str, int]  # (stream_id, seq): what a reply names its final by

_NOT_TAKEN = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.RATE_LIMITED})
"""Errors about a final that do not answer it: it must be sent again."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """How a writer waits between tries to reconnect: `first` seconds, doubling up to
    `most`; an outage (from losing the connection until a new one works) is given up
    after `total` seconds. Short, because a balancer sends the retry to a live node at
    once; doubling, so that a service that is down is not hammered; bounded, so that a
    writer whose service is gone says so instead of waiting for ever."""

    first: float = 0.1
    most: float = 2.0
    total: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.most:
            raise ValueError("Backoff needs 0 < first <= most")
        if self.total < 0:
            raise ValueError("Backoff.total must be >= 0")

    def delay(self, attempt: int) -> float:
        """The longest wait before try number `attempt` (0 for the first) of one outage."""
        return min(self.most, self.first * 2.0 ** min(attempt, 64))

    def jittered(self, attempt: int) -> float:
        """The wait to use: between half and all of `delay`, at random, so that the
        writers of a node that died do not all knock on the next one in the same
        instant ("full jitter" would also allow 0; half keeps the doubling's spacing)."""
        return self.delay(attempt) * (0.5 + random.random() / 2)

    def gives_up(self, elapsed: float, attempt: int) -> bool:
        """Whether an outage `elapsed` seconds old is over: the next try would start
        after `total`."""
        return elapsed + self.delay(attempt) > self.total


class Outcome(str, Enum):
    """What one received message means to a writer."""

    ANSWERED = "answered"
    """It answers an owed final in one language (or, an error without `lang`, in all)."""
    DUPLICATE = "duplicate"
    """That final was answered in that language already (a resend raced its first
    answer): count it, do not show it again."""
    MUST_RECONNECT = "must_reconnect"
    """An `unavailable` error about an owed final: this node cannot deliver it (it is
    stopping, or lost the shared store); or a `rate_limited` one: the server did not take
    it. Reconnect and resend what is owed."""
    UNRELATED = "unrelated"
    """Not about a final this ledger keeps: a partial's update, an error about a partial
    or a close, a reply about a final sent by someone else. Show it as it is."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Received:
    """The ledger's reading of one message from the server.

    `final`: the final transcript it is about (None for `UNRELATED`). `lang`: the language
    it answers (None for an error without `lang`, which answers every language, or for a
    server that does not name languages). `complete`: the final is answered in every
    language the ledger knows of, so it is no longer owed.
    """

    outcome: Outcome
    final: PartialTranscript | None = None
    lang: str | None = None
    complete: bool = False


@dataclass(slots=True)
class _Final:
    event: PartialTranscript
    order: int
    sends: int = 0
    answered: set[str | None] = field(default_factory=set)  # languages that answered it
    every_language: bool = False  # an error without `lang` answered it


class FinalLedger:
    """The finals a writer has sent and not yet seen answered, and the replies it saw.

    A final is answered in a language by its final `translation_update` (same stream_id
    and seq, `is_final`), or by an `error` with its seq whose code is not `unavailable` or
    `rate_limited` (a refusal: `out_of_order`, `too_large`, ...). An error with `lang` answers that
    language only; one without answers every language. A final is answered once every
    language the ledger has seen so far (on any update or error) has answered it; before
    any language is known, its first answer is enough. The server may fan out to several
    languages and a writer receives every one; languages are learned from the replies
    (partials' updates included, so they are normally known before the first final), or
    given up front as `languages`.

    `remember`: how many answered finals are kept to recognise duplicates (a resent
    final's answer arriving after its first one); older ones are forgotten, so a very
    late duplicate reads as `UNRELATED`.

    Counters: `answered` (finals answered in every language), `refused` (finals answered,
    in some language, by an error), `resent` (sends of a final after its first),
    `duplicates` (answers received again).
    """

    def __init__(self, languages: Iterable[str | None] = (), *, remember: int = 4096) -> None:
        if remember < 0:
            raise ValueError("remember must be >= 0")
        self.remember = remember
        self._languages: dict[str | None, None] = dict.fromkeys(languages)  # ordered set
        self._owed: dict[_Key, _Final] = {}
        self._done: OrderedDict[_Key, _Final] = OrderedDict()
        self._order = 0
        self.answered = 0
        self.refused = 0
        self.resent = 0
        self.duplicates = 0

    # --- what the writer sends ----------------------------------------------------------

    def sent(self, event: PartialTranscript) -> None:
        """Record an event just written to the server. A final is kept until answered;
        sending an owed final again (after a reconnect) counts as a resend. Partials are
        ignored: the next one supersedes them, so none is ever resent."""
        entry = self._keep(event)
        if entry is not None:
            entry.sends += 1
            if entry.sends > 1:
                self.resent += 1

    def hold(self, event: PartialTranscript) -> None:
        """Keep a final that could not be sent (no connection now): it is `owed` and goes
        out with the resends on the next connection. Partials are ignored."""
        self._keep(event)

    def _keep(self, event: PartialTranscript) -> _Final | None:
        if not event.is_final:
            return None
        key = (event.stream_id, event.seq)
        entry = self._owed.get(key)
        if entry is not None and entry.event == event:
            return entry
        # A new final under a known key (a stream closed and opened again numbers from 0):
        # what was answered under that key says nothing about this one.
        self._done.pop(key, None)
        entry = _Final(event, self._order if entry is None else entry.order)
        self._order += 1
        self._owed[key] = entry
        return entry

    # --- what the writer receives -------------------------------------------------------

    def received(self, message: TranslationUpdate | ErrorMessage) -> Received:
        """Read one reply from the server (see `Outcome`)."""
        if isinstance(message, TranslationUpdate):
            self._languages.setdefault(message.lang)
            if not message.is_final:
                return Received(Outcome.UNRELATED)
            return self._answer((message.stream_id, message.seq), message.lang, False)
        if message.stream_id is None or message.seq is None:
            return Received(Outcome.UNRELATED)
        key = (message.stream_id, message.seq)
        if message.code in _NOT_TAKEN:
            return self._not_taken(key, message.lang)
        if message.lang is not None:
            self._languages.setdefault(message.lang)
        return self._answer(key, message.lang, True)

    def _answer(self, key: _Key, lang: str | None, error: bool) -> Received:
        every = error and lang is None
        entry = self._owed.get(key)
        if entry is not None:
            if entry.every_language or (not every and lang in entry.answered):
                self.duplicates += 1
                return Received(Outcome.DUPLICATE, entry.event, lang, False)
            entry.answered.add(lang)
            entry.every_language |= every
            if error:
                self.refused += 1
            complete = self._complete(entry)
            if complete:
                del self._owed[key]
                self._remember(key, entry)
                self.answered += 1
            return Received(Outcome.ANSWERED, entry.event, lang, complete)
        entry = self._done.get(key)
        if entry is None:
            return Received(Outcome.UNRELATED)
        if entry.every_language or every or lang in entry.answered:
            self.duplicates += 1
            return Received(Outcome.DUPLICATE, entry.event, lang, True)
        # A language learned after the final was answered in the others: its answer is
        # new (not a duplicate), and the final stays answered.
        entry.answered.add(lang)
        if error:
            self.refused += 1
        return Received(Outcome.ANSWERED, entry.event, lang, True)

    def _not_taken(self, key: _Key, lang: str | None) -> Received:
        entry = self._owed.get(key)
        if entry is not None:
            return Received(Outcome.MUST_RECONNECT, entry.event, lang)
        entry = self._done.get(key)
        if (
            entry is not None
            and lang is not None
            and lang not in entry.answered
            and not entry.every_language
        ):
            # Answered in the languages known then, but cut off in one learned since:
            # owed again, in its place among the others.
            self._languages.setdefault(lang)
            del self._done[key]
            self._owed[key] = entry
            self.answered -= 1
            return Received(Outcome.MUST_RECONNECT, entry.event, lang)
        return Received(Outcome.UNRELATED)

    def _complete(self, entry: _Final) -> bool:
        return entry.every_language or all(lang in entry.answered for lang in self._languages)

    def _remember(self, key: _Key, entry: _Final) -> None:
        if self.remember == 0:
            return
        self._done[key] = entry
        while len(self._done) > self.remember:
            self._done.popitem(last=False)

    # --- what the writer owes -----------------------------------------------------------

    def owed(self, stream_id: str | None = None) -> list[PartialTranscript]:
        """The finals not yet answered (of one stream, or all), in the order first sent:
        the order to resend them in, since a stream takes seqs only in increasing order."""
        entries = sorted(self._owed.values(), key=lambda entry: entry.order)
        return [e.event for e in entries if stream_id is None or e.event.stream_id == stream_id]

    def missing(self, event: PartialTranscript) -> frozenset[str | None]:
        """The known languages that have not answered an owed final yet (empty when it is
        not owed; {None} when no language is known yet)."""
        entry = self._owed.get((event.stream_id, event.seq))
        if entry is None or entry.every_language:
            return frozenset()
        return frozenset(self._languages or {None}) - entry.answered

    @property
    def pending(self) -> int:
        """How many finals are owed."""
        return len(self._owed)

    @property
    def languages(self) -> tuple[str | None, ...]:
        """The target languages seen so far, in the order first seen (None: a server
        that does not name its language)."""
        return tuple(self._languages)


class Pacer:
    """Keeps a writer within a server's rate limit (`rate` messages per second, bursts of
    `burst`: the server's token bucket, kept on the writer's side), so that the server
    drops nothing for being sent too fast.

    A message goes when `take` allows it; a final that finds no turn waits for one
    (`delay`), so no final is dropped, only delayed. A partial that finds no turn waits
    instead as its stream's latest (`park`): a newer one replaces it (latest wins, as the
    engine itself skips stale partials), an event of its stream that goes out first drops
    it (`unpark`), and it goes when a turn comes (`next_parked`), after waiting finals.

    The server's rate is not announced; a `rate_limited` answer says it is below ours:
    `slow_down` halves the rate (at most once per second, since one burst is answered by
    many errors; never below `floor`) and spends what is left of the burst.
    """

    def __init__(
        self, rate: float, burst: float | None = None, *, floor: float = 1.0, now: float = 0.0
    ) -> None:
        if not rate > 0 or (burst is not None and not burst >= 1):
            raise ValueError("Pacer needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst or max(1.0, rate)
        self.floor = min(floor, rate)
        self.tokens = self.burst
        self.updated = now
        self.coalesced = 0  # partials replaced or dropped by a newer event of their stream
        self.slowed = 0  # times the rate was halved
        self._slowed_at: float | None = None
        self._parked: dict[str, PartialTranscript] = {}

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def delay(self, now: float) -> float:
        """Seconds until a message may go (0: now)."""
        self._refill(now)
        return 0.0 if self.tokens >= 1.0 else (1.0 - self.tokens) / self.rate

    def take(self, now: float) -> bool:
        """Spend a turn if there is one."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def slow_down(self, now: float) -> None:
        """The server answered `rate_limited`: keep to half the rate from now on."""
        self._refill(now)
        self.tokens = min(self.tokens, 0.0)
        if self._slowed_at is not None and now - self._slowed_at < 1.0:
            return
        self._slowed_at = now
        if self.rate > self.floor:
            self.rate = max(self.floor, self.rate / 2)
            self.burst = max(1.0, min(self.burst, self.rate))
            self.slowed += 1

    def park(self, event: PartialTranscript) -> None:
        """Keep a partial that found no turn, as its stream's latest."""
        if event.stream_id in self._parked:
            self.coalesced += 1  # replaced, in its place in the line
        self._parked[event.stream_id] = event

    def unpark(self, stream_id: str) -> None:
        """A newer event of the stream goes out: its waiting partial is superseded."""
        if self._parked.pop(stream_id, None) is not None:
            self.coalesced += 1

    def next_parked(self) -> PartialTranscript | None:
        """The partial that has waited longest (its stream's latest), taken out."""
        for stream_id in self._parked:
            return self._parked.pop(stream_id)
        return None

    @property
    def parked(self) -> int:
        """How many partials wait (one per stream at most)."""
        return len(self._parked)
