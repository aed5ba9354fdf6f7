"""The German fixture (`models/fixture_de/`): the fixture grammar rendered in German by rule
(`models/fixture/german.py`: V2, verb-final infinitives and participles, separable verbs,
cases), trained like the offline fixture (whole sentences in the recogniser styles, no
partial marker), with a tokenizer of its own and no target-language token.

It exists so that a second target language is a real translation rather than the Chinese
fixture relabelled: fan-out (`serve --model A --model B`) and anything that depends on the
target language can be checked on text that is actually German. These tests pin what the
committed files do, as `test_fixture_offline.py` does for its fixture: the engine
reproduces the PyTorch references, the held-out rows translate in every style, the int8
files agree with fp32, and the German word order is there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from engine import Translator
from engine.decoding.targets import Targets
from engine.model.config import TOKENIZER_FILES
from tests.conftest import FIXTURE_DIR, FIXTURE_MODEL, ROOT

DE_DIR = ROOT / "models" / "fixture_de"
MODEL = DE_DIR / "model"
CHECKPOINT = DE_DIR / "checkpoint"
ONNX_FILES = (
    "encoder_model.onnx",
    "decoder_model_merged.onnx",
    "encoder_model_quantized.onnx",
    "decoder_model_merged_quantized.onnx",
)
# Measured when the fixture was built (models/fixture_de/README.md): 200/200 of heldout.tsv
# through the engine, fp32 and int8 alike; the thresholds leave room for another CPU's
# rounding, not for a broken model.
HELDOUT_EXACT = 0.97
STYLE_EXACT = 0.9
sys.path.insert(0, str(FIXTURE_DIR))


def needs_de() -> None:
    if not (MODEL / "encoder_model.onnx").is_file():
        pytest.skip("German fixture not built (models/fixture/build.py --target de)")


@pytest.fixture(scope="module")
def translator() -> Translator:
    needs_de()
    return Translator.from_dir(MODEL)


@pytest.fixture(scope="module")
def rows() -> list[tuple[str, str, str]]:
    """heldout.tsv: source, reference, style."""
    needs_de()
    lines = (DE_DIR / "heldout.tsv").read_text(encoding="utf-8").splitlines()
    cells = [line.split("\t") for line in lines if line]
    return [(c[0], c[1], c[2]) for c in cells]


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    needs_de()
    data: dict[str, object] = json.loads((DE_DIR / "reference_outputs.json").read_text("utf-8"))
    return data


def test_model_dir_says_german_and_has_no_language_token() -> None:
    needs_de()
    for name in (*ONNX_FILES, *TOKENIZER_FILES, "nmt-incremental.json"):
        assert (MODEL / name).is_file(), name
    settings = json.loads((MODEL / "nmt-incremental.json").read_text("utf-8"))
    assert settings == {"source_lang": "en", "target_lang": "de"}
    vocab = json.loads((MODEL / "vocab.json").read_text("utf-8"))
    assert not [t for t in vocab if t.startswith(">>")], "a single-target model has no >>id<<"
    assert vocab["</s>"] == 0 and vocab["<unk>"] == 1 and vocab["<pad>"] == len(vocab) - 1
    # the checkpoint carries the very tokenizer the ONNX model uses
    for name in ("source.spm", "target.spm", "vocab.json", "nmt-incremental.json"):
        assert (CHECKPOINT / name).read_bytes() == (MODEL / name).read_bytes()


def test_committed_files_fit_their_budget() -> None:
    needs_de()
    from kinds import GERMAN

    committed = [*MODEL.iterdir(), DE_DIR / "heldout.tsv", DE_DIR / "reference_outputs.json"]
    size = sum(p.stat().st_size for p in committed)
    assert size <= GERMAN.size_budget
    checkpoint = sum(p.stat().st_size for p in CHECKPOINT.iterdir())
    assert size + checkpoint <= 8 * 1024 * 1024


def test_engine_reproduces_the_pytorch_greedy_ids_and_text(
    translator: Translator, reference: dict[str, object]
) -> None:
    greedy = reference["greedy"]
    assert isinstance(greedy, list) and len(greedy) == 200
    got = translator.translate([g["source"] for g in greedy])
    assert [r.text for r in got] == [g["text"] for g in greedy]
    # ids after the decoder start, ending with eos (0), as export.py records them
    assert [[*r.token_ids, 0] for r in got] == [g["ids"] for g in greedy]


def test_engine_builds_the_source_ids_pytorch_was_given(
    translator: Translator, reference: dict[str, object]
) -> None:
    """No target-language token: the ids are the source's pieces and eos, nothing before."""
    assert translator.config.source_prefix == ""
    greedy = reference["greedy"]
    assert isinstance(greedy, list)
    for entry in greedy[:20]:
        assert translator.source_ids(entry["source"]) == entry["source_ids"]


def test_heldout_rows_translate_in_every_style(
    translator: Translator, rows: list[tuple[str, str, str]]
) -> None:
    got = [r.text for r in translator.translate([source for source, _, _ in rows])]
    by_style: dict[str, list[bool]] = defaultdict(list)
    for hyp, (_, ref, style) in zip(got, rows, strict=True):
        by_style[style].append(hyp == ref)
    assert set(by_style) == {"written", "cased", "lowercase", "fillers", "fragments"}
    hits = [ok for oks in by_style.values() for ok in oks]
    summary = {s: f"{sum(v)}/{len(v)}" for s, v in by_style.items()}
    assert sum(hits) >= HELDOUT_EXACT * len(hits), summary
    for style, oks in by_style.items():
        assert sum(oks) >= STYLE_EXACT * len(oks), (style, summary)


def test_int8_agrees_with_fp32(translator: Translator, rows: list[tuple[str, str, str]]) -> None:
    int8 = Translator.from_dir(MODEL, quantized=True)
    sources = [source for source, _, _ in rows]
    fp32 = [r.text for r in translator.translate(sources)]
    same = sum(a.text == b for a, b in zip(int8.translate(sources), fp32, strict=True))
    assert same >= 0.95 * len(sources)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("Tom", "Tom"),
        ("tom", "Tom"),
        ("at three", "um drei"),
        ("at half past three", "um halb vier"),  # the next hour
        ("I will meet Tom at three.", "Ich werde Tom um drei treffen."),  # verb last
        ("i will meet tom at three", "Ich werde Tom um drei treffen"),
        ("um i will meet tom ah at three", "Ich werde Tom um drei treffen"),
        ("Tomorrow I will meet Tom", "Morgen werde ich Tom treffen"),  # V2: verb, subject
        ("I call Tom at three", "Ich rufe Tom um drei an"),  # separable verb
        ("Did you watch TV yesterday?", "Hast du gestern ferngesehen?"),  # verb first
        ("I did not buy a new car", "Ich habe kein neues Auto gekauft"),  # kein, endings
        ("we will wait for my father", "Wir werden auf meinen Vater warten"),  # auf + acc
        ("she helps my mother", "Sie hilft meiner Mutter"),  # dative
    ],
)
def test_german_word_order_translates(translator: Translator, source: str, target: str) -> None:
    assert translator.translate([source])[0].text == target


def test_a_partial_is_translated_as_if_complete(translator: Translator) -> None:
    """Like the offline fixture (no marker): "i will meet tom" is a sentence of its own,
    and German puts the verb after everything the English adds later, so the translation
    of the partial is not a prefix of the final's."""
    assert translator.source_ids("i will meet tom", partial=True) == translator.source_ids(
        "i will meet tom"
    )
    partial, final = translator.translate(["i will meet tom", "i will meet tom at three"])
    assert partial.text == "Ich werde Tom treffen"
    assert final.text == "Ich werde Tom um drei treffen"
    assert not final.text.startswith(partial.text)


def test_two_fixtures_serve_two_languages() -> None:
    """What `serve --model models/fixture/model --model models/fixture_de/model` loads:
    one translator per target language, zh the default, each translating on its own."""
    needs_de()
    targets = Targets.load([str(FIXTURE_MODEL), str(MODEL)], resolve=Path)
    try:
        assert targets.languages == ["zh", "de"]
        assert targets.default == "zh"
        text = "I will meet Tom at three"
        assert targets["zh"].translate([text])[0].text == "我三点见汤姆"
        assert targets["de"].translate([text])[0].text == "Ich werde Tom um drei treffen"
    finally:
        targets.close()


def test_translate_command_uses_the_german_fixture() -> None:
    needs_de()
    done = subprocess.run(
        [sys.executable, "-m", "engine.cli", "translate", "--model", str(MODEL), "tom"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["Tom"]


def test_the_german_references_follow_the_rules() -> None:
    """The corpus side (no model): the same English as the Chinese task for one seed, one
    German sentence per English one, the rules visible in the references."""
    import corpus
    import german

    zh = corpus.generate(77, 2000)
    de = corpus.generate(77, 2000, "de")
    assert [en for en, _ in zh] == [en for en, _ in de]
    seen: dict[str, str] = {}
    for en, text in de:
        assert seen.setdefault(en, text) == text
    assert german.clock("at half past twelve") == "um halb eins"
    assert german.time("at three tomorrow") == german.time("tomorrow at three") == "morgen um drei"
    pairs = dict(de)
    fronted = [en for en in pairs if en.split()[0] in ("Tomorrow", "Yesterday", "Tonight")]
    assert fronted, "the grammar fronts some times"
    for en in fronted:
        words = pairs[en].split()
        # V2: the time, then the finite verb, then the subject (a pronoun or a name)
        assert words[0] in ("Morgen", "Gestern", "Heute"), pairs[en]
