"""Where a hub repo keeps a model's files, from its file listing alone (no I/O here).

The catalog describes the repos it knows. Repos people point `models pull REPO` at are laid
out in other ways, and each must either pull or fail saying what was found:

- the Optimum layout of Xenova / onnx-community: ONNX files under `onnx/`, tokenizer and
  config files at the top;
- everything at the top, no `onnx/` (e.g. Infomaniak-AI/onnx-opus-mt-en-de);
- one folder per language pair, each with its ONNX and tokenizer files, split decoders
  only, int8 files under the plain names (e.g. Zweiarm/opus-mt-onnx-int8): the folder must
  be chosen (`--subfolder`), the error lists them;
- a pull-request branch of a Helsinki-NLP repo adding an `onnx/` folder (`--revision
  refs/pr/N`): the first layout at another revision.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from engine.hub.errors import HubError
from engine.model.config import TOKENIZER_FILES
from engine.model.names import (
    DECODER,
    DECODER_MERGED,
    DECODER_STEMS,
    DECODER_WITH_PAST,
    ENCODER,
    ONNX_FOLDER,
    QUANTIZED_SUFFIX,
    VARIANT_SUFFIX,
    onnx_file,
)

__all__ = [
    "LayoutError",
    "RepoLayout",
    "discover",
    "onnx_files",
]


def onnx_files(variant: str, decoder: str = "merged") -> tuple[str, ...]:
    """The ONNX file names one variant ('fp32', 'int8') of one decoder layout needs."""
    quantized = VARIANT_SUFFIX[variant] == QUANTIZED_SUFFIX
    return tuple(onnx_file(stem, quantized) for stem in (ENCODER, *DECODER_STEMS[decoder]))


class LayoutError(HubError):
    """A repo's listing holds no model the engine can load, or more than one to choose from."""


@dataclass(frozen=True)
class RepoLayout:
    """Where one model's files are inside a repo (folders relative to the repo root)."""

    onnx_folder: str
    tokenizer_folder: str
    decoder: str  # a key of DECODER_STEMS
    variants: tuple[str, ...]  # of VARIANT_SUFFIX, the complete ones


def _folder(path: str) -> str:
    return posixpath.dirname(path.strip("/"))


def _describe(paths: list[str], limit: int = 12) -> str:
    shown = ", ".join(paths[:limit])
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return shown + more if paths else "no files"


def discover(repo: str, paths: Iterable[str], subfolder: str | None = None) -> RepoLayout:
    """The layout of `repo` from the paths of its files (as `list_repo_tree` gives them).

    Raises `LayoutError` naming what was found when no folder holds an encoder and a
    decoder, when several do and `subfolder` does not pick one, or when no tokenizer files
    go with them.
    """
    files = sorted({p.strip("/") for p in paths})
    present = set(files)
    candidates = sorted({_folder(p) for p in files if _is_encoder(p)})
    if subfolder is not None:
        wanted = subfolder.strip("/")
        candidates = [f for f in candidates if f in (wanted, posixpath.join(wanted, ONNX_FOLDER))]
        if not candidates:
            onnx = [p for p in files if p.endswith(".onnx")]
            raise LayoutError(
                f"{repo} has no {ENCODER}*.onnx in {wanted}/ or {wanted}/{ONNX_FOLDER}/; "
                f"its ONNX files: {_describe(onnx)}"
            )
    usable = [(f, _decoder_and_variants(f, present)) for f in candidates]
    usable = [(f, found) for f, found in usable if found is not None]
    if not usable:
        onnx = [p for p in files if p.endswith(".onnx")]
        raise LayoutError(
            f"{repo} holds no loadable ONNX model (an {onnx_file(ENCODER)} with "
            f"{onnx_file(DECODER_MERGED)}, or with {onnx_file(DECODER)} and "
            f"{onnx_file(DECODER_WITH_PAST)}, or their {QUANTIZED_SUFFIX} versions); "
            "its ONNX files: "
            f"{_describe(onnx)}; top level: {_describe([p for p in files if '/' not in p])}"
        )
    if len(usable) > 1:
        folders = [f"{f}/" if f else "(top level)" for f, _ in usable]
        # the example names a folder: no --subfolder value selects the top level alone
        example = next(f for f, _ in usable if f)
        raise LayoutError(
            f"{repo} holds {len(usable)} models, in {', '.join(folders)}: choose one with "
            f"--subfolder, e.g. `nmt-incremental models pull {repo} --subfolder {example}`"
        )
    folder, found = usable[0]
    assert found is not None
    decoder, variants = found
    return RepoLayout(folder, _tokenizer_folder(repo, folder, present), decoder, variants)


def _is_encoder(path: str) -> bool:
    name = posixpath.basename(path)
    return name in {onnx_file(ENCODER, quantized) for quantized in (False, True)}


def _decoder_and_variants(folder: str, present: set[str]) -> tuple[str, tuple[str, ...]] | None:
    """The preferred decoder layout of a folder and its complete variants, if any."""
    for decoder in DECODER_STEMS:
        variants = tuple(
            variant
            for variant in VARIANT_SUFFIX
            if all(posixpath.join(folder, n) in present for n in onnx_files(variant, decoder))
        )
        if variants:
            return decoder, variants
    return None


def _tokenizer_folder(repo: str, onnx_folder: str, present: set[str]) -> str:
    """The ONNX folder itself or the nearest folder above it that has the tokenizer files
    (Optimum puts them one level above `onnx/`)."""
    folder = onnx_folder
    while True:
        if all(posixpath.join(folder, name) in present for name in TOKENIZER_FILES):
            return folder
        if not folder:
            break
        folder = _folder(folder)
    where = onnx_folder or "the top level"
    found = sorted(p for p in present if posixpath.basename(p) in TOKENIZER_FILES)
    raise LayoutError(
        f"{repo} has ONNX files in {where} but no complete set of tokenizer files "
        f"({', '.join(TOKENIZER_FILES)}) there or above; found: {_describe(found)}"
    )
