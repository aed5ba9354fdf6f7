"""Getting catalog models from the Hugging Face hub into a directory the engine loads as is.

Files are downloaded with `huggingface_hub` into its ordinary cache (so HF_HOME /
HF_HUB_CACHE, tokens, `.incomplete` resumes and cache sharing with other tools all work);
a model directory under the nmt-incremental cache then links the files of both repos
together and adds `nmt-incremental.json` (the target-language token, the commits used).

The cache is checked first: a model whose files are all cached resolves with no request.
Every needed file gets a metadata HEAD before anything is downloaded, so a missing file or
a full disk fails fast instead of after hundreds of megabytes. The pieces: `settings`
(where from and to), `files` (what a model needs), `cache` (what is on disk, checksums,
model directories), `transfer` (the network), `repo` (a repo pulled by id).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from engine.distribution import model_names, packaged_model
from engine.errors import ModelLoadError
from engine.hub.cache import (
    all_cached,
    cached_commits,
    cached_files,
    compose,
    from_cache,
    is_complete,
    model_dir_for,
    verify_file,
)
from engine.hub.catalog import Catalog, CatalogEntry, load_catalog, variant_name
from engine.hub.errors import (
    DiskFullError,
    HubError,
    MissingFileError,
    OfflineError,
    UnknownModelError,
)
from engine.hub.files import HubFile, model_files, pull_argument, repo_model_name
from engine.hub.nearby import near_model_dirs, no_such_directory
from engine.hub.repo import repo_entry
from engine.hub.settings import HubSettings
from engine.hub.transfer import check_reachable, download_file, metadata
from engine.model.names import VARIANT_SUFFIX

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class PullResult:
    """What `pull` did: the model directory and which files came over the network."""

    name: str
    model_dir: Path
    downloaded: list[str] = field(default_factory=list)
    verified: list[str] = field(default_factory=list)
    commits: dict[str, str] = field(default_factory=dict)

    @property
    def from_cache(self) -> bool:
        return not self.downloaded


def pull(
    entry: CatalogEntry,
    *,
    quantized: bool = False,
    settings: HubSettings | None = None,
    refresh: bool = False,
    download: bool = True,
    verify: bool = True,
    log: Log = _stderr,
) -> PullResult:
    """Make the model's directory complete for one variant, downloading only what is missing.

    With everything cached no request is made (offline mode included); `refresh` asks the
    hub for newer files of the catalog revision. Raises `HubError` subclasses.
    """
    settings = settings or HubSettings.from_env()
    files = model_files(entry, [variant_name(quantized)])
    _, missing = cached_files(files, settings)
    result = PullResult(entry.name, model_dir_for(entry, settings))
    if refresh and download and not settings.offline:
        missing = files
    required = [f.label for f in missing if f.required]
    if required and not download:
        raise HubError(
            f"{entry.name} ({variant_name(quantized)}) is not in the cache "
            f"({settings.hub_cache}); missing: {', '.join(required)}; "
            f"run `nmt-incremental models pull {pull_argument(entry)}"
            + (" --quantized`" if quantized else "`")
        )
    if required and settings.offline:
        cached = len(required) < sum(f.required for f in files)
        raise OfflineError(
            f"{entry.name} is {'not fully' if cached else 'not'} in the cache, and "
            "HF_HUB_OFFLINE=1 forbids downloading it (unset it to download)"
            + (f"\n  missing: {_by_repo(f for f in missing if f.required)}" if cached else "")
            + settings.offline_help(pull_argument(entry))
        )
    if missing and download and not settings.offline:
        _fetch(missing, settings, result, log)
    found = all_cached(entry, settings)
    if verify:
        checked = set(result.verified)
        for file in model_files(entry, VARIANT_SUFFIX):
            path = found.get(file.local)
            if path is not None and file.label not in checked and verify_file(file, path, None):
                result.verified.append(file.label)
    result.commits = cached_commits(entry, settings)
    result.model_dir = compose(entry, settings, found, result.commits)
    if not is_complete(result.model_dir, quantized):
        raise HubError(f"{result.model_dir}: still incomplete after pulling {entry.name}")
    return result


def _by_repo(files: Iterable[HubFile]) -> str:
    """`owner/repo: a, b; other/repo: c`: the files a message names, shortly."""
    paths: dict[str, list[str]] = {}
    for file in files:
        paths.setdefault(file.ref.repo, []).append(file.path)
    return "; ".join(f"{repo}: {', '.join(names)}" for repo, names in paths.items())


def _fetch(missing: list[HubFile], settings: HubSettings, result: PullResult, log: Log) -> None:
    """HEAD every required file first (missing files and disk space fail fast), then
    download. Optional files go straight to the download, which records in the cache
    that they do not exist, so that later pulls need not ask again."""
    check_reachable(settings, missing[0].model if missing else result.name)
    remote = {file: metadata(file, settings) for file in missing if file.required}
    todo = {f: m for f, m in remote.items() if from_cache(f, settings, m.commit) is None}
    needed = sum(m.size for m in todo.values())
    free = _free_bytes(settings.hub_cache)
    if needed > free:
        raise DiskFullError(
            f"downloading {len(todo)} files needs {fmt_size(needed)} in {settings.hub_cache} "
            f"but only {fmt_size(free)} is free: free some space or point HF_HUB_CACHE "
            "(or HF_HOME) at a larger disk"
        )
    if todo:
        log(f"downloading {len(todo)} files ({fmt_size(needed)}) from {settings.endpoint}")
    for file, meta in remote.items():
        if file not in todo:  # cached at that commit already: just updates the cache's refs
            download_file(file, settings)
            continue
        log(f"  {file.label} ({fmt_size(meta.size)})")
        pointer = download_file(file, settings)
        result.downloaded.append(file.label)
        # Checked now against the HEAD's ETag too: a cache without symlinks has no
        # ETag-named blob to check against later.
        if verify_file(file, pointer, meta.etag):
            result.verified.append(file.label)
    for file in missing:
        if not file.required:
            before = from_cache(file, settings)
            try:
                pointer = download_file(file, settings)
            except MissingFileError:
                continue
            if before != pointer:
                result.downloaded.append(file.label)


def _free_bytes(path: Path) -> int:
    """Free space on the disk that holds `path` (or its nearest existing parent)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return shutil.disk_usage(path).free


def fmt_size(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def _is_repo_id(spec: str) -> bool:
    owner, _, name = spec.partition("/")
    return bool(owner and name) and "/" not in name and not spec.startswith((".", "~"))


def _looks_like_path(spec: str) -> bool:
    """Whether a spec that is no directory was meant as one (rather than a model name)."""
    return spec.startswith((".", "~", "/", os.sep)) or spec.count("/") > 1 or "\\" in spec


def resolve_model(
    spec: str,
    *,
    quantized: bool = False,
    download: bool = True,
    settings: HubSettings | None = None,
    catalog: Catalog | None = None,
    log: Log = _stderr,
) -> Path:
    """Turn a `--model` value into a model directory.

    An existing directory is returned as is, a fixture's name (`fixture`) as the shipped
    fixture's directory. Otherwise `spec` is a catalog name (`en-zh`)
    or one of its repo ids, resolved through the cache, downloading what is missing unless
    `download` is False or HF_HUB_OFFLINE is set.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    shipped = packaged_model(spec)  # `fixture`, `fixture_de`: the wheel's or the checkout's
    if shipped is not None:
        return shipped
    catalog = catalog or load_catalog()
    entry = catalog.find(spec)
    settings = settings or HubSettings.from_env()
    if entry is None and not path.exists():
        repo = _is_repo_id(spec)
        if repo:  # a repo the catalog does not know: its directory if a pull made it
            model_dir = settings.models_root / repo_model_name(spec)
            if is_complete(model_dir, quantized):
                return model_dir
        # A path that is not there, or a repo id that is the end of a local model
        # directory's path (`fixture/model`): the directory meant, before any request.
        near = near_model_dirs(spec, close=not repo)
        if near or _looks_like_path(spec):
            raise ModelLoadError(no_such_directory(spec, near))
        if repo and download:  # otherwise list the repo and pull it
            entry = repo_entry(spec, quantized=quantized, settings=settings)
    if entry is None:
        if path.exists():
            raise ModelLoadError(f"{spec}: not a model directory")
        raise UnknownModelError(spec, [*catalog.names(), *model_names()])
    model_dir = model_dir_for(entry, settings)
    if is_complete(model_dir, quantized):
        return model_dir
    result = pull(entry, quantized=quantized, settings=settings, download=download, log=log)
    if result.downloaded:
        log(f"{entry.name}: model directory {result.model_dir}")
    return result.model_dir
