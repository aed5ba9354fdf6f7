"""Getting catalog models from the Hugging Face hub into a directory the engine loads as is.

Files are downloaded with `huggingface_hub` into its ordinary cache (so HF_HOME /
HF_HUB_CACHE, tokens, `.incomplete` resumes and cache sharing with other tools all work);
a model directory under the nmt-incremental cache then links the files of both repos
together and adds `nmt-incremental.json` (the target-language token, the commits used).

Design points:
- The cache is checked first: a model whose files are all cached resolves with no request.
- Settings (endpoint, cache, offline mode) are read from the environment at call time and
  passed explicitly to `huggingface_hub`, whose own constants are frozen at import.
- Every needed file gets a metadata HEAD before anything is downloaded, so a missing file
  or a full disk fails fast instead of after hundreds of megabytes.
- Downloads are checked against the hub's ETag (sha256 for LFS files, git blob sha1
  otherwise); `huggingface_hub` itself only checks sizes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.hub.catalog import (
    Catalog,
    CatalogEntry,
    RepoRef,
    load_catalog,
    variant_name,
)
from engine.hub.errors import (
    OFFLINE_HELP,
    ChecksumError,
    DiskFullError,
    HubError,
    MissingFileError,
    NetworkError,
    OfflineError,
    RepoAccessError,
    UnknownModelError,
)
from engine.hub.layout import LayoutError, discover, onnx_files
from engine.model import (
    DECODER_STEMS,
    ONNX_FOLDER,
    OPTIONAL_TOKENIZER_FILES,
    PROJECT_CONFIG,
    TOKENIZER_FILES,
    VARIANT_SUFFIX,
)

DEFAULT_ENDPOINT = "https://huggingface.co"
HOME_ENV = "NMT_INCREMENTAL_HOME"
_TRUE = {"1", "on", "yes", "true"}
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class HubSettings:
    """Where to download from and cache to, and whether the network may be used."""

    endpoint: str
    hub_cache: Path
    models_root: Path
    offline: bool
    token: str | None = (
        None  # HF_TOKEN or the saved login ($HF_HOME/token); None: the library's lookup
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HubSettings:
        """Read the same variables as huggingface_hub, but now rather than at its import."""
        env = os.environ if env is None else env
        xdg = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
        hf_home = Path(os.path.expandvars(env.get("HF_HOME") or xdg / "huggingface")).expanduser()
        hub_cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
        offline = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
        token = env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN")
        if not token:
            token_file = Path(env.get("HF_TOKEN_PATH") or hf_home / "token").expanduser()
            with contextlib.suppress(OSError, UnicodeDecodeError):
                token = token_file.read_text(encoding="utf-8").strip()
        return cls(
            endpoint=(env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
            hub_cache=Path(hub_cache).expanduser() if hub_cache else hf_home / "hub",
            models_root=Path(env.get(HOME_ENV) or xdg / "nmt-incremental").expanduser() / "models",
            offline=offline.strip().lower() in _TRUE,
            token=token or None,
        )

    def offline_help(self, name: str = "NAME") -> str:
        """How to get `name` (what `models pull` takes) here without the hub. A repo the
        catalog does not know needs its model directory copied as well: only that records
        the layout its file listing gave, and listing needs the hub."""
        if "/" not in name:
            return OFFLINE_HELP.format(cache=self.hub_cache, name=name)
        both = OFFLINE_HELP.replace(
            "Hugging Face cache ({cache}) to the same place here",
            "Hugging Face cache ({cache}) and the model directory it prints (under "
            f"{self.models_root}) to the same places here",
        )
        return both.format(cache=self.hub_cache, name=name)


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


# -- checksums ------------------------------------------------------------------------


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


def _verify(file: HubFile, pointer: Path, etag: str | None) -> bool:
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


def _from_cache(file: HubFile, settings: HubSettings, revision: str | None = None) -> Path | None:
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


def _cached_files(
    files: list[HubFile], settings: HubSettings
) -> tuple[dict[str, Path], list[HubFile]]:
    """Cached paths by local name, and the files still to fetch (optional ones included
    unless the cache knows they do not exist)."""
    found: dict[str, Path] = {}
    missing: list[HubFile] = []
    for file in files:
        path = _from_cache(file, settings)
        if path is not None:
            found[file.local] = path
        elif file.required or not _known_absent(file, settings):
            missing.append(file)
    return found, missing


# -- network ------------------------------------------------------------------------


def _check_reachable(settings: HubSettings, name: str, timeout: float = 10.0) -> None:
    """Fail at once when the endpoint cannot be reached, instead of after the library's
    retries for every file. Skipped when a proxy is configured for it."""
    url = urllib.parse.urlsplit(settings.endpoint)
    host = url.hostname
    if not host:
        raise HubError(f"HF_ENDPOINT {settings.endpoint!r} is not a URL")
    if urllib.request.getproxies().get(url.scheme) and not urllib.request.proxy_bypass(host):
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise NetworkError(
            f"cannot reach {settings.endpoint} ({exc.strerror or exc}); "
            + settings.offline_help(name)
        ) from exc


def _map_error(exc: BaseException, file: HubFile, settings: HubSettings) -> HubError | None:
    """Translate huggingface_hub / requests errors into errors that say what to do."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        FileMetadataError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, endpoint = file.ref.repo, settings.endpoint
    if isinstance(exc, OfflineModeIsEnabled):
        return OfflineError(
            "huggingface_hub is in offline mode (HF_HUB_OFFLINE was set when it was "
            f"imported) but {file.label} is not cached; {settings.offline_help(file.model)}"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        return NetworkError(
            f"cannot download {file.label} from {endpoint} and it is not cached; "
            f"{settings.offline_help(file.model)}"
        )
    if isinstance(exc, GatedRepoError):
        return RepoAccessError(
            f"{repo} on {endpoint} is gated: accept its terms on the hub and log in "
            "(`hf auth login`) or set HF_TOKEN"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return RepoAccessError(
            f"repository {repo} not found on {endpoint} (if it is private, log in with "
            "`hf auth login` or set HF_TOKEN)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return RepoAccessError(
            f"repository {repo} on {endpoint} has no revision {file.ref.revision!r}"
        )
    if isinstance(exc, EntryNotFoundError):
        return MissingFileError(repo, file.path, file.ref.revision, endpoint)
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status == 404:
            return MissingFileError(repo, file.path, file.ref.revision, endpoint)
        if status in (401, 403):
            return RepoAccessError(
                f"{endpoint} refused {file.label} (HTTP {status}): log in with "
                "`hf auth login` or set HF_TOKEN"
            )
        return NetworkError(f"{endpoint} answered HTTP {status} for {file.label}: {exc}")
    if isinstance(exc, FileMetadataError):
        return HubError(
            f"{endpoint} does not answer like a Hugging Face hub for {file.label} "
            f"(missing X-Repo-Commit, ETag or size): {exc}"
        )
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return DiskFullError(
            f"no space left on the disk of {settings.hub_cache} while downloading "
            f"{file.label}: free some space or point HF_HUB_CACHE (or HF_HOME) at a larger "
            "disk, then run the same command again (finished files are kept)"
        )
    if isinstance(exc, OSError):  # requests' ConnectionError, Timeout, ChunkedEncodingError
        return NetworkError(
            f"transfer of {file.label} from {endpoint} failed ({exc}); run the same command "
            "again to resume (the partial download is kept in the cache)"
        )
    return None


@dataclass(frozen=True)
class _Remote:
    etag: str
    commit: str
    size: int


def _metadata(file: HubFile, settings: HubSettings) -> _Remote:
    """HEAD one file: its ETag, commit and size."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(
        file.ref.repo, file.path, revision=file.ref.revision, endpoint=settings.endpoint
    )
    try:
        meta = get_hf_file_metadata(url, token=settings.token)
    except Exception as exc:
        mapped = _map_error(exc, file, settings)
        if mapped is None:
            raise
        raise mapped from exc
    if meta.etag is None or meta.commit_hash is None or meta.size is None:
        raise HubError(
            f"{settings.endpoint} does not answer like a Hugging Face hub for {file.label} "
            "(missing X-Repo-Commit, ETag or size)"
        )
    return _Remote(meta.etag, meta.commit_hash, meta.size)


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


def _download(file: HubFile, settings: HubSettings) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(
            hf_hub_download(
                file.ref.repo,
                file.path,
                revision=file.ref.revision,
                cache_dir=settings.hub_cache,
                endpoint=settings.endpoint,
                token=settings.token,
            )
        )
    except Exception as exc:
        mapped = _map_error(exc, file, settings)
        if mapped is None:
            raise
        raise mapped from exc


# -- model directories ----------------------------------------------------------------


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


def _compose(
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


def _all_cached(entry: CatalogEntry, settings: HubSettings) -> dict[str, Path]:
    """Every file of every variant that the cache holds (a directory gets them all)."""
    found, _ = _cached_files(model_files(entry, VARIANT_SUFFIX), settings)
    return found


def _commits(entry: CatalogEntry, settings: HubSettings) -> dict[str, str]:
    commits = {}
    for ref in (entry.onnx, entry.tokenizer):
        commit = _cached_commit(ref, settings)
        if commit:
            commits[ref.repo] = commit
    return commits


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
    _, missing = _cached_files(files, settings)
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
        raise OfflineError(
            f"{entry.name} is not fully cached and HF_HUB_OFFLINE=1 forbids downloads; "
            f"missing: {', '.join(required)}; unset HF_HUB_OFFLINE to download, or "
            + settings.offline_help(pull_argument(entry))
        )
    if missing and download and not settings.offline:
        _fetch(missing, settings, result, log)
    found = _all_cached(entry, settings)
    if verify:
        checked = set(result.verified)
        for file in model_files(entry, VARIANT_SUFFIX):
            path = found.get(file.local)
            if path is not None and file.label not in checked and _verify(file, path, None):
                result.verified.append(file.label)
    result.commits = _commits(entry, settings)
    result.model_dir = _compose(entry, settings, found, result.commits)
    if not is_complete(result.model_dir, quantized):
        raise HubError(f"{result.model_dir}: still incomplete after pulling {entry.name}")
    return result


def _fetch(missing: list[HubFile], settings: HubSettings, result: PullResult, log: Log) -> None:
    """HEAD every required file first (missing files and disk space fail fast), then
    download. Optional files go straight to the download, which records in the cache
    that they do not exist, so that later pulls need not ask again."""
    _check_reachable(settings, missing[0].model if missing else result.name)
    remote = {file: _metadata(file, settings) for file in missing if file.required}
    todo = {f: m for f, m in remote.items() if _from_cache(f, settings, m.commit) is None}
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
            _download(file, settings)
            continue
        log(f"  {file.label} ({fmt_size(meta.size)})")
        pointer = _download(file, settings)
        result.downloaded.append(file.label)
        # Checked now against the HEAD's ETag too: a cache without symlinks has no
        # ETag-named blob to check against later.
        if _verify(file, pointer, meta.etag):
            result.verified.append(file.label)
    for file in missing:
        if not file.required:
            before = _from_cache(file, settings)
            try:
                pointer = _download(file, settings)
            except MissingFileError:
                continue
            if before != pointer:
                result.downloaded.append(file.label)


def repo_model_name(repo: str, subfolder: str | None = None) -> str:
    """The model directory name of a repo pulled by id (one per repo and subfolder)."""
    parts = [repo, *([subfolder.strip("/")] if subfolder and subfolder.strip("/") else [])]
    return "--".join(part.replace("/", "--") for part in parts)


def _repo_pull_argument(repo: str, subfolder: str | None = None) -> str:
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
        return _repo_pull_argument(entry.onnx.repo, entry.name[len(base) + 2 :].replace("--", "/"))
    return entry.name


def _list_repo(repo: str, revision: str, settings: HubSettings) -> list[str]:
    """Paths of every file of a repo at a revision (one API call per page)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=settings.endpoint, token=settings.token)
    listing = HubFile(RepoRef(repo, revision), "(file listing)", "", True, repo)
    try:
        tree = api.list_repo_tree(repo, revision=revision, recursive=True)
        return [item.path for item in tree if isinstance(item, RepoFile)]
    except Exception as exc:
        mapped = _map_error(exc, listing, settings)
        if mapped is None:
            raise
        raise mapped from exc


def repo_entry(
    repo: str,
    *,
    revision: str = "main",
    subfolder: str | None = None,
    quantized: bool = False,
    source_prefix: str = "",
    settings: HubSettings | None = None,
) -> CatalogEntry:
    """An entry for a repo the catalog does not know, from its file listing (see
    `engine.hub.layout` for the layouts understood). Needs the network."""
    settings = settings or HubSettings.from_env()
    name = repo_model_name(repo, subfolder)
    if settings.offline:
        raise OfflineError(
            f"{repo} is not in the catalog and HF_HUB_OFFLINE=1 forbids listing its files; "
            + settings.offline_help(_repo_pull_argument(repo, subfolder))
        )
    _check_reachable(settings, _repo_pull_argument(repo, subfolder))
    layout = discover(repo, _list_repo(repo, revision, settings), subfolder)
    variant = variant_name(quantized)
    if variant not in layout.variants:
        where = layout.onnx_folder or "its top level"
        raise LayoutError(
            f"{repo} has no {variant} files in {where} (it has: {', '.join(layout.variants)}; "
            "some repos keep int8 files under the plain names: then pull without --quantized)"
        )
    return CatalogEntry(
        name=name,
        source_lang="",  # the tokenizer's own tokenizer_config.json says (see ModelConfig)
        target_lang="",
        onnx=RepoRef(repo, revision, layout.onnx_folder),
        tokenizer=RepoRef(repo, revision, layout.tokenizer_folder),
        source_prefix=source_prefix,
        notes=f"pulled by repo id ({layout.decoder} decoder)",
        decoder=layout.decoder,
    )


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

    An existing directory is returned as is. Otherwise `spec` is a catalog name (`en-zh`)
    or one of its repo ids, resolved through the cache, downloading what is missing unless
    `download` is False or HF_HUB_OFFLINE is set.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    catalog = catalog or load_catalog()
    entry = catalog.find(spec)
    settings = settings or HubSettings.from_env()
    if entry is None and _is_repo_id(spec) and not path.exists():
        # A repo the catalog does not know: its directory if an earlier pull made it,
        # otherwise list the repo and pull it.
        model_dir = settings.models_root / repo_model_name(spec)
        if is_complete(model_dir, quantized):
            return model_dir
        if download:
            entry = repo_entry(spec, quantized=quantized, settings=settings)
    if entry is None:
        if _looks_like_path(spec) or path.exists():
            raise ModelLoadError(f"{spec}: not a model directory")
        raise UnknownModelError(spec, catalog.names())
    model_dir = model_dir_for(entry, settings)
    if is_complete(model_dir, quantized):
        return model_dir
    result = pull(entry, quantized=quantized, settings=settings, download=download, log=log)
    if result.downloaded:
        log(f"{entry.name}: model directory {result.model_dir}")
    return result.model_dir


@dataclass(frozen=True)
class CacheStatus:
    """What the cache holds of one catalog entry, for `models list`."""

    entry: CatalogEntry
    model_dir: Path | None
    variants: dict[str, int]  # complete variant -> bytes (tokenizer files included)


def cache_status(entry: CatalogEntry, settings: HubSettings) -> CacheStatus:
    """Sizes of the complete variants in the hub cache (no network)."""
    found = _all_cached(entry, settings)
    shared = sum(found[f.local].stat().st_size for f in model_files(entry, []) if f.local in found)
    variants = {}
    for variant in VARIANT_SUFFIX:
        locals_ = [f"{ONNX_FOLDER}/{name}" for name in onnx_files(variant, entry.decoder)]
        required_tok = all(name in found for name in TOKENIZER_FILES)
        if required_tok and all(name in found for name in locals_):
            variants[variant] = shared + sum(found[name].stat().st_size for name in locals_)
    model_dir = model_dir_for(entry, settings)
    return CacheStatus(entry, model_dir if model_dir.is_dir() else None, variants)
