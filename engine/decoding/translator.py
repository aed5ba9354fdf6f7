"""Offline translation: text in, text out, for one model directory.

This is the engine core's public face; the streaming controller builds on the same pieces
(`encode` runs the encoder, `decode` the searches, `abort` gives up on a partial's,
`detokenize` turns ids into text) so that a final partial's translation equals `translate`
exactly.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.decoding.constraints import Constraints
from engine.decoding.policy import Priority, RequestId
from engine.decoding.requests import Encoding
from engine.decoding.scheduler import DecodeScheduler, SchedulerOptions
from engine.decoding.search import DecodeOptions, Hypothesis, StepHook
from engine.decoding.terms import TermTokens
from engine.errors import InputTooLongError, ModelLoadError
from engine.glossary import MAX_ENTRIES, Glossary, Term
from engine.languages import word_joiner
from engine.model.config import ModelConfig
from engine.model.layouts import EncoderOutput
from engine.model.marian import MarianOnnx
from engine.model.sessions import RuntimeOptions, device_options, threads_from_env
from engine.model.tokenizer import MarianTokenizer

_NONE = Glossary("en", "en", ())  # no glossary, not even the translator's

_SENTENCE_END = re.compile(r"(?<=[.!?。！？；;])\s*")
_CLAUSE_END = re.compile(r"(?<=[,，、:：])\s*")


@dataclass(frozen=True)
class RenderingCall:
    """The decode of a term's source alone (`Translator.rendering_call`)."""

    source_ids: list[int]
    options: DecodeOptions


@dataclass(frozen=True)
class TranslationResult:
    """A translation with the ids it was decoded from (without start token and eos)."""

    text: str
    token_ids: tuple[int, ...]
    score: float
    finished: bool = True


class Translator:
    """Tokenizer + ONNX model + search, loaded from one model directory.

    Every encoder and decoder call goes through the model's one `DecodeScheduler`, so
    calls from many threads (streams, offline batches) share decoder steps.

    `glossary`: terms every translation places (`translate`'s own `glossary` wins);
    checked against the model's languages and vocabulary when set (`GlossaryError`).
    """

    def __init__(
        self,
        model: MarianOnnx,
        tokenizer: MarianTokenizer,
        scheduler: SchedulerOptions | None = None,
        *,
        glossary: Glossary | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config: ModelConfig = model.config
        self.scheduler = DecodeScheduler(model, scheduler)
        self.terms = TermTokens(tokenizer, self.config.source_lang, self.config.target_lang)
        self._glossary: Glossary | None = None
        self.glossary = glossary
        self._renderings: dict[str, str] = {}
        # Renderings started ahead (`render_ahead`), in flight until `_rendered` keeps them.
        self._started: dict[str, Future[Hypothesis]] = {}
        self._renderings_lock = threading.Lock()

    @property
    def glossary(self) -> Glossary | None:
        return self._glossary

    @glossary.setter
    def glossary(self, glossary: Glossary | None) -> None:
        if glossary is not None:
            self.terms.check(glossary)
        self._glossary = glossary

    def constraints(
        self, text: str, glossary: Glossary | None = None, *, partial: bool = False
    ) -> Constraints:
        """What `text`'s glossary terms require of its translation (`glossary`, else the
        translator's; checked against the model when it is not the translator's)."""
        return self.constraints_of(self.matched(text, glossary, partial=partial))

    def matched(
        self, text: str, glossary: Glossary | None = None, *, partial: bool = False
    ) -> list[Term]:
        """`text`'s matched terms (`glossary`, else the translator's; checked against the
        model when it is not the translator's), one per target, in order: what a caller
        that renders them first (`unrendered`) and then constrains by them
        (`constraints_of`) matches once."""
        return self.scan(text, glossary, partial=partial)[0]

    def scan(
        self, text: str, glossary: Glossary | None = None, *, partial: bool = False
    ) -> tuple[list[Term], list[Term]]:
        """`matched`, and the terms whose sources a partial ends with (heard, but its last
        word may still grow): what a streaming caller renders ahead (`render_ahead`)."""
        chosen = glossary if glossary is not None else self._glossary
        if chosen is not None and chosen is not self._glossary:
            self.terms.check(chosen)
        return self.terms.scan(chosen, text, partial=partial)

    def constraints_of(
        self, terms: Sequence[Term], renderings: Mapping[str, str] | None = None
    ) -> Constraints:
        """What matched `terms` require of a translation (`matched`), with the renderings
        of their sources given (a caller that must not wait: "" for none, the term placed
        without a cue), else `rendering`'s."""
        given = renderings or {}
        return tuple(
            self.terms.constraint(
                term.target,
                given[term.source] if term.source in given else self.rendering(term.source),
            )
            for term in terms
        )

    def known_rendering(self, source: str) -> str | None:
        """The rendering of a term's source if it is known (never waits)."""
        with self._renderings_lock:
            return self._renderings.get(source)

    def rendering(self, source: str) -> str:
        """The model's own translation of a term's source, alone (greedy, cached): where
        the model starts writing it in a sentence is where a constrained greedy search
        writes the term instead (`engine.decoding.constraints`). One short decode the
        first time a term is matched (waited for here: a caller on an event loop decodes
        it its own way first, `unrendered` / `rendering_call` / `remember_rendering`)."""
        with self._renderings_lock:
            found = self._renderings.get(source)
            started = self._started.get(source)
        if found is None and started is not None:
            try:
                hyp = started.result()
            except Exception:  # it failed (its callback not run yet): decoded again below
                pass
            else:
                found = self.remember_rendering(source, hyp.token_ids)
        if found is None:
            call = self.rendering_call(source)
            (hyp,) = self.decode(self.encoding([call.source_ids]), call.options)
            found = self.remember_rendering(source, hyp.token_ids)
        return found

    def unrendered(self, terms: Sequence[Term]) -> list[str]:
        """The sources of matched `terms` (`matched`) whose rendering is neither known nor
        started (`rendering_started`)."""
        with self._renderings_lock:
            return [
                term.source
                for term in terms
                if term.source not in self._renderings and term.source not in self._started
            ]

    def rendering_started(self, terms: Sequence[Term]) -> list[tuple[str, Future[Hypothesis]]]:
        """The renderings of `terms` started ahead and not finished: a caller waits for
        these instead of decoding them again (then `remember_rendering`)."""
        with self._renderings_lock:
            return [
                (term.source, self._started[term.source])
                for term in terms
                if term.source not in self._renderings and term.source in self._started
            ]

    def render_ahead(self, sources: Sequence[str], priority: Priority = Priority.PARTIAL) -> None:
        """Start decoding the renderings of term sources a stream is about to match (a
        partial ends with them: `scan`), not waited for: by the next partial, where the
        term counts, its rendering is most often known, and that partial does not wait
        for a decode of its own before its own (docs/glossaries.md, Cost). The result is
        the one `rendering` decodes: rows are independent of their batch."""
        for source in sources:
            with self._renderings_lock:
                if source in self._renderings or source in self._started:
                    continue
            call = self.rendering_call(source)
            (future,) = self.submit(
                self.encoding([call.source_ids]), call.options, priority=priority
            )
            with self._renderings_lock:
                self._started[source] = future
            future.add_done_callback(functools.partial(self._rendered, source))

    def _rendered(self, source: str, future: Future[Hypothesis]) -> None:
        """A rendering started ahead is done (on a lane's thread): kept, then no longer
        in flight (in that order, so that a caller always finds it in one or the other)."""
        if not future.cancelled() and future.exception() is None:
            self.remember_rendering(source, future.result().token_ids)
        with self._renderings_lock:
            if self._started.get(source) is future:
                del self._started[source]

    def rendering_call(self, source: str) -> RenderingCall:
        """What decoding a term's source alone takes (`rendering`)."""
        return RenderingCall(self.source_ids(source.strip()), DecodeOptions(scores=False))

    def remember_rendering(self, source: str, token_ids: Sequence[int]) -> str:
        """Keep the rendering decoded for a term's source (`rendering_call`); its text."""
        text = self.detokenize(token_ids)
        with self._renderings_lock:
            if len(self._renderings) >= MAX_ENTRIES:  # bounded: glossaries change
                self._renderings.clear()
            self._renderings[source] = text
        return text

    def close(self) -> None:
        """Stop the scheduler thread (requests after this raise `SchedulerClosed`)."""
        self.scheduler.close()

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        quantized: bool = False,
        use_cache: bool = True,
        prefer_split: bool = True,
        intra_op_threads: int | None = None,
        allow_spinning: bool = False,
        batchable: bool = True,
        scheduler: SchedulerOptions | None = None,
        int8_per_token: bool = True,
        device: str = "cpu",
        fp16: bool = False,
        cuda_graphs: bool | None = None,
        fold_shapes: bool = True,
    ) -> Translator:
        """Load a model directory in the Optimum layout (ONNX files at the top or in `onnx/`).

        `device`: "cpu", or "cuda" / "cuda:N" with the `[gpu]` extra (raises
        `DeviceUnavailable` where it cannot run). `fp16`: the `*_fp16.onnx` files
        (`nmt-incremental models fp16`), for a GPU. `cuda_graphs`: greedy steps over KV
        slots replay CUDA graphs (None: on a CUDA device, with one lane;
        `engine.model.kv.slots.graphed`). `fold_shapes`: the encoder's and the rewritten
        decoder's shape computations made constant (`engine.model.passes.shapes`)."""
        path = Path(model_dir)
        if not path.is_dir():
            raise ModelLoadError(f"{path}: not a model directory")
        config = ModelConfig.from_dir(path)
        tokenizer = MarianTokenizer.from_dir(path)
        if len(tokenizer) > config.vocab_size:
            raise ModelLoadError(
                f"{path}: vocab.json has {len(tokenizer)} entries, "
                f"the model only {config.vocab_size}"
            )
        chosen = scheduler or SchedulerOptions()
        threads = chosen.resolved()
        if intra_op_threads is None and threads_from_env() is None:
            # The scheduler's lanes each run one call at a time: its thread count per lane.
            intra_op_threads = threads.per_lane
        options = RuntimeOptions(
            quantized=quantized,
            use_cache=use_cache,
            prefer_split=prefer_split,
            intra_op_threads=intra_op_threads,
            allow_spinning=allow_spinning,
            batchable=batchable,
            head_threads=threads.head,
            alone_head_threads=threads.alone,
            kv_slots=None if chosen.kv_slots is None else chosen.kv_slots > 0,
            inplace_attention=chosen.inplace_attention,
            int8_per_token=int8_per_token,
            fp16=fp16,
            cuda_graphs=cuda_graphs,
            fold_shapes=fold_shapes,
            **device_options(device),
        )
        return cls(MarianOnnx(path, config, options), tokenizer, scheduler)

    # -- pieces the streaming controller reuses ---------------------------------------

    @property
    def max_source_tokens(self) -> int:
        return self.config.max_position_embeddings

    def source_ids(self, text: str, *, partial: bool = False) -> list[int]:
        """Ids of a source: the target-language token prepended when the model needs one,
        and for a `partial` (unfinished) source the model's partial marker appended, if it
        was trained with one (`partial_suffix` in nmt-incremental.json)."""
        prefix = self.config.source_prefix
        full = f"{prefix} {text}" if prefix and not text.startswith(">>") else text
        if partial and self.config.partial_suffix:
            full += self.config.partial_suffix
        ids = self.tokenizer.encode_source(full)
        if len(ids) > self.max_source_tokens:
            raise InputTooLongError(len(ids), self.max_source_tokens)
        return ids

    def encoding(self, sources: Sequence[Sequence[int]]) -> Encoding:
        """A right-padded batch of source ids for `decode` to encode on the way (the lane
        that starts its searches runs the encoder first, in one call with the other
        newcomers' sources), kept for reuse once encoded (`Encoding.encoded`)."""
        if len(sources) == 1:  # a stream's partial: no padding to lay out
            ids = np.array(sources, dtype=np.int64)
            return Encoding(ids, np.ones(ids.shape, dtype=np.int64))
        width = max(len(s) for s in sources)
        ids = np.full((len(sources), width), self.config.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(sources), width), dtype=np.int64)
        for row, source in enumerate(sources):
            ids[row, : len(source)] = source
            mask[row, : len(source)] = 1
        return Encoding(ids, mask)

    def encode(self, sources: Sequence[Sequence[int]]) -> EncoderOutput:
        """Run the encoder once on a right-padded batch of source ids."""
        pending = self.encoding(sources)
        return self.scheduler.encode(pending.input_ids, pending.attention_mask)

    def submit(
        self,
        enc: EncoderOutput | Encoding,
        options: DecodeOptions = DecodeOptions(),
        *,
        prefixes: Sequence[Sequence[int]] | None = None,
        hook: StepHook | None = None,
        drafts: Sequence[Sequence[int]] | None = None,
        priority: Priority = Priority.FINAL,
        request_id: RequestId | None = None,
        constraints: Sequence[Constraints] | None = None,
    ) -> list[Future[Hypothesis]]:
        """Queue a search for each source of `enc` and return their futures at once (the
        arguments as for `decode`), for a caller that waits in its own way: the
        controller awaits them on its event loop instead of blocking a thread."""
        return self.scheduler.submit(
            enc,
            options,
            priority=priority,
            request_id=request_id,
            prefixes=prefixes,
            hook=hook,
            drafts=drafts,
            constraints=constraints,
        )

    def decode(
        self,
        enc: EncoderOutput | Encoding,
        options: DecodeOptions = DecodeOptions(),
        *,
        prefixes: Sequence[Sequence[int]] | None = None,
        hook: StepHook | None = None,
        drafts: Sequence[Sequence[int]] | None = None,
        priority: Priority = Priority.FINAL,
        request_id: RequestId | None = None,
        constraints: Sequence[Constraints] | None = None,
    ) -> list[Hypothesis]:
        """Run a search for each source of `enc` through the scheduler and wait for them.
        `enc`: the sources' states, or an `Encoding` (`encoding`) encoded on the way.

        `priority`: partials wait behind finals and offline calls. `request_id`: makes
        the searches abortable (`abort`), which raises `DecodingCancelled` here. `drafts`:
        expected continuations to verify in one call (see `DecodeScheduler.submit`).
        `constraints`: per source, target ids its output must hold (`constraints`)."""
        futures = self.submit(
            enc,
            options,
            priority=priority,
            request_id=request_id,
            prefixes=prefixes,
            hook=hook,
            drafts=drafts,
            constraints=constraints,
        )
        return [future.result() for future in futures]

    def abort(self, ids: Iterable[RequestId]) -> None:
        """Give up on the searches submitted with these ids, even those not submitted
        yet (`DecodeScheduler.abort`): a newer source made their answer useless."""
        self.scheduler.abort(ids)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.detokenize(token_ids)

    # -- offline API ------------------------------------------------------------------

    def translate(
        self,
        texts: Sequence[str],
        options: DecodeOptions = DecodeOptions(),
        *,
        prefixes: Sequence[Sequence[int]] | None = None,
        glossary: Glossary | None = None,
    ) -> list[TranslationResult]:
        """Translate a batch of sources; an empty (blank) source translates to ''.
        `glossary`: its terms matched in a source are placed in its translation (default:
        the translator's `glossary`); a source with none is translated as without.

        Raises `InputTooLongError` for a source longer than the model's positions; use
        `translate_long` to split such text into sentences.
        """
        results: list[TranslationResult | None] = [None] * len(texts)
        todo = [i for i, t in enumerate(texts) if t.strip()]
        for i, t in enumerate(texts):
            if not t.strip():
                results[i] = TranslationResult("", (), 0.0)
        if todo:
            sources = [self.source_ids(texts[i].strip()) for i in todo]
            enc = self.encoding(sources)
            chosen = [list(prefixes[i]) for i in todo] if prefixes is not None else None
            terms = (
                [()] * len(todo)
                if glossary is _NONE
                else [self.constraints(texts[i].strip(), glossary) for i in todo]
            )
            hyps = self.decode(
                enc, options, prefixes=chosen, constraints=terms if any(terms) else None
            )
            for i, hyp in zip(todo, hyps, strict=True):
                results[i] = TranslationResult(
                    self.detokenize(hyp.token_ids), hyp.token_ids, hyp.score, hyp.finished
                )
        return [r for r in results if r is not None]

    def split_long(self, text: str) -> list[str]:
        """Split text into pieces that fit the model: sentences, then clauses, then words."""
        text = text.strip()
        if not text:
            return []
        try:
            self.source_ids(text)
            return [text]
        except InputTooLongError:
            pass
        for pattern in (_SENTENCE_END, _CLAUSE_END):
            parts = [p for p in pattern.split(text) if p.strip()]
            if len(parts) > 1:
                return [piece for part in parts for piece in self.split_long(part)]
        words = text.split(" ") if " " in text else list(text)
        half = len(words) // 2
        if half == 0:
            raise InputTooLongError(len(self.tokenizer.encode_source(text)), self.max_source_tokens)
        sep = " " if " " in text else ""
        return self.split_long(sep.join(words[:half])) + self.split_long(sep.join(words[half:]))

    def translate_long(
        self,
        text: str,
        options: DecodeOptions = DecodeOptions(),
        *,
        glossary: Glossary | None = None,
    ) -> TranslationResult:
        """Translate text of any length by splitting it where `split_long` says."""
        parts = self.split_long(text)
        if not parts:
            return TranslationResult("", (), 0.0)
        results = self.translate(parts, options, glossary=glossary)
        joiner = word_joiner(self.config.target_lang)
        return TranslationResult(
            joiner.join(r.text for r in results),
            tuple(t for r in results for t in r.token_ids),
            sum(r.score for r in results),
            all(r.finished for r in results),
        )
