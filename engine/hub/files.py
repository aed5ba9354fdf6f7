"""What a model directory needs from the hub (`HubFile`, `model_files`), and the names a
model is pulled by, so that every hint prints a command `models pull` accepts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.hub.catalog import CatalogEntry, RepoRef
from engine.hub.layout import onnx_files
from engine.model.config import OPTIONAL_TOKENIZER_FILES, TOKENIZER_FILES
from engine.model.names import ONNX_FOLDER


@dataclass(frozen=True)
class HubFile:
    """One file a model directory needs: where it is on the hub, where it goes locally."""

    ref: RepoRef
    filename: str
    local: str
    required: bool = True
    model: str = "NAME"  # what `models pull` takes to get it (`pull_argument`), for messages

    @property
    def path(self) -> str:
        """Path inside the repo."""
        return self.ref.path_of(self.filename)

    @property
    def label(self) -> str:
        return f"{self.ref.repo}/{self.path}"


def model_files(entry: CatalogEntry, variants: Iterable[str]) -> list[HubFile]:
    """The hub files of the given variants ('fp32', 'int8'), tokenizer files included."""
    model = pull_argument(entry)
    files = [HubFile(entry.tokenizer, name, name, True, model) for name in TOKENIZER_FILES]
    files += [
        HubFile(entry.tokenizer, name, name, False, model) for name in OPTIONAL_TOKENIZER_FILES
    ]
    for variant in variants:
        files += [
            HubFile(entry.onnx, name, f"{ONNX_FOLDER}/{name}", True, model)
            for name in onnx_files(variant, entry.decoder)
        ]
    return files


def repo_model_name(repo: str, subfolder: str | None = None) -> str:
    """The model directory name of a repo pulled by id (one per repo and subfolder)."""
    parts = [repo, *([subfolder.strip("/")] if subfolder and subfolder.strip("/") else [])]
    return "--".join(part.replace("/", "--") for part in parts)


def repo_pull_argument(repo: str, subfolder: str | None = None) -> str:
    sub = subfolder.strip("/") if subfolder else ""
    return f"{repo} --subfolder {sub}" if sub else repo


def pull_argument(entry: CatalogEntry) -> str:
    """What `models pull` takes to get `entry`, for the commands hints print: its catalog
    name, or for a repo pulled by id the repo id (and `--subfolder`), since the name of
    its model directory (`owner--name`) is not something `models pull` accepts."""
    base = repo_model_name(entry.onnx.repo)
    if entry.name == base:
        return entry.onnx.repo
    if entry.name.startswith(f"{base}--"):
        return repo_pull_argument(entry.onnx.repo, entry.name[len(base) + 2 :].replace("--", "/"))
    return entry.name
