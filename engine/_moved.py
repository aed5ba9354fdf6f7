"""Old import paths of modules that moved into the layer folders (2026-11), kept for one release.

`import engine.runtime` still works and warns once with the new path; the tables below (old
modules, and names that left a package) are the only place that knows the old names. Remove
them, and this module, in the release after 0.1.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

MOVED: dict[str, str] = {
    "engine.runtime": "engine.model",
    "engine.batched_decoder": "engine.model.load",
    "engine.token_quantization": "engine.model.passes.per_token",
    "engine.merged_split": "engine.model.passes.merged_split",
    "engine.config": "engine.model.config",
    "engine.tokenizer": "engine.model.tokenizer",
    "engine.scheduler": "engine.decoding.scheduler",
    "engine.translator": "engine.decoding.translator",
    "engine.targets": "engine.decoding.targets",
    "engine.cli_args": "engine.cli.args",
    "engine.server.cli": "engine.cli.serve",
    "engine.hub.cli": "engine.cli.models",
    "engine.hub.export": "engine.cli.export",
    "engine.evaluation.translogs": "engine.logs",
}
"""Old module -> new module. `engine.decoding` and `engine.cli` kept their names as packages
that export what the modules did."""

MOVED_NAMES: dict[str, dict[str, str]] = {
    "engine.evaluation": {
        name: "engine.logs"
        for name in (
            "TranscriptLogError",
            "generate_log",
            "make_log_files",
            "read_log",
            "read_references",
            "write_log",
        )
    },
}
"""Package -> {name it exported -> the module that has it now}, for names that moved to a
layer above their old package, which therefore cannot import them back: the package's
module `__getattr__` (`moved_name`) looks them up on first use."""


def moved_name(package: str, name: str) -> object:
    """`package.name` from its new module, with a warning; AttributeError if it never was."""
    new = MOVED_NAMES.get(package, {}).get(name)
    if new is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(
        f"{package}.{name} moved to {new}.{name}; the old path goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(new), name)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and hands back the module under its new name (one object, two names),
    so that `isinstance` checks and monkeypatching see the same classes either way."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was imported under its new name."""


def install() -> None:
    """Put the alias finder on `sys.meta_path` once."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
