"""Lexical constraints: token sequences (a glossary's matched targets) that must appear in a
search's output, in a place the model chooses.

- **Beam**: dynamic beam allocation (Post and Vilar 2018): each step's candidates are each
  row's best tokens plus, for every row, the next token of every constraint it has not
  met; they are grouped into banks by how many constraint tokens they have met, and the
  beam is filled from the banks in turn, fullest first, best score first within a bank,
  so that hypotheses that placed more of the terms are not crowded out by the model's
  preference for its own words. Eos only ends a hypothesis that met every constraint.
- **Greedy** (`ConstrainedGreedy`): one row, no second chance, so a term goes where the
  model itself shows where it belongs: where the model's best token starts its own
  rendering of the term's source (`Constraint.cues`: the model's translation of the
  source alone), the term is written instead; where the model writes the term itself, it
  is kept; where the model would end with a term still pending, the term goes in there
  and the output ends after it (`Hypothesis.appended` marks it: a partial shows such a
  term but does not commit it, the model had not reached it); and when the room left is
  what the pending terms need. A started term is written to its end, and no piece glues
  onto its last word. Figures (and a rejected rule: starting a term wherever its first
  token came near the best one) in docs/glossaries.md.

Without constraints neither class is used (`new_search`): a search with no matched term
is the plain one, bit for bit. A forced prefix (the stable text) that already holds a
term meets it.

What a term costs the greedy search's decoder steps (each only verifies or skips reading
logits nothing needs, so the output is the same): a started term's later tokens are fed
as lookahead, one step for all; a term going in where the model ends a partial needs no
step at all; a draft holding the model's own rendering of a term's source carries the
term there (`drafted`). Figures in docs/glossaries.md (Cost).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from engine.decoding.search import (
    BeamSearch,
    DecodeOptions,
    Extension,
    GreedySearch,
    Hypothesis,
    Search,
    StepHook,
    allowed_row,
    make_search,
    may_follow,
)
from engine.model.config import ModelConfig
from engine.model.layouts import FloatArray


class Constraint(NamedTuple):
    """A term's target ids inside a sentence (`tokens`) and at its start (`initial`,
    where a tokenizer marks the start: Chinese pieces), and `cues`: the first ids of the
    model's own rendering of the term's source (where the greedy search puts the term
    instead)."""

    tokens: tuple[int, ...]
    cues: frozenset[int] = frozenset()
    initial: tuple[int, ...] = ()
    # Pieces that would glue onto the term's last word (none where words are not spaced):
    # none of them comes right after the term.
    glued: tuple[int, ...] = ()
    # The model's own rendering of the term's source, inside a sentence and at its start:
    # where a draft (the previous output) holds it, the term is what the search writes
    # there (`drafted`).
    rendering: tuple[int, ...] = ()
    initial_rendering: tuple[int, ...] = ()

    @property
    def forms(self) -> Terms:
        if self.initial and self.initial != self.tokens:
            return (self.tokens, self.initial)
        return (self.tokens,)


Constraints = tuple[Constraint, ...]
Terms = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Progress:
    """Which terms a row has met, and the form of one it is in the middle of (`active`,
    `pos` tokens of it written), as in Hokamp and Liu's grid / Post and Vilar's banks.
    A term may be written in either of its forms (`Constraint.forms`)."""

    forms: Terms  # every form of every term
    term: tuple[int, ...]  # each form's term
    initial: tuple[bool, ...]  # each form: a sentence-start form (written first only)
    met: tuple[bool, ...]  # per term
    active: int = -1  # a form
    pos: int = 0
    just_met: bool = False  # the last token ended a term

    @classmethod
    def start(cls, constraints: Constraints, tokens: Sequence[int] = ()) -> Progress:
        forms = [(i, f, form) for i, c in enumerate(constraints) for f, form in enumerate(c.forms)]
        state = cls(
            tuple(form for _, _, form in forms),
            tuple(i for i, _, _ in forms),
            tuple(f > 0 for _, f, _ in forms),
            (False,) * len(constraints),
        )
        for at, token in enumerate(tokens):
            state = state.advance(token, at == 0)
        return state

    @property
    def done(self) -> bool:
        return all(self.met)

    @property
    def count(self) -> int:
        """Terms met, and tokens of the one being written: the bank of a hypothesis
        (in units of tokens: a met term counts as its first form's length)."""
        lengths: dict[int, int] = {}
        for form, term in zip(self.forms, self.term, strict=True):
            lengths.setdefault(term, len(form))
        written = sum(lengths[i] for i, met in enumerate(self.met) if met)
        return written + (self.pos if self.active >= 0 else 0)

    def pending(self) -> list[int]:
        return [i for i, met in enumerate(self.met) if not met]

    def _opens(self, f: int, at_start: bool) -> bool:
        """Whether form `f` may begin here: its term pending, a sentence-start form at
        the start only."""
        return not self.met[self.term[f]] and (at_start or not self.initial[f])

    def wanted(self, at_start: bool = False) -> list[int]:
        """Tokens that would advance it: the active form's next one, else the first of
        every pending term's forms that may begin here."""
        if self.active >= 0:
            return [self.forms[self.active][self.pos]]
        return [form[0] for f, form in enumerate(self.forms) if self._opens(f, at_start)]

    def next_token(self) -> int:
        """The active form's next token (a form is being written)."""
        return self.forms[self.active][self.pos]

    def _meet(self, term: int) -> Progress:
        met = list(self.met)
        met[term] = True
        return Progress(self.forms, self.term, self.initial, tuple(met), just_met=True)

    def advance(self, token: int, at_start: bool = False) -> Progress:
        """The state after `token` (`at_start`: the output's first token)."""
        if self.active >= 0:
            form = self.forms[self.active]
            if form[self.pos] == token:
                if self.pos + 1 < len(form):
                    return Progress(
                        self.forms, self.term, self.initial, self.met, self.active, self.pos + 1
                    )
                return self._meet(self.term[self.active])
        for f, form in enumerate(self.forms):  # not active, or the active form broke off
            if self._opens(f, at_start) and form[0] == token:
                if len(form) == 1:
                    return self._meet(self.term[f])
                return Progress(self.forms, self.term, self.initial, self.met, f, 1)
        if self.active >= 0 or self.just_met:
            return Progress(self.forms, self.term, self.initial, self.met)
        return self


class ConstrainedGreedy(GreedySearch):
    """Greedy decoding that places every constraint (module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        prefix: Sequence[int],
        options: DecodeOptions,
        hook: StepHook | None = None,
        draft: Sequence[int] = (),
        constraints: Constraints = (),
        source_tokens: int | None = None,
    ) -> None:
        self.constraints = constraints  # read by `_begin`, which `__init__` runs
        draft = drafted(prefix, draft, constraints)
        super().__init__(config, prefix, options, hook, draft, source_tokens)

    def _begin(self) -> None:
        super()._begin()
        self.progress = Progress.start(self.constraints)
        self._ending = False  # a term went in where the model would have ended
        self._appended: int | None = None  # where the first such term went in
        # Where the room rule first put a term in instead of the model's own token, and
        # that token (`result`'s draft).
        self._displaced: tuple[int, int] | None = None

    def start(self, fed: int) -> None:
        super().start(fed)
        self.progress = Progress.start(self.constraints, self.tokens)

    @property
    def needs_logits(self) -> bool:
        state = self.progress
        return self.hook is not None or not state.done or self._ending or state.just_met

    def observe(self, logits: FloatArray) -> Extension | None:
        state = self.progress
        if len(self.tokens) < len(self.prefix) or (
            state.done and not self._ending and not state.just_met
        ):
            return super().observe(logits)
        if self._unread:  # the order of the log-probabilities is all it needs
            step = allowed_row(logits[0], self.config, len(self.tokens), self.options)
        else:
            step = self.scores(logits)[0]
        if state.just_met and self.constraints[0].glued:  # a term ends a word
            step[list(self.constraints[0].glued)] = -np.inf
        eos = self.config.eos_token_id
        if state.active >= 0:
            token = state.next_token()
            return self.take(token, self._score(step, token))
        best = int(step.argmax())
        if state.done:
            # The last term went in where the model meant to end: it ends there.
            ending, self._ending = self._ending, False
            token = eos if ending and math.isfinite(float(step[eos])) else best
            return self.take(token, self._score(step, token))
        pending = state.pending()
        # Where the model starts its own rendering of a pending term's source, the term
        # goes in (even when that rendering is another term's target: glossaries that
        # swap names); else the model's own token where it begins a term.
        cued = [i for i in pending if best in self.constraints[i].cues]
        if not cued and best in state.wanted(not self.tokens):
            return self.take(best, self._score(step, best))
        room = self.limit - len(self.tokens)
        need = sum(len(self.constraints[i].tokens) for i in pending)
        at_start = not self.tokens
        firsts = [self._form(i, at_start)[0] for i in (cued or pending)]
        candidate = max(firsts, key=lambda token: float(step[token]))
        self._ending = best == eos
        if self._ending and self._appended is None:
            self._appended = len(self.tokens)
        if cued or best == eos or room <= need:
            if not cued and best != eos and best != candidate and self._displaced is None:
                self._displaced = (len(self.tokens), best)
            return self.take(candidate, self._score(step, candidate))
        return self.take(best, self._score(step, best))

    def _score(self, step: FloatArray, token: int) -> float:
        """`token`'s log-probability in `step`; nan where `step` holds the masked logits
        (`_unread`: no score carried, as the plain search's partials)."""
        return math.nan if self._unread else float(step[token])

    def take(self, token: int, score: float) -> Extension | None:
        if len(self.tokens) >= len(self.prefix) and self.progress.active >= 0:
            # Inside a started term: its next token, whatever the model chose.
            token = self.progress.next_token()
        step = self._take_one(token, score)
        if step is not None and self._ending and self._unread and self._ends_after_term():
            # A term going in where the model meant to end is written to its end and the
            # output ends after it, whatever the model says: nothing needs a decoder step
            # (on the fixtures most of what a glossary cost partials was these steps: a
            # prefix-trained model ends a partial where its safe part ends, before the
            # term's place; docs/glossaries.md, Cost). Only where the search ends: a
            # batch feeds a going search one token a step.
            while self.progress.active >= 0:
                if self._take_one(self.progress.next_token(), 0.0) is None:
                    return None  # the length limit
            self._ending = False
            self.finished = True
            return None
        return step

    @property
    def _unread(self) -> bool:
        """Whether a step's logits would decide nothing but the search's score: no hook
        that may rewrite them, no score carried (a partial's decode)."""
        return self.hook is None and not self.options.scores

    def _ends_after_term(self) -> bool:
        """Whether the output ends once the term being written (if any) is complete: no
        other term pending, eos allowed at that length."""
        state = self.progress
        length = len(self.tokens)
        pending = state.pending()
        if state.active >= 0:
            length += len(state.forms[state.active]) - state.pos
            pending = [i for i in pending if i != state.term[state.active]]
        eos = self.config.eos_token_id
        return not pending and may_follow(eos, length, self.config, self.options)

    def _take_one(self, token: int, score: float) -> Extension | None:
        before = len(self.tokens)
        step = super().take(token, score)
        if len(self.tokens) > before:
            self.progress = self.progress.advance(self.tokens[-1], len(self.tokens) == 1)
        return step

    def take_lookahead(self, most: int) -> list[int]:
        """Inside a started term, its next tokens: the search writes them whatever the
        model says, so the batch verifies them in the coming step (lookahead) instead of
        one step each; else the draft's (`GreedySearch.take_lookahead`)."""
        state = self.progress
        if state.active >= 0 and len(self.tokens) >= len(self.prefix):
            most = min(most, self.limit - len(self.tokens))
            ahead = list(state.forms[state.active][state.pos : state.pos + max(most, 0)])
            if ahead:
                self._offered = list(ahead)  # `take` counts (and drops) those confirmed
                return ahead
        return super().take_lookahead(most)

    def result(self) -> Hypothesis:
        """With `draft` where the room rule put a term in: the model's own token there,
        then the output's tokens from there on. The room rule fills the output's last
        positions, which move on as a partial's source (and its forced length) grows; the
        model's own token is what the next partial most likely writes there, and the term
        comes after it. Without it that partial's draft was rejected at the term and the
        term cost one more step at the new end (docs/glossaries.md, Cost)."""
        draft = None
        if self._displaced is not None:
            at, own = self._displaced
            draft = (*self.tokens[:at], own, *self.tokens[at:])
        return replace(super().result(), appended=self._appended, draft=draft)

    def _form(self, term: int, at_start: bool) -> tuple[int, ...]:
        """The form of `term` the search writes: its sentence-start form at the start."""
        constraint = self.constraints[term]
        return constraint.initial if at_start and constraint.initial else constraint.tokens


def drafted(prefix: Sequence[int], draft: Sequence[int], constraints: Constraints) -> list[int]:
    """`draft` with the model's own rendering of each term's source that it holds (and
    the prefix and draft do not hold the term) replaced by the term, its first occurrence
    in the draft: the previous output, decoded before the term was matched (its source's
    last word still growing; a final after partials), holds the model's rendering where
    the constrained search now writes the term. Without this the draft was rejected at
    the term and no later token re-aligned with it (the term is not in it), so every
    token after the term cost a step. A draft only verifies: the output is the same."""
    if not draft or not any(c.rendering or c.initial_rendering for c in constraints):
        return list(draft)
    out = [*prefix, *draft]
    met = Progress.start(constraints, out).met
    for i, constraint in enumerate(constraints):
        if met[i]:
            continue
        for at in range(len(prefix), len(out)):
            rendering, term = constraint.rendering, constraint.tokens
            if at == 0:  # the sentence's start: both as the tokenizer writes them there
                rendering = constraint.initial_rendering
                term = constraint.initial or constraint.tokens
            if rendering and tuple(out[at : at + len(rendering)]) == rendering:
                out[at : at + len(rendering)] = term
                break
    return out[len(prefix) :]


class ConstrainedBeam(BeamSearch):
    """Beam search with dynamic beam allocation (module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        prefix: Sequence[int],
        options: DecodeOptions,
        hook: StepHook | None = None,
        draft: Sequence[int] = (),
        constraints: Constraints = (),
        source_tokens: int | None = None,
    ) -> None:
        self.constraints = constraints  # read by `_begin`, which `__init__` runs
        super().__init__(config, prefix, options, hook, draft, source_tokens)

    def _begin(self) -> None:
        super()._begin()
        self.states = [Progress.start(self.constraints)]

    def start(self, fed: int) -> None:
        super().start(fed)
        self.states = [Progress.start(self.constraints, self.seqs[0])]

    def observe(self, logits: FloatArray) -> Extension | None:
        beams, eos = self.beams, self.config.eos_token_id
        cur_len = len(self.seqs[0])
        if cur_len < len(self.prefix):
            token = self.prefix[cur_len]
            self.states = [state.advance(token, cur_len == 0) for state in self.states]
            return super().observe(logits)
        step = self.scores(logits).astype(np.float64)
        glued = list(self.constraints[0].glued)
        for k, state in enumerate(self.states):
            if state.just_met and glued:  # a term ends a word
                step[k, glued] = -np.inf
        total = self.beam_scores[:, None] + step
        top = min(beams, step.shape[1])
        candidates: set[tuple[int, int]] = set()
        # A term's first token where a row's best tokens hold the model's own rendering
        # of the term's source: scored as that rendering (the term takes its place).
        instead: dict[tuple[int, int], float] = {}
        for k, state in enumerate(self.states):
            best = np.argpartition(-total[k], top - 1)[:top]
            candidates.update((k, int(t)) for t in best)
            wanted = state.wanted(cur_len == 0)
            candidates.update((k, t) for t in wanted)
            if state.done:
                candidates.add((k, eos))
            if state.active < 0:
                for i in state.pending():
                    cued = [float(total[k, t]) for t in best if int(t) in self.constraints[i].cues]
                    if cued:
                        first = self._form(i, cur_len == 0)[0]
                        instead[k, first] = max(max(cued), instead.get((k, first), -np.inf))
        banks: dict[int, list[tuple[float, int, int, Progress]]] = {}
        for k, token in candidates:
            score = max(float(total[k, token]), instead.get((k, token), -np.inf))
            state = self.states[k]
            if not math.isfinite(score) or (token == eos and not state.done):
                continue  # only a hypothesis that met every term may end
            moved = state if token == eos else state.advance(token, cur_len == 0)
            if token != eos and self._loop_end([*self.seqs[k], token]) is not None:
                continue  # a looping row goes no further (`DecodeOptions.repeat_limit`)
            banks.setdefault(moved.count, []).append((score, k, token, moved))
        for bank in banks.values():
            bank.sort(key=lambda c: (-c[0], c[1], c[2]))
        # Dynamic beam allocation: the banks take turns, the one furthest along first.
        chosen: list[tuple[float, int, int, Progress]] = []
        order = sorted(banks, reverse=True)
        depth = 0
        while len(chosen) < beams and any(depth < len(banks[b]) for b in order):
            for b in order:
                if depth < len(banks[b]) and len(chosen) < beams:
                    chosen.append(banks[b][depth])
            depth += 1
        chosen.sort(key=lambda c: (-c[0], c[1], c[2]))
        for score, k, _, _ in (c for c in chosen if c[2] == eos):
            self.done.append((self._norm(score, cur_len + 1), tuple(self.seqs[k]), True))
        live = [c for c in chosen if c[2] != eos]
        self.done.sort(key=lambda d: -d[0])
        del self.done[beams:]
        scores = [c[0] for c in live]
        seqs = [[*self.seqs[c[1]], c[2]] for c in live]
        # Ends once no live hypothesis can beat the best ended one (a live one that has
        # not met every term still needs tokens, which only lower its score).
        best_live = max(scores, default=-np.inf)
        ended = bool(self.done) and (
            not np.isfinite(best_live) or self._norm(best_live, cur_len + 1) <= self.done[0][0]
        )
        if cur_len + 1 >= self.limit:
            ended = True
            if not self.done:  # no hypothesis met every term in time: the closest ones
                for seq, score in zip(seqs, scores, strict=True):
                    self.done.append((self._norm(score, len(seq)), tuple(seq), False))
        self.seqs = seqs
        self.states = [c[3] for c in live]
        self.beam_scores = np.array(scores, dtype=np.float64)
        if ended or not seqs:
            return None
        return Extension([c[2] for c in live], [c[1] for c in live])

    def _form(self, term: int, at_start: bool) -> tuple[int, ...]:
        """The form of `term` written here: its sentence-start form at the start."""
        constraint = self.constraints[term]
        return constraint.initial if at_start and constraint.initial else constraint.tokens


def new_search(
    config: ModelConfig,
    prefix: Sequence[int],
    options: DecodeOptions,
    hook: StepHook | None = None,
    draft: Sequence[int] = (),
    constraints: Constraints = (),
    source_tokens: int | None = None,
) -> Search:
    """`make_search`, or its constrained kind where `constraints` holds any term."""
    terms = tuple(c for c in constraints if c.tokens)
    if not terms:
        return make_search(config, prefix, options, hook, draft, source_tokens)
    if options.beam_size == 1:
        return ConstrainedGreedy(config, prefix, options, hook, draft, terms, source_tokens)
    return ConstrainedBeam(config, prefix, options, hook, (), terms, source_tokens)
