"""What a streaming session's generator yields (`StreamSession.steps`): decodes to run
(`DecodeCall`) and decodes started already to wait for (`Started`). Each driver runs them
its own way: `StreamSession.answer` on its thread, `engine.streaming.awaiting` on the event
loop; the session itself does no I/O."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from engine.decoding.constraints import Constraints
from engine.decoding.policy import Priority, RequestId
from engine.decoding.requests import Encoding
from engine.decoding.search import DecodeOptions, Hypothesis, StepHook
from engine.decoding.translator import Translator
from protocol import TranslationUpdate


@dataclass(frozen=True)
class DecodeCall:
    """One decode a session needs, as `Translator.decode` (or `Translator.submit`) takes
    it: the session's generator (`StreamSession.steps`) yields it and is sent back the
    hypotheses (or thrown the error, e.g. `DecodingCancelled`)."""

    enc: Encoding
    options: DecodeOptions
    prefixes: Sequence[Sequence[int]] | None = None
    hook: StepHook | None = None
    drafts: Sequence[Sequence[int]] | None = None
    priority: Priority = Priority.FINAL
    request_id: RequestId | None = None
    constraints: Sequence[Constraints] | None = None  # a glossary's matched terms

    def submit(self, translator: Translator) -> list[Future[Hypothesis]]:
        """Queue the decode and return its futures at once (`Translator.submit`)."""
        return translator.submit(
            self.enc,
            self.options,
            prefixes=self.prefixes,
            hook=self.hook,
            drafts=self.drafts,
            priority=self.priority,
            request_id=self.request_id,
            constraints=self.constraints,
        )

    def run(self, translator: Translator) -> list[Hypothesis]:
        """Decode on this thread, waiting for the scheduler (`Translator.decode`: the
        same submission, waited for)."""
        return [future.result() for future in self.submit(translator)]


@dataclass(frozen=True)
class Started:
    """Decodes submitted already (a term's rendering started ahead of its match,
    `Translator.render_ahead`), yielded as a `DecodeCall` is: the caller waits for them in
    its own way, without submitting them again."""

    futures: Sequence[Future[Hypothesis]]

    def submit(self, translator: Translator) -> list[Future[Hypothesis]]:
        return list(self.futures)

    def run(self, translator: Translator) -> list[Hypothesis]:
        return [future.result() for future in self.futures]


Call = DecodeCall | Started
"""What a session's generator yields: decodes to run, or started ones to wait for."""

Steps = Generator[Call, list[Hypothesis], "TranslationUpdate | None"]
"""A session's answer in the making: yields decodes, returns the update (None: nothing
changed)."""
