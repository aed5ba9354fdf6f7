"""The build step `pyproject.toml` cannot declare: a wheel carries the committed fixture
models, their recognizer data and an example log (`engine.distribution.SHIPPED`), copied
from the checkout into `engine/data/` at build time, so git holds each file once. An
editable install copies nothing: it reads them from the checkout."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def shipped() -> tuple[str, ...]:
    """`engine.distribution.SHIPPED`, read without importing the package."""
    spec = importlib.util.spec_from_file_location("_shipped", HERE / "engine" / "distribution.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.SHIPPED)


class BuildWithData(build_py):
    """`build_py`, then `SHIPPED` into the built package's `data/` (a missing file fails
    the build: a wheel without its fixtures would fail only at a user's first command)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        missing = [path for path in shipped() if not (HERE / path).is_file()]
        if missing:
            raise FileNotFoundError(f"files the wheel ships are missing: {', '.join(missing)}")
        for path in shipped():
            target = Path(self.build_lib) / "engine" / "data" / path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(HERE / path, target)


setup(cmdclass={"build_py": BuildWithData})
