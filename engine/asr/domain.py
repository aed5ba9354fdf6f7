"""A recognizer's model of a closed domain: a trigram language model and a pronunciation
dictionary made from the domain's sentences.

A general English model hears "does tom draw a horse" as "those are of course"; one made
from the sentences a domain says knows which words follow which, and a dictionary of its
words alone keeps the rest of English out. The language model is pocketsphinx's own ARPA
builder (`pocketsphinx.lm.ArpaBoLM`: trigrams, a fixed discount), so nothing more is
installed; the pronunciations are taken from a CMUdict-format dictionary (the one
pocketsphinx ships by default).
"""

from __future__ import annotations

import gzip
import io
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engine.asr.errors import RecognizerUnavailable
from engine.asr.sphinx import pocketsphinx

_NOT_WORD = re.compile(r"[^\w' ]+")


def normalize_words(text: str) -> str:
    """Text as a recognizer writes it: lowercase words, no punctuation (apostrophes kept:
    "don't" is one dictionary word)."""
    return " ".join(_NOT_WORD.sub(" ", text.lower()).split())


@dataclass(frozen=True)
class DomainModel:
    """The files `build_domain_model` wrote, and what it left out."""

    language_model: Path
    dictionary: Path
    words: tuple[str, ...]
    sentences: int
    unknown: tuple[str, ...] = ()  # words with no pronunciation: their sentences left out


def build_domain_model(
    sentences: Iterable[str],
    directory: str | Path,
    *,
    name: str = "domain",
    pronunciations: str | Path | None = None,
    discount: float = 0.1,
    compress: bool = False,
) -> DomainModel:
    """Write `NAME.lm` (ARPA; `.lm.gz` with `compress`) and `NAME.dict` into `directory`.

    `sentences` are normalised like a recognizer's output (`normalize_words`); a sentence
    with a word `pronunciations` (default pocketsphinx's CMUdict) lacks is left out, and the
    word listed in `unknown`, since the decoder cannot say a word it cannot pronounce.
    `discount`: the probability mass each history leaves to shorter ones (pocketsphinx's
    builder defaults to 0.5, which for a closed grammar gives away too much: 0.1 made
    fewer word errors on the spoken fixture sentences).
    """
    if not 0.0 < discount < 1.0:
        raise ValueError(f"discount must be between 0 and 1, not {discount}")
    ps = pocketsphinx()
    source = Path(pronunciations or ps.get_model_path("en-us/cmudict-en-us.dict"))
    lexicon = _read_dictionary(source)
    kept: list[str] = []
    unknown: set[str] = set()
    for sentence in sentences:
        words = normalize_words(sentence).split()
        missing = [word for word in words if word not in lexicon]
        if missing:
            unknown.update(missing)
        elif words:
            kept.append(" ".join(words))
    if not kept:
        raise ValueError(
            "no sentence to build a language model from (every one was empty "
            "or had a word without a pronunciation)"
        )
    from pocketsphinx.lm import ArpaBoLM

    builder = ArpaBoLM(add_start=True, discount_mass=discount)
    builder.read_corpus(io.StringIO("\n".join(kept) + "\n"))
    builder.compute()
    text = io.StringIO()
    builder.write(text)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    lm_path = out / (f"{name}.lm.gz" if compress else f"{name}.lm")
    if compress:  # mtime 0: the same sentences give the same bytes
        with open(lm_path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(text.getvalue().encode("utf-8"))
    else:
        lm_path.write_text(text.getvalue(), encoding="utf-8")
    vocabulary = sorted({word for sentence in kept for word in sentence.split()})
    dict_path = out / f"{name}.dict"
    lines = [f"{entry} {phones}\n" for word in vocabulary for entry, phones in lexicon[word]]
    dict_path.write_text("".join(lines), encoding="utf-8")
    return DomainModel(lm_path, dict_path, tuple(vocabulary), len(kept), tuple(sorted(unknown)))


def _read_dictionary(path: Path) -> dict[str, list[tuple[str, str]]]:
    """word -> its entries ("word", "word(2)", ...) with their phones."""
    lexicon: dict[str, list[tuple[str, str]]] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                entry, _, phones = line.strip().partition(" ")
                if entry and phones:
                    lexicon.setdefault(entry.split("(")[0], []).append((entry, phones.strip()))
    except OSError as exc:
        raise RecognizerUnavailable(f"{path}: cannot read the pronunciations ({exc})") from exc
    return lexicon
