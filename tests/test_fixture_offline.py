"""The offline fixture (`models/fixture_offline/`): trained like real OPUS-MT, on whole
sentences only and without a partial marker, in the styles a recogniser writes (written
with punctuation, lowercase, fillers, fragments).

Streaming policies have to be measured on a model that behaves like real ones: given a
partial source it translates it as if it were complete and invents an ending, which the
prefix-trained fixture hides. These tests pin what the committed files do: the engine
reproduces the PyTorch references, the held-out rows translate in every style, the int8
files agree with fp32, and a partial is translated as a complete sentence. (The checks of
the ONNX weights against the committed checkpoint are in `test_conversion.py`, run on both
fixtures.)
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import pytest

from engine import Translator
from engine.model.config import TOKENIZER_FILES
from tests.conftest import (
    FIXTURE_OFFLINE_CHECKPOINT,
    FIXTURE_OFFLINE_DIR,
    FIXTURE_OFFLINE_MODEL,
    needs_fixture,
)

MODEL = FIXTURE_OFFLINE_MODEL
ONNX_FILES = (
    "encoder_model.onnx",
    "decoder_model_merged.onnx",
    "encoder_model_quantized.onnx",
    "decoder_model_merged_quantized.onnx",
)
sys.path.insert(0, str(FIXTURE_OFFLINE_DIR.parent / "fixture"))


@pytest.fixture(scope="module")
def translator() -> Translator:
    needs_fixture("offline")
    return Translator.from_dir(MODEL)


@pytest.fixture(scope="module")
def rows() -> list[tuple[str, str, str]]:
    """heldout.tsv: source, reference, style."""
    needs_fixture("offline")
    lines = (FIXTURE_OFFLINE_DIR / "heldout.tsv").read_text(encoding="utf-8").splitlines()
    cells = [line.split("\t") for line in lines if line]
    return [(c[0], c[1], c[2]) for c in cells]


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    needs_fixture("offline")
    data: dict[str, object] = json.loads(
        (FIXTURE_OFFLINE_DIR / "reference_outputs.json").read_text("utf-8")
    )
    return data


def test_model_dir_is_complete_and_has_no_partial_marker() -> None:
    needs_fixture("offline")
    for name in (*ONNX_FILES, *TOKENIZER_FILES, "nmt-incremental.json"):
        assert (MODEL / name).is_file(), name
    settings = json.loads((MODEL / "nmt-incremental.json").read_text("utf-8"))
    assert settings["source_prefix"] == ">>cmn_Hans<<"
    assert "partial_suffix" not in settings
    vocab = json.loads((MODEL / "vocab.json").read_text("utf-8"))
    assert "\u2581<partial>" not in vocab
    assert vocab["</s>"] == 0 and vocab["<unk>"] == 1 and vocab["<pad>"] == len(vocab) - 1
    # the checkpoint carries the very tokenizer the ONNX model uses
    for name in ("source.spm", "target.spm", "vocab.json", "nmt-incremental.json"):
        assert (FIXTURE_OFFLINE_CHECKPOINT / name).read_bytes() == (MODEL / name).read_bytes()


def test_committed_files_fit_their_budget() -> None:
    needs_fixture("offline")
    from kinds import KINDS

    onnx_and_data = [*MODEL.iterdir()]
    onnx_and_data += [FIXTURE_OFFLINE_DIR / "heldout.tsv"]
    onnx_and_data += [FIXTURE_OFFLINE_DIR / "reference_outputs.json"]
    size = sum(p.stat().st_size for p in onnx_and_data)
    assert size <= KINDS["offline"].size_budget
    checkpoint = sum(p.stat().st_size for p in FIXTURE_OFFLINE_CHECKPOINT.iterdir())
    assert size + checkpoint <= 8 * 1024 * 1024


def test_a_partial_source_is_the_source_as_it_is(translator: Translator) -> None:
    """No marker: the engine asks the same question for a partial as for a final."""
    assert translator.config.partial_suffix == ""
    text = "i will meet tom"
    assert translator.source_ids(text, partial=True) == translator.source_ids(text)


def test_engine_reproduces_the_pytorch_greedy_text(
    translator: Translator, reference: dict[str, object]
) -> None:
    greedy = reference["greedy"]
    assert isinstance(greedy, list)
    got = [r.text for r in translator.translate([g["source"] for g in greedy])]
    assert got == [g["text"] for g in greedy]


def test_heldout_rows_translate_in_every_style(
    translator: Translator, rows: list[tuple[str, str, str]]
) -> None:
    got = [r.text for r in translator.translate([source for source, _, _ in rows])]
    by_style: dict[str, list[bool]] = defaultdict(list)
    for hyp, (_, ref, style) in zip(got, rows, strict=True):
        by_style[style].append(hyp == ref)
    assert set(by_style) == {"written", "cased", "lowercase", "fillers", "fragments"}
    hits = [ok for oks in by_style.values() for ok in oks]
    assert sum(hits) >= 0.95 * len(hits), {s: f"{sum(v)}/{len(v)}" for s, v in by_style.items()}
    for style, oks in by_style.items():
        assert sum(oks) >= 0.9 * len(oks), (style, sum(oks), len(oks))


def test_int8_agrees_with_fp32(translator: Translator, rows: list[tuple[str, str, str]]) -> None:
    int8 = Translator.from_dir(MODEL, quantized=True)
    sources = [source for source, _, _ in rows]
    fp32 = [r.text for r in translator.translate(sources)]
    same = sum(a.text == b for a, b in zip(int8.translate(sources), fp32, strict=True))
    assert same >= 0.95 * len(sources)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("Tom", "汤姆"),
        ("tom", "汤姆"),
        ("at three", "三点"),
        ("my mother", "我妈妈"),
        ("I will meet Tom at three.", "我三点见汤姆。"),
        ("Did Mary call you yesterday?", "玛丽昨天给你打了电话吗？"),
        ("i will meet tom at three", "我三点见汤姆"),
        ("um i will meet tom ah at three", "我三点见汤姆"),
    ],
)
def test_names_times_and_recogniser_text_translate(
    translator: Translator, source: str, target: str
) -> None:
    assert translator.translate([source])[0].text == target


def test_a_partial_is_translated_as_if_complete(translator: Translator) -> None:
    """What real models do and the prefix-trained fixture hides: "i will meet tom" is a
    sentence of its own (我要见汤姆), not a prefix of the final's translation
    (我三点见汤姆: the time goes before the verb)."""
    partial, final = translator.translate(["i will meet tom", "i will meet tom at three"])
    assert partial.text == "我要见汤姆" and final.text == "我三点见汤姆"
    assert not final.text.startswith(partial.text)
