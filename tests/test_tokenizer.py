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


def _growing(sentences: list[str]) -> list[str]:
    """Every word-by-word prefix of each sentence, as a recogniser's partials grow."""
    out = []
    for sentence in sentences:
        words = sentence.split()
        out.extend(" ".join(words[:k]) for k in range(1, len(words) + 1))
    return out


@pytest.mark.parametrize("model", ["fixture", "zh_en"])
def test_word_by_word_source_pieces_equal_the_whole_texts(model: str) -> None:
    """The source pieces of growing partials come from a memo of words: each text must
    get exactly the pieces sentencepiece gives it whole (language code, partial marker,
    repeated spaces, punctuation and specials included)."""
    model_dir = FIXTURE_MODEL if model == "fixture" else ZH_EN
    if not (model_dir / "source.spm").is_file():
        pytest.skip(f"{model_dir} absent")
    tok = MarianTokenizer.from_dir(model_dir)
    english = FLORES / "eng_Latn.devtest"
    sentences = english.read_text(encoding="utf-8").splitlines()[:200] if english.is_file() else []
    if (FIXTURE_MODEL.parent / "heldout.tsv").is_file():
        rows = (FIXTURE_MODEL.parent / "heldout.tsv").read_text(encoding="utf-8").splitlines()
        sentences += [row.split("\t")[0] for row in rows]
    texts = _growing(sentences)
    texts += [f">>cmn_Hans<< {t}" for t in texts[:500]] + [f"{t} <partial>" for t in texts[:500]]
    texts += [*TRICKY, "a  b", " a b ", "x\x7fy", "It's 3pm -- ok?!", ">>de<<x y"]
    for text in texts:
        whole = [
            piece
            for chunk in tok._special_re.split(text)
            if chunk
            for piece in ([chunk] if chunk in tok.special_tokens else _code_and_rest(chunk, tok))
        ]
        assert tok.source_pieces(text) == whole, text
    assert tok._words, "the memo was never used"


def _code_and_rest(chunk: str, tok: MarianTokenizer) -> list[str]:
    """sentencepiece on a whole chunk, a leading `>>code<<` kept whole."""
    if chunk.startswith(">>") and (end := chunk.find("<<")) != -1:
        return [chunk[: end + 2], *tok.source.EncodeAsPieces(chunk[end + 2 :])]
    return list(tok.source.EncodeAsPieces(chunk))
