"""One stream's incremental translation state: a synchronous, I/O-free core.

`StreamSession.answer(event)` turns one partial transcript into one `TranslationUpdate`
(or None when nothing changed). Its core, `StreamSession.steps`, is a generator that yields
each decode it needs (`DecodeCall`) and takes the hypotheses back, so that the session
itself never waits: `answer` runs the decodes one by one on the calling thread, while the
controller submits them to the scheduler and awaits their futures on its event loop,
without a worker thread per update. It holds the segment's encoder output, so an unchanged
source is never re-encoded, and the committed target tokens, which are forced into every
later decode of the segment so that stable text is never retracted.

The async controller (`engine.streaming.controller`) decides which events reach it (latest
wins), runs its steps on the event loop and aborts a partial's decodes (`Translator.abort`) when
a newer event makes them useless; replay and tests may call it directly. The rules of
where it may commit (word boundaries, settled source words) are `engine.streaming.boundaries`.
"""

from __future__ import annotations

import math
import time
import unicodedata
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace

from engine.decoding.constraints import Constraints
from engine.decoding.policy import Priority, RequestId
from engine.decoding.requests import Encoding
from engine.decoding.search import DecodeOptions, Hypothesis
from engine.decoding.translator import Translator
from engine.glossary import Glossary, holds
from engine.languages import drop_fillers
from engine.model.config import ModelConfig
from engine.streaming.boundaries import BoundaryFinder, extends_words, settled_source, shared_words
from engine.streaming.calls import Call, DecodeCall, Started, Steps
from engine.streaming.policies import Policy, common_prefix_length, default_policy
from protocol import PartialTranscript, TranslationUpdate


def normalize_source(text: str) -> str:
    """NFC and collapsed whitespace: the changes ASR makes that do not change the token ids
    (sentencepiece's own normalisation does the same), so they never trigger a decode."""
    return " ".join(unicodedata.normalize("NFC", text).split())


@dataclass(frozen=True)
class StreamingOptions:
    """How a stream is decoded and committed.

    `policy`: what to commit (`engine.streaming.policies`); None, the default, takes the
    model's own (`default_policy`: LocalAgreement-2 for a model trained on marked
    prefixes, FirstWord for an ordinary one).
    `decode` is shared with the final, offline translation, so a final equals `translate`
    with these options. `history` bounds the hypotheses kept per segment.
    `partial_length` caps a partial's hypothesis at a * source tokens + b: a model that
    hallucinates a continuation of an unfinished sentence (or repeats a word to the length
    limit) then costs bounded time and shows a bounded tail. Finals are never capped.
    `forced_length_ratio` is a benchmarking aid for random-weight models, which never emit
    eos: every decode then produces exactly ceil(ratio * source tokens) tokens.
    `source_agreement` (n): commit nothing new until the recogniser has shown n partials in
    a row that only extend the words before them: real recognisers often rewrite shown
    words, and a translation committed from words about to change is a revised final.
    None (the default) commits on the target side alone.
    `settled_source` (n): without a recogniser hint (`PartialTranscript.stable_chars`),
    take as settled the words the last n partials share (local agreement on the source
    side) and commit only target tokens that this settled prefix's own translation agrees
    with, as for a hint. None: only a recogniser's hint bounds commits.
    `drafts`: hand the previous hypothesis to the decoder as a draft to verify in the
    prefill call (the tentative tail for a partial, the whole last hypothesis for a
    final), so that tokens it confirms cost no step of their own; the output is the same
    with or without (greedy; used when the model batches continuously).
    """

    policy: Policy | None = None
    decode: DecodeOptions = DecodeOptions()
    history: int = 4
    partial_length: tuple[float, int] | None = (1.5, 8)
    forced_length_ratio: float | None = None
    drop_fillers: bool = True
    source_normalizer: Callable[[str], str] | None = None
    source_agreement: int | None = None
    settled_source: int | None = None
    drafts: bool = True
    # A partial's decode options by their cap (`decode_for`; None: uncapped).
    _partials: dict[int | None, DecodeOptions] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def policy_for(self, config: ModelConfig) -> Policy:
        """`policy`, or the default for this model (`default_policy`)."""
        return self.policy or default_policy(config.prefix_trained)

    def clean(self, text: str, lang: str | None) -> str:
        """The source the engine translates: NFC and collapsed whitespace
        (`normalize_source`), without hesitation fillers ("um", 嗯; `drop_fillers`), then
        `source_normalizer` when one is set. That hook is where a casing or punctuation
        restoration model plugs in (recognisers such as Vosk or Kaldi write lowercase
        without punctuation, which OPUS-MT models were not trained on): any function of a
        text, deterministic and fast, run on every partial on the event loop. Admission,
        decoding and the offline check of finals all use this one function."""
        source = normalize_source(text)
        if self.drop_fillers:
            kept = drop_fillers(source, lang)
            if kept != source:  # else it is normalised already
                source = normalize_source(kept)
        if self.source_normalizer is not None:
            source = normalize_source(self.source_normalizer(source))
        return source

    def decode_for(
        self, source_tokens: int, committed: int = 0, *, partial: bool = False
    ) -> DecodeOptions:
        """Decode options for a source of this many tokens (and this much committed). A
        partial's hypothesis goes without its score (`DecodeOptions.scores`): its update
        carries none, and choosing each token by the argmax alone is cheaper; a final keeps
        `decode` as it is, so that it equals `translate`, score included."""
        options = self.decode
        if self.forced_length_ratio is not None:
            n = max(1, committed, math.ceil(self.forced_length_ratio * source_tokens))
            options = replace(options, min_new_tokens=n, max_new_tokens=n)
        elif partial:
            cap = None
            if self.partial_length is not None:
                a, b = self.partial_length
                cap = max(committed + 1, math.ceil(a * source_tokens) + b)
                if options.max_new_tokens is not None and cap >= options.max_new_tokens:
                    cap = None
            # Made once per cap: two `replace`s per partial were 3.5 us of its Python.
            made = self._partials.get(cap)
            if made is None:
                made = options if cap is None else replace(options, max_new_tokens=cap)
                made = self._partials[cap] = replace(made, scores=False)
            return made
        if partial and options.scores:
            options = replace(options, scores=False)
        return options


@dataclass
class SegmentState:
    """What a live segment keeps between partials; dropped at its final."""

    segment_id: int
    source: str = ""
    source_ids: list[int] | None = None
    encoded: Encoding | None = None  # the source's, encoded on the way by its first decode
    committed: list[int] = field(default_factory=list)
    committed_text: str | None = None  # `committed` detokenized (None: not yet)
    stable_text: str = ""
    history: deque[list[int]] = field(default_factory=deque)
    # The next decode's draft where the last hypothesis named a better one than its own
    # tokens (`Hypothesis.draft`); None: the last hypothesis.
    draft: list[int] | None = None
    source_settled_at: int = 0  # partials answered since the source last revised shown words
    # The recogniser's settled source (`PartialTranscript.stable_chars`), with the committed
    # prefix it was decoded after, and its hypothesis: decoded once per change.
    settled: tuple[tuple[str, tuple[int, ...]], list[int]] | None = None
    recent: deque[str] = field(default_factory=deque)  # the last partials' sources


def _as_heard(source: str, event: PartialTranscript) -> str:
    """A partial's source as glossary matching reads it: with the space the recognizer
    wrote after its last word, if any (that word is then complete: `Glossary.match`),
    which normalising dropped."""
    return source + " " if event.text[-1:].isspace() else source


class StreamSession:
    """Translate one stream's partial transcripts into one language, segment after segment.

    A stream translated into several languages (fan-out) has one session per language:
    what is stable, the history and the encoder output are per model and language.
    `lang` is the target language its updates carry (default: the model's own); `epoch`
    the stream's life they carry (the controller's; None for a session on its own), so
    that an update is made once, not copied to be stamped.
    `glossary`: the terms its translations place (`engine.decoding.constraints`), in
    partials as soon as a term's source is complete, and in the final.
    """

    def __init__(
        self,
        stream_id: str,
        translator: Translator,
        options: StreamingOptions | None = None,
        *,
        lang: str | None = None,
        epoch: int | None = None,
        glossary: Glossary | None = None,
    ) -> None:
        self.stream_id = stream_id
        self.epoch = epoch
        self.translator = translator
        # Terms its translations place (None: the translator's own, if any); a term
        # counts once its source is complete in the partial (`Glossary.match`).
        self.glossary = glossary
        self.terms_matched = 0  # over the stream's finals
        self.terms_placed = 0
        self.final_terms = (0, 0)  # the last final's terms: matched, placed
        self.lang = lang if lang is not None else translator.config.target_lang
        self.options = options or StreamingOptions()
        self.boundaries = BoundaryFinder(translator.tokenizer.id_to_piece)
        self.policy = self.options.policy_for(translator.config)
        self.segment: SegmentState | None = None
        self._admitted: list[int] | None = None  # source ids admission computed, if any

    def _segment_for(self, event: PartialTranscript) -> SegmentState:
        if self.segment is None or self.segment.segment_id != event.segment_id:
            self.segment = SegmentState(event.segment_id)
        return self.segment

    def _encode(
        self, seg: SegmentState, source: str, *, partial: bool, ids: list[int] | None = None
    ) -> Encoding:
        """The source's `Encoding`: the segment's own when the ids did not change (no
        encoder call then), else a new one that the decode encodes on its way."""
        if ids is None:
            ids = self.translator.source_ids(source, partial=partial)
        cached = seg.encoded
        failed = cached is not None and cached.future.done() and cached.encoded is None
        if cached is None or failed or ids != seg.source_ids:
            seg.encoded = self.translator.encoding([ids])
            seg.source_ids = ids
        assert seg.encoded is not None
        return seg.encoded

    def steps(
        self,
        event: PartialTranscript,
        *,
        request_id: RequestId | None = None,
        priority: Priority = Priority.PARTIAL,
        received: float | None = None,
        source: str | None = None,
        source_ids: list[int] | None = None,
    ) -> Steps:
        """The update answering `event`, or None when its source did not change, as a
        generator that yields each decode it needs and is sent back its hypotheses
        (`answer` runs it on this thread; the controller awaits the decodes).

        `source` and `source_ids`: the event's normalised source and its ids when
        admission computed them already (`lifecycle.Admission`), so that they are not
        computed twice; `source_ids` is only used together with `source`.

        `request_id`: the id of a partial's decodes, given when a newer event may abort
        them (`Translator.abort`, which may come before they are submitted); they then
        raise `DecodingCancelled` and the segment's state is as before the call.
        `priority`: the scheduler's admission order for a partial's decodes (a final's
        are always `Priority.FINAL`); the controller says which.
        """
        received = time.perf_counter() if received is None else received
        seg = self._segment_for(event)
        if source is None:
            source = self.options.clean(event.text, self.translator.config.source_lang)
            source_ids = None
        # One rule for which partials are answered: those whose normalised source differs
        # from the last one answered in the segment (which starts empty). So an unchanged
        # partial, empty or not, gets no update and runs neither encoder nor decoder.
        if not event.is_final and source == seg.source and (seg.encoded is not None or not source):
            return None
        started = time.perf_counter()
        self._admitted = source_ids
        if event.is_final:
            update = yield from self._final(seg, source, event, started, received)
            self.segment = None
        elif not source:
            seg.source = ""
            update = self._update(event, seg.stable_text, "", started, received, source)
        else:
            update = yield from self._partial(
                seg, source, event, request_id, priority, started, received
            )
        return update

    def answer(
        self,
        event: PartialTranscript,
        *,
        request_id: RequestId | None = None,
        priority: Priority = Priority.PARTIAL,
        received: float | None = None,
        source: str | None = None,
        source_ids: list[int] | None = None,
    ) -> TranslationUpdate | None:
        """`steps`, its decodes run on this thread one after the other; a decode's error
        is raised inside the session where it asked for it (as `awaiting.answer` does)."""
        steps = self.steps(
            event,
            request_id=request_id,
            priority=priority,
            received=received,
            source=source,
            source_ids=source_ids,
        )
        try:
            call = next(steps)
            while True:
                try:
                    found = call.run(self.translator)
                except Exception as exc:
                    call = steps.throw(exc)
                else:
                    call = steps.send(found)
        except StopIteration as done:
            update: TranslationUpdate | None = done.value
            return update

    def _update(
        self,
        event: PartialTranscript,
        stable: str,
        unstable: str,
        started: float,
        received: float,
        source: str,
        *,
        revised: bool = False,
    ) -> TranslationUpdate:
        now = time.perf_counter()
        return TranslationUpdate(
            stream_id=event.stream_id,
            segment_id=event.segment_id,
            seq=event.seq,
            stable_text=stable,
            unstable_text=unstable,
            is_final=event.is_final,
            latency_ms=max(now - received, 0.0) * 1000.0,
            compute_ms=(now - started) * 1000.0,
            revised=revised,
            source_text=source,
            start_ms=event.start_ms,
            end_ms=event.end_ms,
            lang=self.lang,
            epoch=self.epoch,
        )

    def _partial(
        self,
        seg: SegmentState,
        source: str,
        event: PartialTranscript,
        request_id: RequestId | None,
        priority: Priority,
        started: float,
        received: float,
    ) -> Generator[Call, list[Hypothesis], TranslationUpdate]:
        policy = self.policy
        enc = self._encode(seg, source, partial=True, ids=self._admitted)
        previous = seg.history[-1] if seg.history else None
        draft: list[int] = []
        expected = seg.draft if seg.draft is not None else previous
        if self.options.drafts and expected is not None:
            done = len(seg.committed)
            if expected[:done] == seg.committed:
                draft = expected[done:]
        terms = yield from self._constraints(
            _as_heard(source, event), priority, request_id, partial=True
        )
        (hyp,) = yield DecodeCall(
            enc,
            self.options.decode_for(len(seg.source_ids or ()), len(seg.committed), partial=True),
            prefixes=[seg.committed],
            hook=policy.hook(previous),
            drafts=[draft],
            priority=priority,
            request_id=request_id,
            constraints=terms,
        )
        tokens = list(hyp.token_ids)
        if self.options.source_agreement is not None:
            extends = extends_words(seg.source, source)
            seg.source_settled_at = seg.source_settled_at + 1 if extends else 0
        seg.source = source  # only now: a cancelled decode leaves the source untranslated
        seg.history.append(tokens)
        seg.draft = list(hyp.draft) if hyp.draft is not None else None
        while len(seg.history) > self.options.history:
            seg.history.popleft()
        proposal = policy.propose(list(seg.history), len(seg.committed))
        # For an ordinary model, eos on a partial only means the source ends *so far*: never
        # commit through the end of a hypothesis, its last word may still change. A model
        # trained on prefixes with a partial marker ends a partial's output where the safe
        # part ends, so there eos does close a committable hypothesis.
        through_end = hyp.finished and self.translator.config.prefix_trained
        commit = self.boundaries.snap(tokens, proposal.commit, len(seg.committed), through_end)
        if proposal.first_word:
            first = self.boundaries.first_word_end(tokens, len(seg.committed), through_end)
            commit = min(commit, first)
        agree = self.options.source_agreement
        if agree is not None and seg.source_settled_at < agree:
            commit = len(seg.committed)  # the source is still being rewritten: wait
        bound = yield from self._settled_bound(seg, event, source, tokens, request_id, priority)
        if bound is not None and bound < commit:  # the recogniser's hint: only so far
            commit = self.boundaries.snap(tokens, bound, len(seg.committed), False)
        if hyp.appended is not None:  # a term the model has not reached: shown, not kept
            commit = min(commit, max(hyp.appended, len(seg.committed)))
        # Detokenized once per change: the committed part mostly stays as it was from one
        # partial to the next, and is often all that is shown.
        committed = tokens[:commit]
        if seg.committed_text is None or committed != seg.committed:
            seg.committed_text = self.translator.detokenize(committed)
        seg.committed = committed
        stable = seg.committed_text
        if not stable.startswith(seg.stable_text):  # never retract, whatever detok does
            stable = seg.stable_text
        seg.stable_text = stable
        end = max(proposal.display, commit)
        shown = seg.committed_text if end == commit else self.translator.detokenize(tokens[:end])
        unstable = shown[len(stable) :] if shown.startswith(stable) else ""
        return self._update(event, stable, unstable, started, received, source)

    def _settled(self, seg: SegmentState, event: PartialTranscript, source: str) -> str | None:
        """The settled part of the partial's source: the recogniser's hint when it sent
        one, else (with `settled_source` n) the words the last n partials share; None when
        neither applies or the whole source is settled."""
        if event.stable_chars is not None:
            if event.stable_chars >= len(event.text):
                return None
            lang = self.translator.config.source_lang
            return self.options.clean(settled_source(event.text, event.stable_chars), lang)
        n = self.options.settled_source
        if n is None:
            return None
        seg.recent.append(source)
        while len(seg.recent) > n:
            seg.recent.popleft()
        if len(seg.recent) < n:
            return ""  # too few partials to agree on anything yet
        if n == 1:
            return None  # a partial agrees with itself
        shared = shared_words(seg.recent)
        return None if shared == source else shared

    def _settled_bound(
        self,
        seg: SegmentState,
        event: PartialTranscript,
        source: str,
        tokens: list[int],
        request_id: RequestId | None,
        priority: Priority,
    ) -> Generator[Call, list[Hypothesis], int | None]:
        """How many of `tokens` the settled source (`_settled`: the recogniser's hint, or
        the words recent partials share) supports, or None when there is none or the
        whole source is settled.

        The settled part is translated on its own (after the committed prefix, like the
        partial); only the tokens on which that translation and the partial's agree are
        independent of the unsettled tail, so commits stop there. Nothing settled: nothing
        new is committed.
        """
        settled = self._settled(seg, event, source)
        if settled is None:
            return None
        if not settled:
            return len(seg.committed)
        if settled == source:
            return None
        key = (settled, tuple(seg.committed))
        if seg.settled is None or seg.settled[0] != key:
            ids = self.translator.source_ids(settled, partial=True)
            # The settled part's last translation is the natural draft for its next one.
            draft = seg.settled[1][len(seg.committed) :] if seg.settled else []
            terms = yield from self._constraints(settled, priority, request_id, partial=True)
            (hyp,) = yield DecodeCall(
                self.translator.encoding([ids]),
                self.options.decode_for(len(ids), len(seg.committed), partial=True),
                prefixes=[seg.committed],
                drafts=[draft if self.options.drafts else []],
                priority=priority,
                request_id=request_id,
                constraints=terms,
            )
            seg.settled = (key, list(hyp.token_ids))
        return common_prefix_length([tokens, seg.settled[1]])

    def _final(
        self,
        seg: SegmentState,
        source: str,
        event: PartialTranscript,
        started: float,
        received: float,
    ) -> Generator[Call, list[Hypothesis], TranslationUpdate]:
        """The offline translation of the final source: same options, no prefix, no bias."""
        self.final_terms = (0, 0)
        if not source:
            text = ""
        else:
            enc = self._encode(seg, source, partial=False, ids=self._admitted)
            options = self.options.decode_for(len(seg.source_ids or ()))
            last = seg.draft if seg.draft is not None else (seg.history or [None])[-1]
            draft = last if self.options.drafts and last is not None else []
            terms = yield from self._constraints(source, Priority.FINAL, None, partial=False)
            (hyp,) = yield DecodeCall(enc, options, drafts=[draft], constraints=terms)
            seg.source = source
            text = self.translator.detokenize(hyp.token_ids)
            self._count_terms(source, text)
        revised = not text.startswith(seg.stable_text)
        return self._update(event, text, "", started, received, source, revised=revised)

    def _constraints(
        self,
        source: str,
        priority: Priority,
        request_id: RequestId | None,
        *,
        partial: bool,
    ) -> Generator[Call, list[Hypothesis], list[Constraints] | None]:
        """The decode's constraints: what `source`'s matched terms require (None: none
        matched, the plain search), with the model's rendering of each term's source
        (`Translator.rendering`): a final decodes a missing one first (yielded, never
        blocking the caller's loop); a partial starts it for the next partials and places
        the term without it this once, and starts those its open end holds, about to
        count (`Translator.render_ahead`); both wait for one started before, done by then
        (docs/glossaries.md, Cost)."""
        tr = self.translator
        matched, heard = tr.scan(source, self.glossary, partial=partial)
        fresh = tr.unrendered(matched) if partial else []  # the others: known or started
        if fresh or heard:
            tr.render_ahead([*fresh, *(term.source for term in heard)], priority)
        known = dict.fromkeys(fresh, "")  # placed without a cue this once
        started = tr.rendering_started([term for term in matched if term.source not in known])
        if started:
            try:
                hyps = yield Started([future for _, future in started])
            except Exception:  # one failed: each decoded below, as if never started
                pass
            else:
                for (term_source, _), hyp in zip(started, hyps, strict=True):
                    known[term_source] = tr.remember_rendering(term_source, hyp.token_ids)
        for term in matched:
            found = known[term.source] if term.source in known else tr.known_rendering(term.source)
            if found is None:  # never started (a final's), or forgotten since
                call = tr.rendering_call(term.source)
                (hyp,) = yield DecodeCall(
                    tr.encoding([call.source_ids]),
                    call.options,
                    priority=priority,
                    request_id=request_id,
                )
                found = tr.remember_rendering(term.source, hyp.token_ids)
            known[term.source] = found
        terms = tr.constraints_of(matched, known)
        return [terms] if terms else None

    def _count_terms(self, source: str, text: str) -> None:
        """Count a final's matched terms and those its translation holds."""
        glossary = self.glossary if self.glossary is not None else self.translator.glossary
        if glossary is None:
            return
        targets = glossary.targets(source)
        placed = sum(holds(text, target, self.lang) for target in targets)
        self.final_terms = (len(targets), placed)
        self.terms_matched += len(targets)
        self.terms_placed += placed

    def uncount_final(self) -> None:
        """Take the last final's terms back out of the counts: a final translated again
        for its writer only, counted when it was first answered (`Resent.UNKNOWN`)."""
        matched, placed = self.final_terms
        self.terms_matched, self.terms_placed = (
            self.terms_matched - matched,
            self.terms_placed - placed,
        )
        self.final_terms = (0, 0)

    def state_size(self) -> int:
        """Rough count of numbers held for this stream (tests bound it)."""
        seg = self.segment
        if seg is None:
            return 0
        size = len(seg.committed) + sum(len(h) for h in seg.history)
        enc = seg.encoded.encoded if seg.encoded is not None else None
        if enc is not None:
            size += enc.hidden_states.size + enc.attention_mask.size
        return size
