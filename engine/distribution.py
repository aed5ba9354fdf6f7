"""What the package ships besides its code, and how it was installed.

A wheel carries the committed fixture models (their recognizer data inside) and an example
transcript log (`SHIPPED`), so that an installed package translates, serves, listens and
feeds a server with no checkout and no network. They are not copied in git: `setup.py`'s
build step copies these paths of the checkout into the wheel under `engine/data/`, in the
checkout's own layout, so a fixture's `recognizer.json` (paths relative to the model
directory) is right in both places. Run from a checkout (an editable install, or
PYTHONPATH), the same names resolve to the checkout's files.

Install hints follow how the package was installed: `pip install -e '<checkout>[asr]'`
from a checkout, the extra's own requirements for a wheel (the package is not on PyPI).

Standard library only: `setup.py` reads `SHIPPED` before anything is installed.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
DATA = PACKAGE / "data"
"""Where a wheel keeps `SHIPPED` (absent in a checkout)."""
CHECKOUT = PACKAGE.parent
"""The checkout this package runs from, when it runs from one."""

MODELS = {
    "fixture": "models/fixture/model",
    "fixture_de": "models/fixture_de/model",
    "fixture_offline": "models/fixture_offline/model",
}
"""The fixture models `--model` finds by name: en->zh trained on marked prefixes, en->de,
en->zh trained offline (models/README.md)."""
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "nmt-incremental.json",
    "recognizer.json",
    "tokenizer_config.json",
    "source.spm",
    "target.spm",
    "vocab.json",
    "encoder_model.onnx",
    "decoder_model_merged.onnx",
    "encoder_model_quantized.onnx",
    "decoder_model_merged_quantized.onnx",
    "fixture.lm.gz",
    "fixture.dict",
)
"""A shipped fixture's files: the merged decoder only (the load cuts it into the split
pair, same logits), fp32 and int8 (`--quantized`), and the recognizer data its
`recognizer.json` names (inside the model directory, as the recognizer's checks require):
about 3.4 MB a model."""
LOGS = {"fixture_en_zh": "examples/logs/fixture_en_zh.jsonl"}
"""Transcript logs `send` and `replay` find by name."""

SHIPPED = (
    *(f"{folder}/{name}" for folder in MODELS.values() for name in MODEL_FILES),
    *LOGS.values(),
)
"""Paths of the checkout that a wheel carries under `engine/data/`."""


def data_root() -> Path | None:
    """Where `SHIPPED` lies: the wheel's copy, else the checkout; None when neither has it."""
    if (DATA / "models").is_dir():
        return DATA
    if (CHECKOUT / MODELS["fixture"] / "config.json").is_file():
        return CHECKOUT
    return None


def from_checkout() -> bool:
    """Whether the package runs from its source checkout (editable install, PYTHONPATH)."""
    return (CHECKOUT / "pyproject.toml").is_file() and not DATA.is_dir()


def packaged_model(name: str) -> Path | None:
    """The fixture model directory `name` names (`fixture`, `fixture_de`, ...), or None."""
    root = data_root()
    folder = MODELS.get(name.strip().rstrip("/"))
    if root is None or folder is None or not (root / folder).is_dir():
        return None
    return root / folder


def packaged_log(name: str) -> Path | None:
    """The shipped transcript log `name` names (`fixture_en_zh`, with or without
    `.jsonl`), or None."""
    root = data_root()
    path = LOGS.get(name.removesuffix(".jsonl"))
    if root is None or path is None or not (root / path).is_file():
        return None
    return root / path


def model_names() -> list[str]:
    """The fixture names `--model` takes here."""
    return [name for name in MODELS if packaged_model(name) is not None]


def install_hint(extra: str) -> str:
    """The command that installs the optional `extra` (asr, export, cluster, gpu) for the
    package as it was installed."""
    if from_checkout():
        where = "." if Path.cwd().resolve() == CHECKOUT else str(CHECKOUT)
        return f"pip install -e '{where}[{extra}]'"
    requirements = _extra_requirements(extra)
    if requirements:
        return "pip install " + " ".join(f"'{r}'" for r in requirements)
    return f"pip install 'nmt-incremental[{extra}]'"


def _extra_requirements(extra: str) -> list[str]:
    """The requirements the installed metadata lists for `extra`, markers dropped."""
    try:
        requires = importlib.metadata.requires("nmt-incremental") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = re.compile(rf"""extra\s*==\s*["']{re.escape(extra)}["']""")
    return [r.split(";")[0].strip() for r in requires if ";" in r and marker.search(r)]


def describe() -> str:
    """One line: where the shipped fixtures are, for `models list`."""
    root = data_root()
    if root is None:
        return "fixtures: none shipped here"
    names = ", ".join(model_names())
    return f"fixtures (--model NAME): {names} in {root}{os.sep}models"
