"""A repo the catalog does not know, pulled by its id: its file listing, read into a
catalog entry (see `engine.hub.layout` for the layouts understood). Needs the network.
"""

from __future__ import annotations

from engine.hub.catalog import CatalogEntry, RepoRef, variant_name
from engine.hub.errors import OfflineError
from engine.hub.files import HubFile, repo_model_name, repo_pull_argument
from engine.hub.layout import LayoutError, discover
from engine.hub.settings import HubSettings
from engine.hub.transfer import check_reachable, mapped_errors


def _list_repo(repo: str, revision: str, settings: HubSettings) -> list[str]:
    """Paths of every file of a repo at a revision (one API call per page)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=settings.endpoint, token=settings.token)
    listing = HubFile(RepoRef(repo, revision), "(file listing)", "", True, repo)
    with mapped_errors(listing, settings):
        tree = api.list_repo_tree(repo, revision=revision, recursive=True)
        return [item.path for item in tree if isinstance(item, RepoFile)]


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
            f"{repo} is not in the catalog and HF_HUB_OFFLINE=1 forbids listing its files"
            + settings.offline_help(repo_pull_argument(repo, subfolder))
        )
    check_reachable(settings, repo_pull_argument(repo, subfolder))
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
