"""What one connection is held to: its limits (`Limits`, `AudioLimits`) and the token
bucket that enforces their rates.

The limits check themselves when built, so a bad option fails when the server starts,
not on a client's first message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import protocol.codec


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


@dataclass(frozen=True)
class AudioLimits:
    """Audio over the WebSocket as a connection's rules see it (`ConnectionCore.audio`;
    None: the server takes no audio).

    `max_speed`: audio may arrive at most this many times faster than real time,
    sustained; beyond that `burst_s` seconds of it may come at once (a browser that
    buffered through a network stall, a client starting with what it recorded so far).
    Past that the excess is dropped, with one `rate_limited` error per burst: a client
    pushing a file as fast as it can would queue minutes of recognition and make every
    stream's translations late. `max_streams`: audio streams at once on the whole server
    (each holds a recognizer and a worker thread). `language`: the base code of the
    language its recognizer hears, which a `start_audio`'s `lang` must name (None: any).
    """

    max_speed: float = 2.0
    burst_s: float = 6.0
    max_streams: int = 32
    language: str | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_speed) and self.max_speed >= 1.0):
            raise ValueError("max_speed must be at least 1 (real time)")
        if not (math.isfinite(self.burst_s) and self.burst_s > 0):
            raise ValueError("burst_s must be a positive number of seconds")
        if self.max_streams < 1:
            raise ValueError("max_streams must be >= 1")


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
