"""The model catalog: short names (`en-zh`) -> which hub repos hold which files.

Real OPUS-MT models are split over two repos: an ONNX conversion (e.g. `Xenova/opus-mt-*`,
files under `onnx/`) and the original Helsinki-NLP repo with the sentencepiece models and
configs. Multi-target models also need a target-language token (`>>cmn_Hans<<` for en->zh)
that no repo file records, so the catalog carries it.

The catalog is `engine/hub/catalog.json`, part of the package (an installed wheel has it);
`NMT_INCREMENTAL_CATALOG` points at another file (tests, private mirrors with other repo names).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from engine.hub.errors import CatalogError, UnknownModelError
from engine.hub.layout import onnx_files
from engine.model.names import VARIANT_SUFFIX

CATALOG_ENV = "NMT_INCREMENTAL_CATALOG"
_PACKAGED = Path(__file__).resolve().parent / "catalog.json"

# ONNX files per variant (`--quantized` selects int8) of a catalog entry (merged decoder).
ONNX_FILES: Mapping[str, tuple[str, ...]] = {v: onnx_files(v) for v in VARIANT_SUFFIX}


def variant_name(quantized: bool) -> str:
    return "int8" if quantized else "fp32"


@dataclass(frozen=True)
class RepoRef:
    """Where a group of files lives on the hub."""

    repo: str
    revision: str = "main"
    subfolder: str = ""

    def path_of(self, filename: str) -> str:
        return f"{self.subfolder.strip('/')}/{filename}" if self.subfolder.strip("/") else filename


@dataclass(frozen=True)
class CatalogEntry:
    """One pullable model: its name, languages, repos and target-language token."""

    name: str
    source_lang: str
    target_lang: str
    onnx: RepoRef
    tokenizer: RepoRef
    source_prefix: str = ""
    notes: str = ""
    decoder: str = "merged"  # which decoder files to fetch: a key of layout.DECODER_STEMS

    @property
    def repos(self) -> tuple[str, ...]:
        return (
            (self.onnx.repo,)
            if self.onnx.repo == self.tokenizer.repo
            else (
                self.onnx.repo,
                self.tokenizer.repo,
            )
        )

    @property
    def pair(self) -> str:
        return f"{self.source_lang or '?'}->{self.target_lang or '?'}"

    def at(self, onnx: str | None = None, tokenizer: str | None = None) -> CatalogEntry:
        """This entry with other revisions (branch, tag or commit) of its repos; for one
        repo holding both, `onnx` moves both."""
        onnx_ref = replace(self.onnx, revision=onnx) if onnx else self.onnx
        tok_rev = tokenizer or (onnx if self.tokenizer.repo == self.onnx.repo else None)
        tok_ref = replace(self.tokenizer, revision=tok_rev) if tok_rev else self.tokenizer
        return replace(self, onnx=onnx_ref, tokenizer=tok_ref)


@dataclass(frozen=True)
class Catalog:
    """All catalog entries, looked up by name or by either of their repo ids."""

    entries: tuple[CatalogEntry, ...]
    source: str = ""

    def names(self) -> list[str]:
        return [entry.name for entry in self.entries]

    def find(self, spec: str) -> CatalogEntry | None:
        """The entry named `spec`, or the one whose ONNX or tokenizer repo is `spec`."""
        key = spec.strip().lower()
        for entry in self.entries:
            if entry.name.lower() == key:
                return entry
        for entry in self.entries:
            if key in (repo.lower() for repo in entry.repos):
                return entry
        return None

    def lookup(self, spec: str) -> CatalogEntry:
        entry = self.find(spec)
        if entry is None:
            raise UnknownModelError(spec, self.names())
        return entry


def catalog_path() -> Path:
    """The catalog in use: $NMT_INCREMENTAL_CATALOG, else the package's."""
    override = os.environ.get(CATALOG_ENV)
    if override:
        return Path(override).expanduser()
    if _PACKAGED.is_file():
        return _PACKAGED
    raise CatalogError(
        f"model catalog not found (looked at {_PACKAGED}); "
        f"set {CATALOG_ENV} to the path of a catalog.json"
    )


def _text(value: object, where: str, *, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise CatalogError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _repo_ref(value: object, where: str) -> RepoRef:
    if not isinstance(value, dict):
        raise CatalogError(f"{where}: expected an object with 'repo' (and 'revision')")
    repo = _text(value.get("repo"), f"{where}.repo")
    if repo.count("/") != 1 or repo.startswith("/") or repo.endswith("/"):
        raise CatalogError(f"{where}.repo: {repo!r} is not a repo id of the form owner/name")
    return RepoRef(
        repo=repo,
        revision=_text(value.get("revision", "main"), f"{where}.revision"),
        subfolder=_text(value.get("subfolder"), f"{where}.subfolder", required=False),
    )


def parse_catalog(data: object, source: str = "catalog") -> Catalog:
    """Validate a decoded catalog.json, failing with the offending key's path."""
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise CatalogError(f"{source}: expected an object with a 'models' object")
    entries = []
    for name, raw in data["models"].items():
        where = f"{source}: models.{name}"
        if not isinstance(raw, dict):
            raise CatalogError(f"{where}: expected an object")
        entries.append(
            CatalogEntry(
                name=name,
                source_lang=_text(raw.get("source_lang"), f"{where}.source_lang"),
                target_lang=_text(raw.get("target_lang"), f"{where}.target_lang"),
                onnx=_repo_ref(raw.get("onnx"), f"{where}.onnx"),
                tokenizer=_repo_ref(raw.get("tokenizer"), f"{where}.tokenizer"),
                source_prefix=_text(
                    raw.get("source_prefix"), f"{where}.source_prefix", required=False
                ),
                notes=_text(raw.get("notes"), f"{where}.notes", required=False),
            )
        )
    return Catalog(tuple(entries), source)


def load_catalog(path: Path | None = None) -> Catalog:
    """Read and validate the catalog (see `catalog_path` for which file)."""
    path = path or catalog_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CatalogError(f"model catalog {path} does not exist") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CatalogError(f"cannot read model catalog {path}: {exc}") from exc
    return parse_catalog(data, str(path))
