"""Reproducibility of the fixture's training, without asking for bit-equality.

Training is deterministic on one machine (same CPU, same software: byte-identical
checkpoints), not across CPUs: float reductions run in another order on another CPU, and
after thousands of AdamW steps the weights differ. So CI never retrains; the export tests compare
the committed checkpoint with the committed ONNX instead. What a fresh retrain on any
machine must still give is the quality the fixture documents, checked here. It takes about
7.5 minutes on 2 cores, so it is marked `slow` and left out of the default run:

    python -m pytest -m slow tests/test_fixture_training.py

The offline fixture (`--kind offline`, ~3.5 minutes) is checked the same way: >= 95% exact
match in every style on unseen sentences; so is the German one (`--target de`, an offline
kind, ~5.5 minutes), against its German references:

    python -m pytest -m slow tests/test_fixture_training.py -k "offline and de"
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURE_DIR

sys.path.insert(0, str(FIXTURE_DIR))
import corpus
import styles

EVAL_SEED = 987  # not the training seed (1) nor the dev seed monitored while training (2)
EVAL_SENTENCES = 300


def translate_torch_function() -> Any:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    # By path: "evaluate" is also the name of a Hugging Face package.
    spec = importlib.util.spec_from_file_location("fixture_evaluate", FIXTURE_DIR / "evaluate.py")
    assert spec is not None and spec.loader is not None
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    return evaluate.translate_torch


def train_fresh(kind: str, checkpoint: Path, target: str = "zh") -> Path:
    """Train the fixture of `kind` translating into `target` from scratch into
    `checkpoint` (train.py, as its README says to), offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(FIXTURE_DIR / "train.py"), "--kind", kind, "--target", target]
    subprocess.run([*cmd, "--out", str(checkpoint)], check=True, env=env)
    return checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("target", ["zh", "de"])
def test_fresh_offline_training_reaches_the_documented_exact_match(
    tmp_path: Path, target: str
) -> None:
    """models/fixture_offline (zh) and models/fixture_de (de): >= 95% in every style."""
    translate_torch = translate_torch_function()
    checkpoint = train_fresh("offline", tmp_path / "checkpoint", target)
    for style in styles.STYLES:
        pairs = styles.unseen_styled(style, EVAL_SEED, EVAL_SENTENCES, target)
        hyps = translate_torch(checkpoint, [en for en, _ in pairs])
        exact = sum(h == zh for h, (_, zh) in zip(hyps, pairs, strict=True)) / len(pairs)
        print(f"unseen seed {EVAL_SEED}, {target} {style}: {exact:.1%}")
        assert exact >= 0.95, (style, exact)


@pytest.mark.slow
def test_fresh_training_reaches_the_documented_exact_match(tmp_path: Path) -> None:
    """The prefix fixture: >= 95% exact match on full sentences in every style (it is
    trained on the recogniser styles too), >= 90% of partials, cased and lowercase (as a
    recogniser writes them), equal to their safe target."""
    translate_torch = translate_torch_function()
    checkpoint = train_fresh("prefix", tmp_path / "checkpoint")
    pairs = corpus.unseen(EVAL_SEED, EVAL_SENTENCES)
    for style in styles.STYLES:
        style_pairs = styles.unseen_styled(style, EVAL_SEED, EVAL_SENTENCES)
        finals = translate_torch(checkpoint, [en for en, _ in style_pairs])
        exact = sum(h == zh for h, (_, zh) in zip(finals, style_pairs, strict=True))
        print(f"unseen seed {EVAL_SEED}, {style}: {exact / len(style_pairs):.1%}")
        assert exact >= 0.95 * len(style_pairs), (style, exact)
    for label, partials in (
        ("partials", corpus.partial_pairs(pairs, EVAL_SEED, EVAL_SENTENCES)),
        ("lowercase partials", styles.lowercase_partials(pairs, EVAL_SEED, EVAL_SENTENCES)),
    ):
        hyps = translate_torch(checkpoint, [en for en, _ in partials], partial=True)
        safe = sum(h == t for h, (_, t) in zip(hyps, partials, strict=True)) / len(partials)
        print(f"unseen seed {EVAL_SEED}, {label}: {safe:.1%} equal to their safe target")
        assert safe >= 0.90, (label, safe)
