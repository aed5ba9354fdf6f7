"""Model directories near a `--model` value that names none: what a user who mistyped a
path (`models/fixtur/model`) or left off its start (`fixture/model`) probably meant.

`fixture/model` is also the shape of a hub repo id, so without this it would be sent to
the hub and come back as a network error naming a repo nobody asked for. Found here
before any request: the model directories under the working directory (a few levels, the
usual clutter skipped), matched by their ending or, for a value that is plainly a path,
by closeness.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

MAX_DEPTH = 4
"""Levels below the working directory searched (`models/NAME/model` is three)."""
MAX_DIRS = 5000
"""Directories looked at, at most: a search started in $HOME stays quick."""
CLOSE = 0.8
"""Least `difflib` similarity of a near path; only the best (and its equals) are named."""
SKIPPED = frozenset({"node_modules", "__pycache__", "site-packages", "venv"})


def model_dirs(root: Path) -> list[str]:
    """Model directories (a config.json and an ONNX file) under `root`, as relative POSIX
    paths, nearest first (linked folders followed: the depth bounds the walk)."""
    found: list[str] = []
    for seen, (folder, subdirs, files) in enumerate(os.walk(root, followlinks=True), 1):
        depth = len(Path(folder).relative_to(root).parts)
        subdirs[:] = sorted(
            d for d in subdirs if not d.startswith(".") and d not in SKIPPED and depth < MAX_DEPTH
        )
        if "config.json" in files and any(f.endswith(".onnx") for f in files):
            found.append(Path(folder).relative_to(root).as_posix())
        if seen >= MAX_DIRS:
            break
    return sorted(found, key=lambda path: (path.count("/"), path))


def near_model_dirs(spec: str, root: Path | None = None, *, close: bool = True) -> list[str]:
    """The model directories under `root` (default: the working directory) that `spec`
    probably meant: those whose path ends with it, else (with `close`) those whose path,
    or whose ending of as many parts, is close to it."""
    wanted = spec.strip().replace("\\", "/").strip("/")
    if wanted.startswith("./"):
        wanted = wanted[2:]
    if not wanted:
        return []
    candidates = model_dirs(root or Path.cwd())
    ending = [path for path in candidates if path.endswith("/" + wanted)]
    if ending or not close:
        return ending[:3]
    parts = wanted.count("/") + 1
    scores: dict[str, float] = {}
    for path in candidates:
        tail = "/".join(path.split("/")[-parts:])
        scores[path] = max(_ratio(wanted, path), _ratio(wanted, tail))
    best = max(scores.values(), default=0.0)
    if best < CLOSE:
        return []
    return [path for path in candidates if scores[path] >= best - 0.02][:3]


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def no_such_directory(spec: str, near: list[str]) -> str:
    """The message for a `--model` that names no directory, with the near ones."""
    hint = "; did you mean " + " or ".join(near) + "?" if near else ""
    return f"{spec}: not a model directory (no such directory{hint})"
