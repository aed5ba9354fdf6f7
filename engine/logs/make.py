"""Synthetic streaming-ASR transcript logs, made from parallel text.

Real ASR logs with references are scarce, so replays are driven by logs synthesised from
parallel text: each source sentence is revealed the way a streaming recogniser shows it
(word by word for English, 1-3 characters for Chinese), with occasional wrong last words
that the next partial corrects, re-emitted unchanged partials, and a final per segment.
The lines are in the format of ``engine.logs.format``.
"""

from __future__ import annotations

import math
import random
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.evaluation.units import unit_spans
from engine.languages import Lang, is_cjk, normalize_lang
from engine.logs.format import (
    MESSAGE_TYPE,
    PathLike,
    TranscriptLogError,
    read_lines,
    read_references,
    references_output_path,
    write_log,
)


def _is_ideograph_unit(unit: str) -> bool:
    return len(unit) == 1 and is_cjk(unit) and unit.isalpha()


class _Vocabulary:
    """Corpus words (English) or ideographs (Chinese) to draw plausible ASR mistakes from."""

    def __init__(self, sources: Sequence[str], lang: Lang) -> None:
        self.by_length: dict[int, list[str]] = {}
        self.chars: list[str] = []
        if lang == "en":
            words = sorted({w for s in sources for w in s.split()})
            for w in words:
                self.by_length.setdefault(len(w), []).append(w)
        else:
            self.chars = sorted({ch for s in sources for ch in s if _is_ideograph_unit(ch)})

    def similar_word(self, word: str, rng: random.Random) -> str | None:
        candidates = [
            w
            for n in (len(word) - 1, len(word), len(word) + 1)
            for w in self.by_length.get(n, [])
            if w.lower() != word.lower()
        ]
        return rng.choice(candidates) if candidates else None

    def other_char(self, ch: str, rng: random.Random) -> str | None:
        candidates = [c for c in self.chars if c != ch]
        return rng.choice(candidates) if candidates else None


def _wrong_unit(unit: str, lang: Lang, vocab: _Vocabulary, rng: random.Random) -> str | None:
    """A misrecognition of ``unit``: truncated (the recogniser has not heard it all yet) or a
    similar-length corpus word / another character. ``None`` when nothing plausible exists.
    """
    if lang == "zh" and _is_ideograph_unit(unit):
        return vocab.other_char(unit, rng)
    if lang == "zh" and not unit.isalnum():
        return None  # punctuation is not misheard
    truncated = None
    if len(unit) >= 3:
        truncated = unit[: rng.randint(max(1, len(unit) // 3), len(unit) - 1)]
    substitute = vocab.similar_word(unit, rng) if lang == "en" else None
    if truncated is not None and substitute is not None:
        return truncated if rng.random() < 0.5 else substitute
    return truncated if truncated is not None else substitute


def _unit_duration_ms(unit: str, lang: Lang, ms_per_word: float, ms_per_char: float) -> float:
    if lang == "en":
        return ms_per_word
    if _is_ideograph_unit(unit):
        return ms_per_char
    if unit.isalnum():  # a Latin/digit run inside Chinese, e.g. "COVID" or "2024"
        return ms_per_char * max(1.0, len(unit) / 2)
    return 0.25 * ms_per_char  # punctuation: a short pause


def _chunk_sizes(n_units: int, lang: Lang, rng: random.Random) -> list[int]:
    sizes: list[int] = []
    left = n_units
    while left > 0:
        k = 1 if lang == "en" else min(left, rng.randint(1, 3))
        sizes.append(k)
        left -= k
    return sizes


DEFAULT_STREAM_ID = "s1"
"""The stream id of a made log unless told otherwise."""

FIX_SHARE = 0.8
"""Of the rewrites made while some shown units are wrong, the share that hears them right."""


def _rewrite(
    rewritten: dict[int, str],
    units: Sequence[str],
    shown: int,
    lang: Lang,
    vocab: _Vocabulary,
    style: AsrStyle,
    rng: random.Random,
) -> None:
    """Rewrite units already shown (see ``AsrStyle``): hear some wrong ones right again, or
    mishear 1..max_rewritten consecutive ones among the last ``window`` shown."""
    if rewritten and rng.random() < FIX_SHARE:
        for i in rng.sample(sorted(rewritten), rng.randint(1, len(rewritten))):
            del rewritten[i]
        return
    count = 1
    while count < style.max_rewritten and rng.random() < 0.35:
        count += 1
    first = rng.randint(max(0, shown - style.window), shown - 1)
    for i in range(first, min(shown, first + count)):
        if i > first and lang == "en" and rng.random() < 0.3:
            rewritten[i] = ""  # merged into the misheard unit before it
            continue
        # A whole shown word is misheard as another word, never as part of one.
        if lang == "zh" and _is_ideograph_unit(units[i]):
            wrong = vocab.other_char(units[i], rng)
        else:
            wrong = vocab.similar_word(units[i], rng) if lang == "en" else None
        if wrong is not None:
            rewritten[i] = wrong


def _shown_text(
    text: str,
    spans: Sequence[tuple[int, int]],
    rewritten: Mapping[int, str],
    n: int,
    last: str | None = None,
) -> str:
    """The first n units of ``text`` as the recogniser shows them: its rewritten units in
    place (``""``: merged away), and ``last`` instead of unit n when given."""
    pieces = []
    for i in range(n):
        a, b = spans[i]
        unit = last if last is not None and i == n - 1 else rewritten.get(i, text[a:b])
        if unit:
            pieces.append(text[spans[i - 1][1] : a] if i else "")
            pieces.append(unit)
    return "".join(pieces).strip()


def _check_rate(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _check_range(name: str, value: tuple[float, float]) -> None:
    lo, hi = value
    if not (0.0 <= lo <= hi and math.isfinite(hi)):
        raise ValueError(f"{name} must be (low, high) with 0 <= low <= high, got {value}")


@dataclass(frozen=True)
class AsrStyle:
    """What a recogniser does to its partials beyond revealing the words as they are spoken.

    Real streaming recognisers rewrite words they already showed, and their finals often
    differ from the last partial; many (Vosk, Kaldi, pocketsphinx) emit lowercase text
    without punctuation.

    - ``rewrite_rate``: chance, per partial after the first, that words already shown are
      rewritten: misheard (1 to ``max_rewritten`` consecutive units among the last
      ``window`` shown, a unit sometimes merging into its neighbour as "My father" -> "Mike"
      does) or, when some are wrong, heard right again. Wrong units that are never heard
      right again are corrected only by the final, unless (``settle_rate``) the recogniser
      re-decodes the segment at its end and shows it right in a last partial.
    - ``lowercase`` / ``punctuation``: the text's casing and punctuation (finals included).
    """

    rewrite_rate: float = 0.0
    settle_rate: float = 0.25
    max_rewritten: int = 3
    window: int = 6
    lowercase: bool = False
    punctuation: bool = True

    @classmethod
    def realistic(cls) -> AsrStyle:
        """Rates like those of a real recogniser, measured with
        ``engine.evaluation.revisions.source_revisions`` on a pocketsphinx run."""
        return cls(rewrite_rate=0.3, lowercase=True, punctuation=False)

    def __post_init__(self) -> None:
        _check_rate("rewrite_rate", self.rewrite_rate)
        _check_rate("settle_rate", self.settle_rate)
        if self.max_rewritten < 1 or self.window < 1:
            raise ValueError("max_rewritten and window must be at least 1")

    def render(self, text: str) -> str:
        """The text as the recogniser writes it (casing, punctuation), spacing normalised."""
        if not self.punctuation:
            # Recognisers write no punctuation but keep a word's apostrophe ("don't"); a
            # mark between words becomes a space, except next to Chinese (no spaces there).
            chars = [
                ch
                if not unicodedata.category(ch).startswith("P")
                or (
                    ch in "'\u2019"
                    and 0 < i < len(text) - 1
                    and text[i - 1].isalpha()
                    and text[i + 1].isalpha()
                )
                else " "
                for i, ch in enumerate(text)
            ]
            words = "".join(chars).split()
            text = "".join(
                (" " if i and not (is_cjk(words[i - 1][-1]) or is_cjk(word[0])) else "") + word
                for i, word in enumerate(words)
            )
        return text.lower() if self.lowercase else text


def generate_log(
    sources: Sequence[str],
    lang: str,
    *,
    stream_id: str = DEFAULT_STREAM_ID,
    seed: int = 0,
    revision_rate: float = 0.15,
    repeat_rate: float = 0.08,
    ms_per_word: float = 350.0,
    ms_per_char: float = 200.0,
    jitter: float = 0.3,
    asr_delay_ms: tuple[float, float] = (60.0, 180.0),
    final_delay_ms: tuple[float, float] = (250.0, 500.0),
    pause_ms: tuple[float, float] = (300.0, 900.0),
    start_ms: float = 0.0,
    style: AsrStyle = AsrStyle(),
) -> list[dict[str, Any]]:
    """Transcript-log lines for ``sources`` (one segment each), deterministic for ``seed``.

    - Reveal: one word per partial (English) or 1-3 characters (Chinese; a Latin/digit run
      counts as one character, see ``units``); every partial is a prefix of the final.
    - Revisions: with probability ``revision_rate`` a partial shows its last unit wrong
      (truncated, or a similar-length word / another character from the corpus), emitted
      part-way through that unit's audio, and the next message shows the correct text.
    - Repeats: with probability ``repeat_rate`` a correct partial is re-emitted unchanged a
      little later (more audio, same text), as recognisers do.
    - Timing: each unit lasts ``ms_per_word``/``ms_per_char`` times a uniform factor in
      ``1 +- jitter`` (punctuation a quarter); ``emit_ms = end_ms + U(asr_delay_ms)``, the
      final comes ``U(final_delay_ms)`` after the segment's audio end (endpointing) and
      segments are separated by ``U(pause_ms)`` of silence, all on one clock.
    - ``style``: rewrites of words already shown, casing and punctuation (``AsrStyle``); the
      default changes nothing (the same lines as before it existed, for a seed).
    """
    target: Lang = normalize_lang(lang)
    _check_rate("revision_rate", revision_rate)
    _check_rate("repeat_rate", repeat_rate)
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    if ms_per_word <= 0 or ms_per_char <= 0:
        raise ValueError("ms_per_word and ms_per_char must be positive")
    for name, rng_range in (
        ("asr_delay_ms", asr_delay_ms),
        ("final_delay_ms", final_delay_ms),
        ("pause_ms", pause_ms),
    ):
        _check_range(name, rng_range)
    for i, source in enumerate(sources):
        if not source.strip():
            raise ValueError(f"source {i} is empty: every segment needs some text")

    rng = random.Random(seed)
    vocab = _Vocabulary([style.render(s) for s in sources], target)
    lines: list[dict[str, Any]] = []
    seq = 0
    last_emit = -math.inf
    clock = float(start_ms)

    def emit(segment_id: int, text: str, final: bool, seg_start: float, end: float) -> None:
        nonlocal seq, last_emit
        delay = rng.uniform(*(final_delay_ms if final else asr_delay_ms))
        emit_at = max(last_emit, round(end + delay, 1))
        last_emit = emit_at
        lines.append(
            {
                "type": MESSAGE_TYPE,
                "stream_id": stream_id,
                "segment_id": segment_id,
                "seq": seq,
                "text": text,
                "is_final": final,
                "start_ms": round(seg_start, 1),
                "end_ms": round(end, 1),
                "emit_ms": emit_at,
            }
        )
        seq += 1

    for segment_id, raw in enumerate(sources):
        text = style.render(raw.strip())
        if not text:
            raise ValueError(f"source {segment_id} has no words once rendered as ASR text")
        spans = unit_spans(text, target)
        units = [text[a:b] for a, b in spans]
        ends: list[float] = []
        t = clock
        for unit in units:
            factor = rng.uniform(1.0 - jitter, 1.0 + jitter)
            t += _unit_duration_ms(unit, target, ms_per_word, ms_per_char) * factor
            ends.append(t)
        seg_start, seg_end = clock, t
        shown = 0
        rewritten: dict[int, str] = {}  # unit index -> what is shown instead ("" merged away)
        for size in _chunk_sizes(len(units), target, rng):
            if style.rewrite_rate and shown and rng.random() < style.rewrite_rate:
                _rewrite(rewritten, units, shown, target, vocab, style, rng)
            shown += size
            end = ends[shown - 1]
            wrong = None
            if rng.random() < revision_rate:
                wrong = _wrong_unit(units[shown - 1], target, vocab, rng)
            if wrong is not None:
                # The guess is made part-way through the last unit's audio; hearing the
                # rest of it produces the corrected partial.
                unit_start = ends[shown - 2] if shown >= 2 else seg_start
                guess_end = unit_start + rng.uniform(0.5, 0.8) * (end - unit_start)
                guess = (
                    _shown_text(text, spans, rewritten, shown, wrong)
                    if rewritten
                    else text[: spans[shown - 1][0]] + wrong
                )
                emit(segment_id, guess, False, seg_start, guess_end)
            current = (
                _shown_text(text, spans, rewritten, shown)
                if rewritten
                else text[: spans[shown - 1][1]]
            )
            emit(segment_id, current, False, seg_start, end)
            if rng.random() < repeat_rate:
                next_end = ends[shown] if shown < len(units) else seg_end
                later = end + rng.uniform(0.3, 0.7) * (next_end - end)
                emit(segment_id, current, False, seg_start, later)
        if rewritten and rng.random() < style.settle_rate:
            emit(segment_id, text, False, seg_start, seg_end)
        emit(segment_id, text, True, seg_start, seg_end)
        clock = seg_end + rng.uniform(*pause_ms)
    return lines


def make_log_files(
    source_path: PathLike,
    out_path: PathLike,
    lang: str,
    *,
    references_path: PathLike | None = None,
    limit: int | None = None,
    seed: int = 0,
    style: AsrStyle = AsrStyle(),
    stream_id: str = DEFAULT_STREAM_ID,
) -> int:
    """Write a synthetic transcript log for the first ``limit`` lines of ``source_path``.

    With ``references_path`` (a file aligned line by line with the sources) the matching
    references are written next to the log (``references_output_path``) so that a replay of
    a truncated log still pairs each segment with its reference. Returns the number of
    segments written.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    sources = read_lines(source_path)
    for lineno, line in enumerate(sources, start=1):
        if not line:
            raise TranscriptLogError(f"{source_path}:{lineno}: empty source line")
    references: list[str] | None = None
    if references_path is not None:
        references = read_references(references_path)
        if len(references) != len(sources):
            raise TranscriptLogError(
                f"{references_path}: {len(references)} references for "
                f"{len(sources)} source lines in {source_path}"
            )
    chosen = sources if limit is None else sources[:limit]
    write_log(out_path, generate_log(chosen, lang, stream_id=stream_id, seed=seed, style=style))
    if references is not None:
        ref_out = references_output_path(out_path)
        ref_out.write_text("".join(r + "\n" for r in references[: len(chosen)]), encoding="utf-8")
    return len(chosen)
