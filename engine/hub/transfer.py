"""The hub over the network, one file at a time: reachability, a file's metadata (HEAD),
its download, and `huggingface_hub`'s errors turned into ones that say what to do.

`huggingface_hub` is imported only here and only when called, so that resolving a
plain model directory costs nothing.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.hub.errors import (
    DiskFullError,
    HubError,
    MissingFileError,
    NetworkError,
    OfflineError,
    RepoAccessError,
)
from engine.hub.files import HubFile
from engine.hub.settings import HubSettings


def check_reachable(settings: HubSettings, name: str, timeout: float = 10.0) -> None:
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
            f"cannot reach {settings.endpoint} ({exc.strerror or exc})"
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
            f"imported) but {file.label} is not cached{settings.offline_help(file.model)}"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        return NetworkError(
            f"cannot download {file.label} from {endpoint} and it is not cached"
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


@contextlib.contextmanager
def mapped_errors(file: HubFile, settings: HubSettings) -> Iterator[None]:
    """Raise what `huggingface_hub` raises about `file` as the `HubError` that says what to
    do; anything it does not know passes as it is."""
    try:
        yield
    except Exception as exc:
        mapped = _map_error(exc, file, settings)
        if mapped is None:
            raise
        raise mapped from exc


@dataclass(frozen=True)
class Remote:
    """What a HEAD of one file says: the hub's ETag, the commit and the size."""

    etag: str
    commit: str
    size: int


def metadata(file: HubFile, settings: HubSettings) -> Remote:
    """HEAD one file: its ETag, commit and size."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(
        file.ref.repo, file.path, revision=file.ref.revision, endpoint=settings.endpoint
    )
    with mapped_errors(file, settings):
        meta = get_hf_file_metadata(url, token=settings.token)
    if meta.etag is None or meta.commit_hash is None or meta.size is None:
        raise HubError(
            f"{settings.endpoint} does not answer like a Hugging Face hub for {file.label} "
            "(missing X-Repo-Commit, ETag or size)"
        )
    return Remote(meta.etag, meta.commit_hash, meta.size)


def download_file(file: HubFile, settings: HubSettings) -> Path:
    from huggingface_hub import hf_hub_download

    with mapped_errors(file, settings):
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
