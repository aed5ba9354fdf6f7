"""Glossary terms on the fixture languages: are they placed, is the rest as fluent, do
partials show them at once, and does a source without a term decode bit for bit as
without a glossary?

Sets (`--set`): `heldout` is each fixture's own held-out sentences
(models/fixture*/heldout.tsv) with a glossary the design never saw (names moved 9 along
the fixture's name list, drinks and goods moved 2 and 3 along theirs; German: names moved
9, drinks kept in English); `tune` is unseen sentences from seed 7 with names moved 4 and
foods moved 1 (German: foods kept in English): what START_MARGIN and the search's rules
were chosen on. Every term's target is a word
of the fixture's language that the model would not write for that source.

Per language and search (greedy, beam 4), over sentences with a matched term:
- **placed**: the share of matched terms whose target the translation holds;
- **chrF outside**: chrF of the translation without its terms against the unconstrained
  translation without the model's own renderings of the terms' sources;
- **bit-identical**: sentences with no matched term, ids and score equal without;
- **partials** (greedy, the streaming session fed one word at a time): the share of
  terms shown in the first update after their source completed, and stable-text
  revisions in segments with a term that the same segments do not have without a
  glossary;
- **cost**: the decoder steps and wall time of streaming those segments (partials and
  finals, one stream) with the glossary against without (`--rounds` alternated, medians):
  the glossary's cost on a trained model, where the benchmark model's random weights
  (capacity.py, decode_speed.py) react to a term as no trained model does
  (docs/glossaries.md, Cost).

    python examples/benchmarks/glossary_terms.py
    python examples/benchmarks/glossary_terms.py --set tune
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import sacrebleu

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "models" / "fixture"))  # corpus.py, and the german.py it imports

import corpus  # type: ignore[import-not-found]  # noqa: E402  (models/fixture/, on the path above)

from engine.decoding.search import DecodeOptions  # noqa: E402
from engine.decoding.translator import Translator  # noqa: E402
from engine.evaluation.terms import term_accuracy  # noqa: E402
from engine.glossary import Glossary, GlossaryError, holds  # noqa: E402
from engine.streaming.session import StreamSession  # noqa: E402
from protocol import PartialTranscript, TranslationUpdate  # noqa: E402

MODELS = {"zh": ROOT / "models/fixture/model", "de": ROOT / "models/fixture_de/model"}
HELDOUT = {"zh": ROOT / "models/fixture/heldout.tsv", "de": ROOT / "models/fixture_de/heldout.tsv"}


def _moved(items: Sequence[tuple[str, str]], by: int) -> list[tuple[str, str]]:
    return [(items[i][0], items[(i + by) % len(items)][1]) for i in range(len(items))]


def glossary(lang: str, which: str) -> Glossary:
    names = [(en, zh) for en, zh in corpus.NAMES]
    if lang == "de":
        names = [(en, en) for en, _ in corpus.NAMES]  # German keeps the names
    if which == "tune":
        pairs: list[tuple[str, str | None]] = list(_moved(names, 4))
        if lang == "zh":
            pairs += _moved([(en, zh) for en, _, zh in corpus.FOODS], 1)
        else:
            pairs += [(en, None) for en, _, _ in corpus.FOODS]
    else:
        pairs = list(_moved(names, 9))
        if lang == "zh":
            pairs += _moved([(en, zh) for en, _, zh in corpus.DRINKS], 2)
            pairs += _moved([(en, zh) for en, _, zh in corpus.GOODS if en != "book"], 3)
        else:
            pairs += [(en, None) for en, _, _ in corpus.DRINKS]
    return Glossary.from_pairs("en", lang, pairs, where=f"{lang} {which}")


def sources(lang: str, which: str) -> list[str]:
    if which == "tune":
        return [en for en, _ in corpus.unseen(7, 200, lang)]
    lines = HELDOUT[lang].read_text(encoding="utf-8").splitlines()
    return [line.split("\t")[0] for line in lines if line.strip()]


def usable(translator: Translator, g: Glossary) -> Glossary:
    """The glossary without the terms the model cannot write (named on stderr)."""
    kept = []
    for term in g.terms:
        try:
            translator.terms.ids(term.target)
            kept.append((term.source, None if term.keep else term.target))
        except GlossaryError as exc:
            print(f"  left out: {exc}", file=sys.stderr)
    return Glossary.from_pairs(g.source_lang, g.target_lang, kept)


def _without(text: str, pieces: Sequence[str]) -> str:
    for piece in pieces:
        if piece:
            text = text.replace(piece, " ", 1)
    return text


def offline(translator: Translator, g: Glossary, texts: list[str], beam: int) -> dict[str, float]:
    options = DecodeOptions(beam_size=beam)
    plain = translator.translate(texts, options)
    placed = translator.translate(texts, options, glossary=g)
    lang = translator.config.target_lang
    matched = hits = identical = no_term = 0
    hyps: list[str] = []
    refs: list[str] = []
    for text, before, after in zip(texts, plain, placed, strict=True):
        terms = g.targets(text)
        if not terms:
            no_term += 1
            identical += before == after
            continue
        matched += len(terms)
        hits += sum(holds(after.text, t, lang) for t in terms)
        renderings = [translator.rendering(m.term.source) for m in g.match(text)]
        hyps.append(_without(after.text, terms))
        refs.append(_without(before.text, renderings))
    chrf = sacrebleu.corpus_chrf(hyps, [refs]).score if hyps else float("nan")
    return {
        "sentences": len(hyps),
        "matched": matched,
        "placed": hits / matched if matched else float("nan"),
        "chrf_outside": chrf,
        "no_term": no_term,
        "identical": identical,
    }


def stream(translator: Translator, g: Glossary | None, texts: list[str]) -> list[TranslationUpdate]:
    """Each text as one segment, one partial per word (with a space after it: the word is
    complete) and a final, through a sans-I/O session."""
    session = StreamSession("bench", translator, glossary=g)
    updates: list[TranslationUpdate] = []
    for segment, text in enumerate(texts):
        words = text.split()
        seq = 0
        for n in range(1, len(words) + 1):
            partial = " ".join(words[:n]) + (" " if n < len(words) else "")
            event = PartialTranscript("bench", segment, seq, partial, is_final=False)
            seq += 1
            update = session.answer(event)
            if update is not None:
                updates.append(update)
        final = session.answer(PartialTranscript("bench", segment, seq, text, is_final=True))
        assert final is not None
        updates.append(final)
    return updates


def revised(updates: Sequence[TranslationUpdate]) -> set[int]:
    """Segments whose final does not begin with the stable text shown before it."""
    stable: dict[int, str] = {}
    out = set()
    for u in updates:
        if u.is_final and not u.stable_text.startswith(stable.get(u.segment_id, "")):
            out.add(u.segment_id)
        stable[u.segment_id] = u.stable_text
    return out


def streamed(
    translator: Translator, g: Glossary | None, texts: list[str]
) -> tuple[list[TranslationUpdate], int, float]:
    """`stream`'s updates, the decoder steps it took and its wall time (s)."""
    before = translator.scheduler.stats["decoder_steps"]
    start = time.perf_counter()
    updates = stream(translator, g, texts)
    wall = time.perf_counter() - start
    return updates, translator.scheduler.stats["decoder_steps"] - before, wall


def partials(
    translator: Translator, g: Glossary, texts: list[str], rounds: int
) -> dict[str, float]:
    """The streamed figures; the cost (decoder steps, wall time) of the same segments
    without and with the glossary, `rounds` times alternated (the terms' renderings
    were decoded by `offline` before: they are once per term, not per partial)."""
    with_terms = [t for t in texts if g.targets(t)]
    lang = translator.config.target_lang
    walls: dict[bool, list[float]] = {False: [], True: []}
    steps: dict[bool, int] = {}
    for _ in range(rounds):
        plain_updates, steps[False], wall = streamed(translator, None, with_terms)
        walls[False].append(wall)
        updates, steps[True], wall = streamed(translator, g, with_terms)
        walls[True].append(wall)
    placed = term_accuracy(updates, g, lang)
    return {
        "steps_without": steps[False],
        "steps_with": steps[True],
        "wall_without": statistics.median(walls[False]),
        "wall_with": statistics.median(walls[True]),
        "partial_terms": placed.partial_matched,
        "first_update_share": placed.partial_share or float("nan"),
        "stable_revisions": placed.stable_revisions,
        "stable_revisions_without": len(revised(plain_updates)),
        "caused": len(revised(updates) - revised(plain_updates)),
        "final_share": placed.final_share or float("nan"),
    }


def cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        fields = dict(line.split(":", 1) for line in info if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        return (
            f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')})"
        )
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=["heldout", "tune"], default="heldout")
    parser.add_argument("--langs", nargs="+", default=["zh", "de"])
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--rounds", type=int, default=3, help="streamed rounds for the cost, alternated"
    )
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; set {args.set}")
    for lang in args.langs:
        translator = Translator.from_dir(MODELS[lang])
        g = usable(translator, glossary(lang, args.set))
        texts = sources(lang, args.set)
        print(f"\nen->{lang}: {len(texts)} sentences, {len(g)} terms")
        for beam in args.beams:
            r = offline(translator, g, texts, beam)
            print(
                f"  beam {beam}: {r['sentences']} sentences with terms, "
                f"placed {r['placed']:.1%} of {r['matched']}, chrF outside the terms "
                f"{r['chrf_outside']:.1f}; no term: {r['identical']}/{r['no_term']} "
                "bit-identical"
            )
        p = partials(translator, g, texts, args.rounds)
        print(
            f"  partials (greedy): shown in the first update after the "
            f"source {p['first_update_share']:.1%} of {p['partial_terms']}, finals "
            f"{p['final_share']:.1%}; finals revising the stable text "
            f"{p['stable_revisions']}, without a glossary {p['stable_revisions_without']}, "
            f"caused by terms (revised only with the glossary) {p['caused']}"
        )
        # The same partials on a translator that has rendered no term yet: a partial
        # does not wait for a rendering it starts (docs/glossaries.md, Cost).
        fresh = Translator.from_dir(MODELS[lang])
        with_terms = [t for t in texts if g.targets(t)]
        cold = stream(fresh, g, with_terms)
        cold_placed = term_accuracy(cold, g, lang)
        plain = stream(fresh, None, with_terms)
        fresh.close()
        print(
            f"  the same, no term rendered yet (a fresh translator): shown in the first "
            f"update {cold_placed.partial_share or float('nan'):.1%} of "
            f"{cold_placed.partial_matched}, finals {cold_placed.final_share or float('nan'):.1%}; "
            f"finals revising the stable text {cold_placed.stable_revisions}, caused by terms "
            f"{len(revised(cold) - revised(plain))}"
        )
        print(
            f"  cost of those segments (partials and finals): decoder steps "
            f"{p['steps_with']:.0f} against {p['steps_without']:.0f} without a glossary "
            f"({p['steps_with'] / p['steps_without']:.2f}x); wall {p['wall_with']:.2f} s "
            f"against {p['wall_without']:.2f} s ({p['wall_with'] / p['wall_without']:.2f}x, "
            f"medians of {args.rounds} alternated rounds)"
        )
        translator.close()


if __name__ == "__main__":
    main()
