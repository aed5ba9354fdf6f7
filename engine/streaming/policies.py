"""Stability policies: how much of the newest hypothesis to commit, and how much to show.

A policy sees the hypotheses decoded for the current segment (newest last, each starting
with the committed tokens, which are forced) and proposes a commit length and a display
length in tokens. The session then snaps the commit down to a word boundary (English) or a
character boundary (Chinese) so a sentencepiece piece or a multi-byte character is never
split, and never lets it shrink.

- LocalAgreement-n (Polák et al. 2022): commit the longest common prefix of the last n
  hypotheses.
- mask-k (Arivazhagan et al. 2020): hide the last k tokens until the final; everything
  shown is committed.
- biased decoding (Arivazhagan et al. 2020): while the hypothesis still follows the previous
  one, p'(y) = (1 - beta) p(y) + beta [y equals the previous output's token]; commits by
  LocalAgreement-n.
- first word: LocalAgreement-n limited to the first target word; everything after it stays
  tentative until the final. For models trained on whole sentences and a pair whose word
  order differs (en->zh moves time, place and companion phrases before the verb), anything
  past the first word that is committed before the source ends is usually revised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from engine.decoding.search import StepHook
from engine.model.layouts import FloatArray


def common_prefix_length(seqs: Sequence[Sequence[object]]) -> int:
    """Length of the longest prefix all sequences share (token ids, words, ...)."""
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    first = seqs[0]
    # The prefix all share is the shortest of each one's with the first (equality is
    # transitive): one plain loop per sequence, each stopping at its first difference,
    # where a generator per position cost most of a partial's agreement.
    for other in seqs[1:]:
        for i in range(n):
            if other[i] != first[i]:
                n = i
                break
    return n


@dataclass(frozen=True)
class Proposal:
    """What a policy wants: commit the first `commit` tokens, show the first `display`.

    `first_word`: commit no further than the end of the hypothesis's first word (the
    session knows where words end; a policy sees only tokens)."""

    commit: int
    display: int
    first_word: bool = False


@dataclass(frozen=True)
class LocalAgreement:
    """Commit what the last `n` hypotheses agree on."""

    n: int = 2

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("LocalAgreement needs n >= 1")

    @property
    def name(self) -> str:
        return f"local-agreement-{self.n}"

    def propose(self, history: Sequence[Sequence[int]], committed: int) -> Proposal:
        newest = history[-1]
        if len(history) < self.n:
            return Proposal(committed, len(newest))
        return Proposal(common_prefix_length(history[-self.n :]), len(newest))

    def hook(self, previous: Sequence[int] | None) -> StepHook | None:
        return None


@dataclass(frozen=True)
class MaskK:
    """Hide the last `k` tokens of every non-final hypothesis; commit the rest."""

    k: int = 3

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError("mask-k needs k >= 0")

    @property
    def name(self) -> str:
        return f"mask-{self.k}"

    def propose(self, history: Sequence[Sequence[int]], committed: int) -> Proposal:
        shown = max(len(history[-1]) - self.k, 0)
        return Proposal(shown, shown)

    def hook(self, previous: Sequence[int] | None) -> StepHook | None:
        return None


def bias_toward(previous: Sequence[int], beta: float) -> StepHook:
    """A decoding hook that favours `previous` token by token while a row still follows it."""
    prev = list(previous)

    def hook(rows: Sequence[Sequence[int]], scores: FloatArray) -> FloatArray:
        out = scores
        for r, tokens in enumerate(rows):
            t = len(tokens)
            if t >= len(prev) or list(tokens) != prev[:t]:
                continue  # diverged from (or ran past) the previous output: no bias
            if out is scores:
                out = scores.copy()
            probs = (1.0 - beta) * np.exp(scores[r])
            probs[prev[t]] += beta
            with np.errstate(divide="ignore"):
                out[r] = np.log(probs)
        return out

    return hook


@dataclass(frozen=True)
class BiasedDecoding:
    """Bias decoding toward the previous output, then commit by LocalAgreement-n."""

    beta: float = 0.3
    n: int = 2

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError("beta must be within [0, 1]")
        if self.n < 1:
            raise ValueError("biased decoding needs n >= 1")

    @property
    def name(self) -> str:
        return f"biased-{self.beta:g}"

    def propose(self, history: Sequence[Sequence[int]], committed: int) -> Proposal:
        return LocalAgreement(self.n).propose(history, committed)

    def hook(self, previous: Sequence[int] | None) -> StepHook | None:
        if not previous or self.beta == 0.0:
            return None
        return bias_toward(previous, self.beta)


@dataclass(frozen=True)
class FirstWord:
    """Commit the first target word once the last `n` hypotheses agree on it; the rest of
    the segment stays tentative (shown, never committed) until its final.

    Why: an ordinary MT model translates a partial source as if it were complete, and
    where the target language reorders (en->zh: "helen wants to study music" -> 海伦想学音乐,
    then "... on sunday" -> 海伦星期天想学音乐) any agreement past the subject is overturned
    by words still to come, however many hypotheses agreed. Committed text is also forced
    on every later decode, so a wrong commit spoils the tentative text as well. On the
    offline-trained fixture and recogniser-style logs
    (docs/streaming.md#policies-on-both-fixtures): far fewer revised finals than
    LocalAgreement-2 at the same stable LAAL, since LA-2's stable text is late wherever the
    final revises it.
    """

    n: int = 2

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("first-word needs n >= 1")

    @property
    def name(self) -> str:
        return f"first-word-{self.n}"

    def propose(self, history: Sequence[Sequence[int]], committed: int) -> Proposal:
        if committed:  # the first word is in: nothing more until the final
            return Proposal(committed, len(history[-1]))
        agreed = LocalAgreement(self.n).propose(history, committed)
        return replace(agreed, first_word=len(history) >= self.n)

    def hook(self, previous: Sequence[int] | None) -> StepHook | None:
        return None


Policy = LocalAgreement | MaskK | BiasedDecoding | FirstWord


def default_policy(prefix_trained: bool) -> Policy:
    """The policy a stream gets when none is chosen. A model trained on marked prefixes
    (`partial_suffix`) ends a partial's output where the safe part ends, so agreement
    between two hypotheses is trustworthy: LocalAgreement-2. An ordinary model (every
    OPUS-MT model on the hub) invents endings, and where word order differs they overturn
    what agreed: `FirstWord`, which revises far fewer finals at about the same latency
    (docs/streaming.md#policies-on-both-fixtures)."""
    return LocalAgreement(2) if prefix_trained else FirstWord(2)


def parse_policy(spec: str) -> Policy:
    """Policy from a command-line spec: `la2`, `local-agreement:3`, `mask:3`, `biased:0.3`,
    `first-word`, `first-word:3`."""
    name, _, arg = spec.strip().lower().partition(":")
    name = name.replace("_", "-")
    try:
        if name in ("la", "local-agreement", "localagreement") or name.startswith("la"):
            digits = arg or name.removeprefix("local-agreement").removeprefix("la").strip("-")
            return LocalAgreement(int(digits) if digits else 2)
        if name in ("mask", "mask-k") or name.startswith("mask"):
            digits = arg or name.removeprefix("mask").strip("-k")
            return MaskK(int(digits) if digits else 3)
        if name in ("first-word", "firstword", "first"):
            return FirstWord(int(arg)) if arg else FirstWord()
        if name in ("biased", "bias"):
            return BiasedDecoding(float(arg)) if arg else BiasedDecoding()
    except ValueError as exc:
        raise ValueError(f"bad policy {spec!r}: {exc}") from exc
    raise ValueError(
        f"unknown policy {spec!r}: "
        "use local-agreement[:n], mask[:k], biased[:beta] or first-word[:n]"
    )
