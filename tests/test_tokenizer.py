"""Our sentencepiece tokenizer must give MarianTokenizer's ids and text exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.tokenizer import MarianTokenizer
from tests.conftest import FIXTURE_MODEL, FLORES, ZH_EN, shared_absent

TRICKY = [
    "",
    " ",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines",
    "数字 123 和 English 混合。",
    "emoji 😀 and rare 𠀋 characters",
    ">>cmn_Hans<< 我们今天去公园。",
    ">>cmn_Hans<<no space after the code",
    "a </s> inside and <unk> and <pad> too",
    "ＦＵＬＬＷＩＤＴＨ ｌｅｔｔｅｒｓ",
    "«quotes» — dashes … ellipsis",
]


def _reference(model_dir: Path) -> object:
    transformers = pytest.importorskip("transformers")
    return transformers.MarianTokenizer.from_pretrained(str(model_dir))


def _check(model_dir: Path, sources: list[str], targets: list[str]) -> None:
    ref = _reference(model_dir)
    ours = MarianTokenizer.from_dir(model_dir)
    for text in sources:
        expected = ref(text)["input_ids"]  # type: ignore[operator]
        assert ours.encode_source(text) == expected, text
    for text in targets:
        ids = ref(text_target=text)["input_ids"]  # type: ignore[operator]
        assert ours.encode_target(text) == ids[:-1], text
        expected_text = ref.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        assert ours.detokenize(ids) == expected_text, text
        with_specials = ref.decode(ids, skip_special_tokens=False)  # type: ignore[attr-defined]
        assert ours.detokenize(ids, skip_special_tokens=False) == with_specials, text


@pytest.mark.skipif(not ZH_EN.is_dir(), reason=shared_absent(ZH_EN))
def test_real_zh_en_tokenizer_matches_marian_tokenizer() -> None:
    zh = (FLORES / "zho_Hans.devtest").read_text(encoding="utf-8").splitlines()[:150]
    en = (FLORES / "eng_Latn.devtest").read_text(encoding="utf-8").splitlines()[:150]
    _check(ZH_EN, zh + TRICKY, en + TRICKY)


@pytest.mark.skipif(not ZH_EN.is_dir(), reason=shared_absent(ZH_EN))
def test_decoding_random_ids_matches_marian_tokenizer() -> None:
    import numpy as np

    ref = _reference(ZH_EN)
    ours = MarianTokenizer.from_dir(ZH_EN)
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, len(ours), size=int(rng.integers(1, 30))).tolist()
        assert ours.detokenize(ids) == ref.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]


def test_fixture_tokenizer_matches_marian_tokenizer() -> None:
    if not (FIXTURE_MODEL / "source.spm").is_file():
        pytest.skip("fixture model not built")
    from models.fixture.corpus import generate

    pairs = generate(seed=4242, n=100)
    _check(
        FIXTURE_MODEL,
        [f">>cmn_Hans<< {en}" for en, _ in pairs] + TRICKY,
        [zh for _, zh in pairs] + TRICKY,
    )


def test_target_language_code_is_kept_whole() -> None:
    if not (FIXTURE_MODEL / "source.spm").is_file():
        pytest.skip("fixture model not built")
    tok = MarianTokenizer.from_dir(FIXTURE_MODEL)
    ids = tok.encode_source(">>cmn_Hans<< I will meet Tom")
    assert ids[0] == tok.vocab[">>cmn_Hans<<"]
    assert ids[-1] == tok.eos_id
