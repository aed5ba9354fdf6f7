"""Errors of getting models: each says what went wrong and what the user can do about it.

They derive from `EngineError` so that every command line entry point reports them as
`error: ...` lines instead of tracebacks.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import EngineError

OFFLINE_HELP = (
    "\n  without the hub: set HF_ENDPOINT to a mirror, or run"
    "\n  `nmt-incremental models pull {name}` where there is internet, then copy"
    "\n  its {what} to the same {places} here"
    "\n  and set HF_HUB_OFFLINE=1 (or point HF_HUB_CACHE at the copy; docs/models.md):"
    "\n  {paths}"
)
"""How to get a model without the hub: the lines under an error's first line (one line
of 420 characters was hard to read)."""


class HubError(EngineError):
    """Base class of the errors raised while resolving or downloading a model."""


class CatalogError(HubError):
    """`engine/hub/catalog.json` is missing or malformed."""


class UnknownModelError(HubError, LookupError):
    """A model name or repo id that is neither a directory nor in the catalog."""

    def __init__(self, spec: str, known: Sequence[str]) -> None:
        # a repo id the catalog does not know is found without a request once pulled
        pull_first = (
            f"; a hub repo is found once pulled: `nmt-incremental models pull {spec}`"
            if "/" in spec.strip("/")
            else ""
        )
        super().__init__(
            f"unknown model {spec!r}: not a model directory and not in the catalog; "
            f"known models: {', '.join(known) or '(none)'} "
            f"(a catalog name such as en-zh, one of its repo ids, or a model directory)"
            + pull_first
        )
        self.spec = spec
        self.known = tuple(known)


class OfflineError(HubError):
    """Downloads are needed but HF_HUB_OFFLINE forbids them."""


class NetworkError(HubError, ConnectionError):
    """The hub (or mirror) cannot be reached, or a transfer broke off."""


class RepoAccessError(HubError):
    """A repository or revision does not exist, or needs a token we do not have."""


class MissingFileError(HubError, FileNotFoundError):
    """A repository lacks a file the model needs."""

    def __init__(self, repo: str, path: str, revision: str, endpoint: str) -> None:
        super().__init__(
            f"repository {repo} (revision {revision}) on {endpoint} has no file {path!r}, "
            "which the model needs; check the repo id and revision in engine/hub/catalog.json"
        )
        self.repo = repo
        self.path = path


class ChecksumError(HubError):
    """A downloaded file does not hash to the ETag the hub announced."""

    def __init__(self, repo: str, path: str, expected: str, actual: str) -> None:
        super().__init__(
            f"checksum mismatch for {repo}/{path}: the hub's ETag is {expected} but the "
            f"downloaded file hashes to {actual}; the corrupt copy was deleted from the "
            "cache, run the same command again to download it afresh"
        )
        self.repo = repo
        self.path = path
        self.expected = expected
        self.actual = actual


class DiskFullError(HubError, OSError):
    """The cache's disk has no room for the download (ENOSPC, or too little free space)."""
