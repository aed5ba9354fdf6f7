"""The errors of the recognizer adapters (a missing extra, a bad model file)."""

from __future__ import annotations

import importlib
from types import ModuleType

from engine.errors import EngineError


class RecognizerUnavailable(EngineError):
    """A recognizer cannot be made: its library is not installed, or its model files
    cannot be read (the message says which, and how to fix it)."""


def import_extra(module: str, extra: str = "asr", package: str | None = None) -> ModuleType:
    """Import an optional recognition library, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RecognizerUnavailable(
            f"speech recognition needs {package or module}, which is not installed: "
            f"pip install -e '.[{extra}]' (or pip install {package or module})"
        ) from exc
