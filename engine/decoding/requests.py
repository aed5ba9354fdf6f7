"""What the decode scheduler queues: a request (one source's search and its caller's
future, as the scheduling policy sees it) and the encoder job its source may wait on."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.decoding.policy import Priority, RequestId
from engine.decoding.search import Hypothesis, Search
from engine.model.layouts import EncoderOutput, IntArray


@dataclass(eq=False)
class Encoding:
    """Right-padded source ids and, once a lane ran the encoder on them, their states
    (`future`).

    Given to `DecodeScheduler.submit` in place of an `EncoderOutput`, the sources are
    encoded by the lane that admits their requests, in one call with the other
    newcomers' sources, just before their prefill: a request then makes one trip through
    a lane, not an encoder trip and a decoder trip, each waiting for a lane's turn. Keep
    it to reuse the states: once `encoded`, a later submission skips the encoder.
    """

    input_ids: IntArray
    attention_mask: IntArray
    future: Future[EncoderOutput] = field(default_factory=Future)
    claimed: bool = False  # a plan gave it to a lane (under the scheduler's lock)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def encoded(self) -> EncoderOutput | None:
        """The states when the encoder ran on these sources and succeeded, else None."""
        if not self.future.done() or self.future.exception() is not None:
            return None
        return self.future.result()


@dataclass(eq=False)
class Request:
    """One source's search and its caller's future (`Schedulable` for the policy)."""

    search: Search
    source: EncoderOutput | Encoding  # its sources, of which it decodes `row`
    row: int
    priority: Priority
    request_id: RequestId | None  # None: never aborted
    future: Future[Hypothesis] = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # when a plan had it join a lane

    @property
    def width(self) -> int:
        return self.search.options.beam_size

    @property
    def rows(self) -> int:
        return self.search.width

    @property
    def positions(self) -> int:
        """Decoder positions its prefill feeds: start token, forced prefix and draft."""
        search = self.search
        return self.width * (1 + len(search.prefix) + len(search.draft))

    @property
    def nearly_done(self) -> bool:
        return self.search.draft_confirmed

    @property
    def encoding(self) -> Encoding | None:
        source = self.source
        return source if isinstance(source, Encoding) and not source.future.done() else None

    @property
    def encoder_error(self) -> BaseException | None:
        """What its source's encoder call raised (waits for a call another lane runs)."""
        source = self.source
        return source.future.exception() if isinstance(source, Encoding) else None

    def enc(self) -> EncoderOutput:
        """Its one source's states (the source has been encoded): a view of its row, or
        the source's own states when it has one row (no copy: the prefill reads them)."""
        source = self.source
        if isinstance(source, Encoding):
            source = source.future.result()
        if source.batch_size == 1:
            return source
        row = self.row
        return EncoderOutput(
            source.hidden_states[row : row + 1], source.attention_mask[row : row + 1]
        )
