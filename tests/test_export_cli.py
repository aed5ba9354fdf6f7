"""`nmt-incremental models export`: the fixture checkpoint, exported again through the CLI,
must reproduce the committed ONNX model's outputs and PyTorch's (reference_outputs.json).

Skipped without the `export` extra (torch, transformers, optimum-onnx). The checkpoint is
the committed one (`models/fixture/checkpoint/`, the weights the committed ONNX holds), so
the comparison means the same on every machine.
"""

from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.cli.models import add_models_parser, run_models
from engine.conversion import verify as export_verify
from engine.decoding.translator import Translator
from tests.conftest import FIXTURE_CHECKPOINT as CHECKPOINT
from tests.conftest import FIXTURE_DIR, FIXTURE_MODEL

REFERENCE = FIXTURE_DIR / "reference_outputs.json"
SOURCES = 40  # held-out sentences compared (of the 200 in reference_outputs.json)


def run_cli(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="nmt-incremental")
    add_models_parser(parser.add_subparsers(dest="command", required=True))
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = run_models(parser.parse_args(argv))
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The fixture checkpoint exported (fp32 + int8) with `models export`, and its report."""
    missing = export_verify.missing_export_modules()
    if missing:
        pytest.skip(f"export extra not installed ({', '.join(missing)})")
    assert (CHECKPOINT / "model.safetensors").is_file(), f"no checkpoint at {CHECKPOINT}"
    if not REFERENCE.is_file() or not (FIXTURE_MODEL / "encoder_model.onnx").is_file():
        pytest.skip("fixture model not built (models/fixture/export.py)")
    out = tmp_path_factory.mktemp("export") / "model"
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    try:
        status, report, err = run_cli("models", "export", str(CHECKPOINT), str(out), "--quantize")
    finally:
        mp.undo()
    assert status == 0, f"{report}\n{err}"
    return out, report


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    if not REFERENCE.is_file():
        pytest.skip("fixture model not built (models/fixture/export.py)")
    data: dict[str, Any] = json.loads(REFERENCE.read_text(encoding="utf-8"))
    return data


def test_report_compares_with_pytorch(exported: tuple[Path, str]) -> None:
    _, report = exported
    lines = report.splitlines()
    fp32 = next(line for line in lines if line.startswith("fp32:"))
    assert "greedy tokens equal to PyTorch on 3/3 sentences" in fp32
    diff = float(fp32.rsplit(" ", 1)[-1])
    assert diff <= 1e-3
    assert any(line.startswith("int8:") for line in lines)
    assert "does not match" not in report


def test_export_is_a_complete_model_directory(exported: tuple[Path, str]) -> None:
    out, _ = exported
    for name in (
        "encoder_model.onnx",
        "decoder_model_merged.onnx",
        "encoder_model_quantized.onnx",
        "decoder_model_merged_quantized.onnx",
        "source.spm",
        "target.spm",
        "vocab.json",
        "config.json",
        "generation_config.json",
        "nmt-incremental.json",
    ):
        assert (out / name).is_file(), name
    assert json.loads((out / "nmt-incremental.json").read_text()) == json.loads(
        (FIXTURE_MODEL / "nmt-incremental.json").read_text()
    )


def test_greedy_matches_pytorch_and_the_committed_model(
    exported: tuple[Path, str], reference: dict[str, Any]
) -> None:
    out, _ = exported
    entries = reference["greedy"][:SOURCES]
    sources = [entry["source"] for entry in entries]
    ours = Translator.from_dir(out).translate(sources)
    committed = Translator.from_dir(FIXTURE_MODEL).translate(sources)
    eos = reference["eos_token_id"]
    for entry, mine, theirs in zip(entries, ours, committed, strict=True):
        want = [token for token in entry["ids"] if token != eos]
        assert list(mine.token_ids) == want, entry["source"]
        assert mine.text == entry["text"] == theirs.text


def test_first_decoder_call_logits_match_pytorch(
    exported: tuple[Path, str], reference: dict[str, Any]
) -> None:
    out, _ = exported
    translator = Translator.from_dir(out)
    for case in reference["forced_logits"]:
        enc = translator.encode([case["source_ids"]])
        ids = np.array([case["decoder_input_ids"]], dtype=np.int64)
        logits, _ = translator.model.prefill(enc, ids)
        want = np.array(case["logits"], dtype=np.float32)
        assert float(np.max(np.abs(logits[0] - want))) < 1e-3


def test_int8_export_translates_like_the_committed_int8(
    exported: tuple[Path, str], reference: dict[str, Any]
) -> None:
    out, _ = exported
    sources = [entry["source"] for entry in reference["greedy"][:SOURCES]]
    ours = Translator.from_dir(out, quantized=True).translate(sources)
    committed = Translator.from_dir(FIXTURE_MODEL, quantized=True).translate(sources)
    same = sum(a.text == b.text for a, b in zip(ours, committed, strict=True))
    assert same >= 0.9 * len(sources)


def test_missing_export_extra_is_explained(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(export_verify, "missing_export_modules", lambda: ["torch", "optimum"])
    status, _, err = run_cli("models", "export", str(tmp_path), str(tmp_path / "out"))
    assert status == 2
    assert "needs the `export` extra" in err and "pip install -e '.[export]'" in err
    assert "torch, optimum" in err


def test_incomplete_checkpoint_fails_before_exporting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(export_verify, "missing_export_modules", lambda: [])
    (tmp_path / "config.json").write_text("{}")
    status, _, err = run_cli("models", "export", str(tmp_path), str(tmp_path / "out"))
    assert status == 2 and "checkpoint lacks" in err and "source.spm" in err
    assert not (tmp_path / "out").exists()
