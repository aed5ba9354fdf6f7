"""Getting real models: the catalog of hub repos, downloads into the Hugging Face cache,
and `--model NAME` resolution (`resolve_model`).

`huggingface_hub` is imported only when the cache or the network is actually used, so that
resolving a plain model directory costs nothing.
"""

from engine.hub.cache import cache_status
from engine.hub.catalog import Catalog, CatalogEntry, RepoRef, load_catalog
from engine.hub.download import PullResult, pull, resolve_model
from engine.hub.errors import (
    CatalogError,
    ChecksumError,
    DiskFullError,
    HubError,
    MissingFileError,
    NetworkError,
    OfflineError,
    RepoAccessError,
    UnknownModelError,
)
from engine.hub.settings import HubSettings

__all__ = [
    "Catalog",
    "CatalogEntry",
    "CatalogError",
    "ChecksumError",
    "DiskFullError",
    "HubError",
    "HubSettings",
    "MissingFileError",
    "NetworkError",
    "OfflineError",
    "PullResult",
    "RepoAccessError",
    "RepoRef",
    "UnknownModelError",
    "cache_status",
    "load_catalog",
    "pull",
    "resolve_model",
]
