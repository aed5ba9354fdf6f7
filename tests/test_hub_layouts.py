"""`models pull REPO` for repos the catalog does not know: the layouts users meet, found
from the repo's file listing (unit tests of `engine.hub.layout`), and pulled end to end
from the fake hub on loopback (`tests/test_hub.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.decoding.translator import Translator
from engine.hub.layout import LayoutError, RepoLayout, discover
from engine.model.layouts import DecoderLayout
from tests.conftest import FIXTURE_MODEL
from tests.test_hub import (
    SENTENCE,
    FakeHub,
    fixture_translation,
    hub,  # noqa: F401  (the fake hub fixture, used by `fake`)
    run_cli,
)

TOKENIZER = ("config.json", "source.spm", "target.spm", "vocab.json", "tokenizer_config.json")
MERGED = ("encoder_model.onnx", "decoder_model_merged.onnx")
SPLIT = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")


def quantized(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n.replace(".onnx", "_quantized.onnx") for n in names)


# -- discovery from a listing -------------------------------------------------------------


def test_optimum_layout_onnx_folder_and_tokenizer_at_the_top() -> None:
    paths = [*TOKENIZER, "README.md", *(f"onnx/{n}" for n in (*MERGED, *quantized(MERGED)))]
    paths += ["onnx/decoder_model.onnx", "onnx/decoder_model_fp16.onnx"]
    assert discover("Xenova/x", paths) == RepoLayout("onnx", "", "merged", ("fp32", "int8"))


def test_everything_at_the_top() -> None:
    assert discover("Infomaniak-AI/x", [*TOKENIZER, *MERGED]) == RepoLayout(
        "", "", "merged", ("fp32",)
    )


def test_split_decoders_only_are_used_as_split() -> None:
    layout = discover("a/b", [*TOKENIZER, *(f"onnx/{n}" for n in SPLIT)])
    assert layout.decoder == "split" and layout.variants == ("fp32",)


def test_one_folder_per_pair_must_be_chosen_and_the_error_lists_them() -> None:
    pairs = ("opus-mt-en-de", "opus-mt-de-en")
    paths = [f"{pair}/{name}" for pair in pairs for name in SPLIT + TOKENIZER]
    with pytest.raises(LayoutError) as caught:
        discover("Zweiarm/x", paths)
    message = str(caught.value)
    assert "2 models" in message and "opus-mt-en-de/" in message and "opus-mt-de-en/" in message
    assert "--subfolder" in message
    layout = discover("Zweiarm/x", paths, subfolder="opus-mt-de-en")
    assert layout == RepoLayout("opus-mt-de-en", "opus-mt-de-en", "split", ("fp32",))


def test_what_was_found_is_named_when_nothing_loads() -> None:
    with pytest.raises(LayoutError, match=r"no loadable ONNX model.*model\.onnx"):
        discover("a/b", [*TOKENIZER, "model.onnx", "onnx/decoder_model_merged.onnx"])
    with pytest.raises(LayoutError, match=r"no complete set of tokenizer files.*found: vocab"):
        discover("a/b", [*MERGED, "vocab.json"])
    with pytest.raises(LayoutError, match="no encoder_model"):
        discover("a/b", [*TOKENIZER, *MERGED], subfolder="elsewhere")


# -- pulled from the fake hub -----------------------------------------------------------


def fixture_files(
    names: tuple[str, ...], folder: str = "", as_names: tuple[str, ...] = ()
) -> dict[str, bytes]:
    """Fixture files under `folder`, optionally stored under other names (`as_names`)."""
    stored = as_names or names
    prefix = f"{folder}/" if folder else ""
    pairs = zip(names, stored, strict=True)
    return {prefix + s: (FIXTURE_MODEL / n).read_bytes() for n, s in pairs}


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> FakeHub:
    """test_hub's running fake hub (its environment set up and torn down by that fixture)."""
    server: FakeHub = request.getfixturevalue("hub")
    return server


def pull_cli(*args: str) -> tuple[int, str, str]:
    return run_cli("models", "pull", *args, "--source-prefix", ">>cmn_Hans<<")


def test_pull_a_repo_with_everything_at_the_top(fake: FakeHub) -> None:
    fake.add_repo("Infomaniak-AI/onnx-opus-mt-en-zh", fixture_files((*TOKENIZER, *MERGED)))
    status, out, err = pull_cli("Infomaniak-AI/onnx-opus-mt-en-zh")
    assert status == 0, err
    model_dir = Path(out.strip())
    assert model_dir.name == "Infomaniak-AI--onnx-opus-mt-en-zh"
    translator = Translator.from_dir(model_dir)
    assert translator.translate([SENTENCE])[0].text == fixture_translation()
    assert translator.config.source_lang == "en"  # from the repo's tokenizer_config.json


def test_pull_one_folder_of_a_repo_with_int8_files_under_plain_names(fake: FakeHub) -> None:
    """Zweiarm-like: per-pair folders, split decoders only, int8 stored as plain names."""
    files: dict[str, bytes] = {}
    for pair in ("opus-mt-en-zh", "opus-mt-zh-en"):
        files |= fixture_files(TOKENIZER, pair)
        files |= fixture_files(quantized(SPLIT), pair, as_names=SPLIT)
    fake.add_repo("Zweiarm/opus-mt-onnx-int8", files)
    status, _, err = pull_cli("Zweiarm/opus-mt-onnx-int8")
    assert status == 2 and "opus-mt-en-zh/" in err and "--subfolder" in err, err
    args = ("Zweiarm/opus-mt-onnx-int8", "--subfolder", "opus-mt-en-zh")
    status, _, err = pull_cli(*args, "--quantized")
    assert status == 2 and "no int8 files" in err and "plain names" in err, err
    status, out, err = pull_cli(*args)
    assert status == 0, err
    model_dir = Path(out.strip())
    translator = Translator.from_dir(model_dir)
    assert translator.model.layout is DecoderLayout.SPLIT
    int8 = Translator.from_dir(FIXTURE_MODEL, quantized=True).translate([SENTENCE])[0]
    assert translator.translate([SENTENCE])[0].token_ids == int8.token_ids
    sources = json.loads((model_dir / "nmt-incremental.json").read_text())["sources"]
    assert sources["onnx"]["subfolder"] == "opus-mt-en-zh"


def test_pull_a_pull_request_branch(fake: FakeHub) -> None:
    """A Helsinki-NLP repo whose ONNX export exists only in an unmerged PR (refs/pr/N)."""
    repo = "Helsinki-NLP/opus-mt-en-xx"
    fake.add_repo(repo, {**fixture_files(TOKENIZER), "pytorch_model.bin": b"weights"})
    commit = fake.branch(repo, "refs/pr/21", fixture_files(MERGED, "onnx"))
    status, _, err = pull_cli(repo)
    assert status == 2 and "no loadable ONNX model" in err and "pytorch_model.bin" in err, err
    status, out, err = pull_cli(repo, "--revision", "refs/pr/21")
    assert status == 0, err
    model_dir = Path(out.strip())
    assert Translator.from_dir(model_dir).translate([SENTENCE])[0].text == fixture_translation()
    sources = json.loads((model_dir / "nmt-incremental.json").read_text())["sources"]
    assert sources["onnx"]["revision"] == "refs/pr/21" and sources["onnx"]["commit"] == commit
