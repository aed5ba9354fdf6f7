"""What is on disk, without the network: the Hugging Face cache, checksums against its
ETags, and the model directories that link its files together.

A model directory holds links into the hub cache (so the cache stays shared with other
tools) and `nmt-incremental.json`: the target-language token and the commits used.
Downloads are checked against the hub's ETag (sha256 for LFS files, git blob sha1
otherwise); `huggingface_hub` itself only checks sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.hub.catalog import CatalogEntry, RepoRef, variant_name
from engine.hub.errors import ChecksumError
from engine.hub.files import HubFile, model_files
from engine.hub.layout import onnx_files
from engine.hub.settings import HubSettings
from engine.model.config import PROJECT_CONFIG, TOKENIZER_FILES
from engine.model.names import DECODER_STEMS, ONNX_FOLDER, VARIANT_SUFFIX

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def model_dir_for(entry: CatalogEntry, settings: HubSettings) -> Path:
    return settings.models_root / entry.name


def is_complete(model_dir: Path, quantized: bool) -> bool:
    """Whether a pulled directory has everything one variant needs, with either decoder
    layout (links must resolve)."""
    if not all((model_dir / name).is_file() for name in (*TOKENIZER_FILES, PROJECT_CONFIG)):
        return False
    variant = variant_name(quantized)
    return any(
        all((model_dir / "onnx" / name).is_file() for name in onnx_files(variant, decoder))
        for decoder in DECODER_STEMS
    )


def file_digest(path: Path, etag: str) -> str | None:
    """The digest of `path` in the ETag's own kind, or None for an ETag we cannot check.

    The hub's ETag of an LFS file is its sha256; of a regular git file its blob sha1
    (sha1 over "blob <size>\\0" + content).
    """
    if _HEX64.match(etag):
        digest = hashlib.sha256()
    elif _HEX40.match(etag):
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(f"blob {path.stat().st_size}\0".encode())
    else:
        return None
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_etag(pointer: Path) -> str | None:
    """The ETag a hub-cache file was stored under: its blob's name (None if not a link)."""
    if not pointer.is_symlink():
        return None
    name = pointer.resolve().name
    return name if _HEX40.match(name) or _HEX64.match(name) else None


def _discard(pointer: Path) -> None:
    """Remove a cache entry and its blob, so that the next pull downloads it again."""
    blob = pointer.resolve()
    for path in (pointer, blob):
        path.unlink(missing_ok=True)


def verify_file(file: HubFile, pointer: Path, etag: str | None) -> bool:
    """Check one cached file against its ETag; raise ChecksumError (after discarding it)."""
    etag = cached_etag(pointer) or etag
    if etag is None:
        return False
    actual = file_digest(pointer, etag)
    if actual is None:
        return False
    if actual != etag:
        _discard(pointer)
        raise ChecksumError(file.ref.repo, file.path, etag, actual)
    return True


# -- the hub cache, without network -----------------------------------------------------


def from_cache(file: HubFile, settings: HubSettings, revision: str | None = None) -> Path | None:
    """The cached copy of a file at a revision (branch, tag or commit), if any."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(
        file.ref.repo,
        file.path,
        cache_dir=settings.hub_cache,
        revision=revision or file.ref.revision,
    )
    return Path(found) if isinstance(found, str) else None


def _known_absent(file: HubFile, settings: HubSettings) -> bool:
    """Whether the cache recorded that an (optional) file does not exist in its repo."""
    from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache

    found = try_to_load_from_cache(
        file.ref.repo, file.path, cache_dir=settings.hub_cache, revision=file.ref.revision
    )
    return found is _CACHED_NO_EXIST


def _cached_commit(ref: RepoRef, settings: HubSettings) -> str | None:
    """The commit the cache last saw for a repo's revision (refs/<revision>)."""
    if _HEX40.match(ref.revision):
        return ref.revision
    folder = settings.hub_cache / f"models--{ref.repo.replace('/', '--')}" / "refs" / ref.revision
    try:
        return folder.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def cached_files(
    files: list[HubFile], settings: HubSettings
) -> tuple[dict[str, Path], list[HubFile]]:
    """Cached paths by local name, and the files still to fetch (optional ones included
    unless the cache knows they do not exist)."""
    found: dict[str, Path] = {}
    missing: list[HubFile] = []
    for file in files:
        path = from_cache(file, settings)
        if path is not None:
            found[file.local] = path
        elif file.required or not _known_absent(file, settings):
            missing.append(file)
    return found, missing


def _link(target: Path, link: Path) -> None:
    """Atomically make `link` point at `target`: a symlink, else a hard link, else a copy."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        tmp.symlink_to(target.absolute())
    except OSError:
        try:
            os.link(target.resolve(), tmp)
        except OSError:
            shutil.copyfile(target, tmp)
    os.replace(tmp, link)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def compose(
    entry: CatalogEntry,
    settings: HubSettings,
    found: Mapping[str, Path],
    commits: Mapping[str, str],
) -> Path:
    """Link cached files into the model directory and write its nmt-incremental.json."""
    model_dir = model_dir_for(entry, settings)
    model_dir.mkdir(parents=True, exist_ok=True)
    for local, path in found.items():
        _link(path, model_dir / local)
    sources = {
        role: {
            "repo": ref.repo,
            "revision": ref.revision,
            "commit": commits.get(ref.repo),
            **({"subfolder": ref.subfolder} if ref.subfolder else {}),
        }
        for role, ref in (("onnx", entry.onnx), ("tokenizer", entry.tokenizer))
    }
    _write_json(
        model_dir / PROJECT_CONFIG,
        {
            "source_prefix": entry.source_prefix,
            "source_lang": entry.source_lang,
            "target_lang": entry.target_lang,
            "catalog_name": entry.name,
            "sources": sources,
        },
    )
    return model_dir


def all_cached(entry: CatalogEntry, settings: HubSettings) -> dict[str, Path]:
    """Every file of every variant that the cache holds (a directory gets them all)."""
    found, _ = cached_files(model_files(entry, VARIANT_SUFFIX), settings)
    return found


def cached_commits(entry: CatalogEntry, settings: HubSettings) -> dict[str, str]:
    commits = {}
    for ref in (entry.onnx, entry.tokenizer):
        commit = _cached_commit(ref, settings)
        if commit:
            commits[ref.repo] = commit
    return commits


@dataclass(frozen=True)
class CacheStatus:
    """What the cache holds of one catalog entry, for `models list`."""

    entry: CatalogEntry
    model_dir: Path | None
    variants: dict[str, int]  # complete variant -> bytes (tokenizer files included)


def cache_status(entry: CatalogEntry, settings: HubSettings) -> CacheStatus:
    """Sizes of the complete variants in the hub cache (no network)."""
    found = all_cached(entry, settings)
    shared = sum(found[f.local].stat().st_size for f in model_files(entry, []) if f.local in found)
    variants = {}
    for variant in VARIANT_SUFFIX:
        locals_ = [f"{ONNX_FOLDER}/{name}" for name in onnx_files(variant, entry.decoder)]
        required_tok = all(name in found for name in TOKENIZER_FILES)
        if required_tok and all(name in found for name in locals_):
            variants[variant] = shared + sum(found[name].stat().st_size for name in locals_)
    model_dir = model_dir_for(entry, settings)
    return CacheStatus(entry, model_dir if model_dir.is_dir() else None, variants)
