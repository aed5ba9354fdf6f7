"""What one connection is held to: its limits (`Limits`, `AudioLimits`), the token
bucket that enforces their rates, and the server's audio slots (`AudioSlots`) that its
audio streams share.

The limits check themselves when built, so a bad option fails when the server starts,
not on a client's first message.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import protocol.codec
from protocol import ErrorCode


@dataclass(frozen=True)
class Limits:
    """What one connection may do; `None` turns a limit off.

    `max_message_bytes` is the codec's limit: a larger message gets a `too_large` error
    and the connection goes on (the socket's own frame limit, above it, closes it).
    `rate_limit` is in messages per second with bursts of `rate_burst` (default: one
    second's worth, at least one message).
    """

    max_message_bytes: int = protocol.codec.MAX_MESSAGE_BYTES
    max_text_chars: int = protocol.codec.MAX_TEXT_CHARS
    max_streams_per_connection: int = 16
    rate_limit: float | None = 50.0
    rate_burst: float | None = None

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1:
            raise ValueError("max_message_bytes must be >= 1")
        if self.max_text_chars < 1:
            raise ValueError("max_text_chars must be >= 1")
        if self.max_streams_per_connection < 1:
            raise ValueError("max_streams_per_connection must be >= 1")
        if self.rate_limit is not None and not (
            math.isfinite(self.rate_limit) and self.rate_limit > 0
        ):
            raise ValueError("rate_limit must be a positive number of messages per second")
        if self.rate_burst is not None and not (
            math.isfinite(self.rate_burst) and self.rate_burst >= 1
        ):
            raise ValueError("rate_burst must be >= 1")


AUDIO_STREAMS_PER_WORKER = 12
"""Audio streams one recognition process serves at once (`AudioLimits.for_workers`): even
with every one of them sending at the speed limit (2x real time), pocketsphinx keeps up on
the process's one core (docs/speech.md measures a live stream's share)."""

STARTS_PER_WORKER = 4
"""Audio streams per recognition process that may wait for their recognizer at once."""


@dataclass(frozen=True)
class AudioLimits:
    """Audio over the WebSocket as a connection's rules see it (`ConnectionCore.audio`;
    None: the server takes no audio).

    `max_speed`: audio may arrive at most this many times faster than real time,
    sustained; beyond that `burst_s` seconds of it may come at once (a browser that
    buffered through a network stall, a client starting with what it recorded so far).
    Past that the excess is dropped, with one `rate_limited` error per burst: a client
    pushing a file as fast as it can would queue minutes of recognition and make every
    stream's translations late. `max_streams`: audio streams at once on the whole server,
    each counted from its `start_audio` until its recognizer is gone (`AudioSlots`);
    `max_streams_per_address`: of those, from one client address (None: half of
    `max_streams`, at least one; 0: no cap), so that one client cannot lock the others
    out; `max_starting`: streams whose recognizer is not made yet (making one takes its
    process a while, and the streams behind it wait: past this a `start_audio` is refused
    for now). `idle_timeout_s`: an audio stream that sends no audio for this long is
    ended, its slot freed (None: never). `language`: the base code of the language its
    recognizer hears, which a `start_audio`'s `lang` must name (None: any).
    """

    max_speed: float = 2.0
    burst_s: float = 6.0
    max_streams: int = AUDIO_STREAMS_PER_WORKER
    language: str | None = None
    max_streams_per_address: int | None = None
    max_starting: int = STARTS_PER_WORKER
    idle_timeout_s: float | None = 30.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_speed) and self.max_speed >= 1.0):
            raise ValueError("max_speed must be at least 1 (real time)")
        if not (math.isfinite(self.burst_s) and self.burst_s > 0):
            raise ValueError("burst_s must be a positive number of seconds")
        if self.max_streams < 1:
            raise ValueError("max_streams must be >= 1")
        if self.max_streams_per_address is not None and self.max_streams_per_address < 0:
            raise ValueError("max_streams_per_address must be >= 0 (0: no cap)")
        if self.max_starting < 1:
            raise ValueError("max_starting must be >= 1")
        if self.idle_timeout_s is not None and not (
            math.isfinite(self.idle_timeout_s) and self.idle_timeout_s > 0
        ):
            raise ValueError("idle_timeout_s must be a positive number of seconds (None: never)")

    @classmethod
    def for_workers(
        cls, workers: int, *, streams_per_worker: int | None = None, **given: Any
    ) -> AudioLimits:
        """The limits for `workers` recognition processes (0: threads, which share one
        core): as many streams and starts as they serve, unless `given`.
        `streams_per_worker`: what one process's memory holds (`StreamMemory`), when
        fewer than `AUDIO_STREAMS_PER_WORKER`. Streams go to the least-loaded process, so
        a cap of N per process times the processes holds each of them to N."""
        share = max(1, workers)
        per_worker = AUDIO_STREAMS_PER_WORKER
        if streams_per_worker is not None:
            if streams_per_worker < 1:
                raise ValueError("streams_per_worker must be >= 1")
            per_worker = min(per_worker, streams_per_worker)
        given.setdefault("max_streams", per_worker * share)
        given.setdefault("max_starting", STARTS_PER_WORKER * share)
        return cls(**given)

    @property
    def per_address(self) -> int | None:
        """The cap on one address's audio streams (None: none)."""
        if self.max_streams_per_address is None:
            return max(1, self.max_streams // 2)
        return self.max_streams_per_address or None


@dataclass(frozen=True)
class Refused:
    """Why a `start_audio` gets no slot: the error's code and text."""

    code: ErrorCode
    message: str


class AudioSlots:
    """The server's audio streams, each from its `start_audio` until its recognizer is
    gone: `end_audio` does not free a slot whose recognizer is still being made or
    flushed, since that recognizer still holds its process's time and memory. Counted in
    all, per client address, and while starting (recognizer not made yet). Sans I/O: the
    connection's rules `take` a slot, the I/O layer says when its recognizer is made
    (`AudioSlot.started`) and gone (`AudioSlot.release`)."""

    def __init__(self) -> None:
        self.held = 0
        self.starting = 0
        self._per_address: Counter[str] = Counter()

    def take(self, limits: AudioLimits, address: str) -> AudioSlot | Refused:
        """A slot for a new audio stream from `address`, or why not."""
        if self.held >= limits.max_streams:
            return Refused(
                ErrorCode.LIMIT_EXCEEDED,
                f"the server is recognizing {self.held} audio streams, its limit; try again later",
            )
        cap = limits.per_address
        if cap is not None and self._per_address[address] >= cap:
            return Refused(
                ErrorCode.LIMIT_EXCEEDED,
                f"your address has {self._per_address[address]} audio streams open, its "
                "limit; end one (end_audio) or try again later",
            )
        if self.starting >= limits.max_starting:
            return Refused(
                ErrorCode.RATE_LIMITED,
                f"{self.starting} audio streams are starting (their recognizers being "
                "made), the most at once: this start_audio was not taken, send it again "
                "in a second",
            )
        self.held += 1
        self.starting += 1
        self._per_address[address] += 1
        return AudioSlot(self, address)

    def held_by(self, address: str) -> int:
        return self._per_address[address]

    def _free(self, address: str) -> None:
        self.held -= 1
        self._per_address[address] -= 1
        if self._per_address[address] <= 0:
            del self._per_address[address]


class AudioSlot:
    """One audio stream's place in `AudioSlots`."""

    def __init__(self, slots: AudioSlots, address: str) -> None:
        self.slots = slots
        self.address = address
        self.starting = True
        self.released = False

    def started(self) -> None:
        """Its recognizer is made (or could not be): no longer starting. Idempotent."""
        if self.starting:
            self.starting = False
            self.slots.starting -= 1

    def release(self) -> None:
        """Its recognizer is gone: the slot is free. Idempotent."""
        if not self.released:
            self.started()
            self.released = True
            self.slots._free(self.address)


class TokenBucket:
    """Allow `rate` events per second on average, with bursts of up to `burst`."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.updated = now

    def take(self, now: float, amount: float = 1.0) -> bool:
        """Spend `amount` tokens if there are that many; the time may only move forward."""
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
        if self.tokens >= amount:
            self.tokens -= amount
            return True
        return False
