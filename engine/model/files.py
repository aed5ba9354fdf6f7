"""Which ONNX files a load runs, chosen once (`choose_files`), and the decoder graphs the
passes take from them (`DecoderGraphs`: the split pair, or the merged file's branches cut
out once per load)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from engine.errors import ModelLoadError
from engine.model.names import (
    DECODER,
    DECODER_MERGED,
    DECODER_WITH_PAST,
    ENCODER,
    onnx_dir,
    onnx_file,
)
from engine.model.passes.merged_split import split_merged
from engine.model.passes.per_token import per_token_graph
from engine.model.sessions import RuntimeOptions, open_session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFiles:
    """The ONNX files one load runs, chosen once from what the directory holds.

    `decoder`: the merged file (`merged`), else the split pair's no-past file or a decoder
    alone; `with_past`: the split pair's with-past file, when there is one.
    """

    model_dir: Path
    encoder: Path
    decoder: Path
    with_past: Path | None
    merged: bool


def choose_files(model_dir: Path, options: RuntimeOptions) -> ModelFiles:
    """The files in `model_dir` (or its `onnx/` folder) that `options` ask for: int8, fp16
    or fp32, and the merged file unless `prefer_split` and the split pair is there."""
    folder = onnx_dir(model_dir)

    def path(stem: str) -> Path:
        return folder / onnx_file(stem, options.quantized, options.fp16)

    encoder = path(ENCODER)
    if not encoder.is_file():
        hint = " (make the fp16 files with `nmt-incremental models fp16`)" if options.fp16 else ""
        raise ModelLoadError(f"{model_dir}: missing {encoder.name}{hint}")
    merged, single, with_past = path(DECODER_MERGED), path(DECODER), path(DECODER_WITH_PAST)
    pair = single.is_file() and with_past.is_file()
    if merged.is_file() and not (options.prefer_split and pair):
        return ModelFiles(model_dir, encoder, merged, None, merged=True)
    if single.is_file():
        return ModelFiles(model_dir, encoder, single, with_past if pair else None, merged=False)
    raise ModelLoadError(
        f"{model_dir}: missing decoder: expected {merged.name}, or {single.name} "
        f"(with {with_past.name}) in {folder}"
    )


class DecoderGraphs:
    """The decoder's no-past and with-past graphs as the passes take them: the split pair's
    files, or the merged file's two branches, cut out on first use and kept for the rest
    of the load (so the merged file is split once, whoever asks)."""

    def __init__(self, files: ModelFiles) -> None:
        self.files = files
        self._branches: tuple[bytes, bytes] | None = None
        self._split = False

    @property
    def sources(self) -> tuple[str, ...]:
        """The files the graphs come from."""
        files = self.files
        if files.merged or files.with_past is None:
            return (files.decoder.name,)
        return (files.decoder.name, files.with_past.name)

    @property
    def originals(self) -> tuple[Path, Path]:
        """What each graph is compared with: its file, or the merged file both came from."""
        return (self.files.decoder, self.files.with_past or self.files.decoder)

    def branches(self) -> tuple[bytes, bytes] | None:
        """The merged file's (no-past, with-past) branches, or None when it cannot be split."""
        if not self._split:
            self._split = True
            self._branches = split_merged(self.files.decoder)
        return self._branches

    def pair(self) -> tuple[Path | bytes, Path | bytes] | None:
        """(no-past, with-past) graphs, or None (logged) when the model has no such pair."""
        files = self.files
        if files.merged:
            branches = self.branches()
            if branches is None:
                log.warning("%s: cannot be split: no batched-decoder rewrite", files.decoder.name)
            return branches
        if files.with_past is None:
            log.warning("%s: no decoder with past: no batched-decoder rewrite", files.model_dir)
            return None
        return files.decoder, files.with_past


def decoder_session(
    source: Path | bytes, options: RuntimeOptions, name: str
) -> ort.InferenceSession:
    """A decoder session: its int8 activations quantized per token where
    `options.per_token` says so and the graph allows it, else the graph as it is."""
    if options.per_token:
        rewritten = per_token_graph(source, name)
        if rewritten is not None:
            return open_session(rewritten, options, per_token=True)
    return open_session(str(source) if isinstance(source, Path) else source, options)


def open_file(
    path: Path, model_dir: Path, options: RuntimeOptions, *, decoder: bool = True
) -> ort.InferenceSession:
    """A session of `path`: a decoder's int8 activations per token (`decoder_session`), the
    encoder's as in the file (`MarianOnnx.encode` runs its rows apart instead). A missing
    or unreadable file is a `ModelLoadError` that names it."""
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: missing {path.name}")
    try:
        if decoder:
            return decoder_session(path, options, f"{model_dir}: {path.name}")
        return open_session(str(path), options)
    except Exception as exc:  # onnxruntime raises its own exception types for bad files
        raise ModelLoadError(f"{model_dir}: cannot load {path.name}: {exc}") from exc
