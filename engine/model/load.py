"""Loading a model, top to bottom: choose its files once, apply the passes, check what they
made, open the sessions.

    choose_files     which encoder and decoder files this load runs (`ModelFiles`)
    open_encoder     its session, its inputs checked
    open_decoder     the decoder's sessions and native layout, from their signatures; a
                     merged file's branches cut apart (`passes.merged_split`) and checked
    load_masked      the masks rewrite of both decoder graphs (`passes.masks`), int8 per
                     token (`passes.per_token`), checked against the sessions above, and
                     the output projection cut apart (`passes.head`)
    load             all of it, in that order (`MarianOnnx` runs the result)

The merged file is split at most once per load (`DecoderGraphs`): the split pair and the
masks rewrite take the same branches.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engine.errors import ModelLoadError
from engine.model.checks import (
    KERNEL_INT8_TOLERANCE,
    REWRITE_TOLERANCE,
    SPLIT_TOLERANCE,
    Signature,
    causal_over_new_tokens,
    check_cut,
    check_encoder,
    check_merged_split,
    check_outputs,
    check_rewrite,
    probe_feed,
    signature,
)
from engine.model.config import ModelConfig
from engine.model.layouts import (
    LAYOUTS,
    CutGraph,
    DecoderLayout,
    LayoutDecoder,
    MaskedDecoder,
    MaskedLayout,
    NoCacheLayout,
)
from engine.model.names import (
    CAUSAL_KEY,
    DECODER,
    DECODER_MERGED,
    DECODER_WITH_PAST,
    ENCODER,
    ENCODER_HIDDEN_STATES,
    MASK_INPUT,
    POSITIONS_INPUT,
    onnx_dir,
    onnx_file,
)
from engine.model.passes.graph import load_model
from engine.model.passes.head import HeadSplit, split_output_projection
from engine.model.passes.inplace import rewrite_inplace
from engine.model.passes.masks import rewrite_decoder
from engine.model.passes.merged_split import split_merged
from engine.model.passes.per_token import per_token_graph
from engine.model.sessions import RuntimeOptions, open_session
from engine.model.slots import device_of, open_slot_graphs

log = logging.getLogger(__name__)

__all__ = [  # the loader's own names, and those of the passes and checks it applies
    "CAUSAL_KEY",
    "MASK_INPUT",
    "POSITIONS_INPUT",
    "REWRITE_TOLERANCE",
    "BatchedDecoder",
    "DecoderGraphs",
    "HeadSplit",
    "Loaded",
    "ModelFiles",
    "check_rewrite",
    "choose_files",
    "load",
    "load_batched_decoder",
    "probe_feed",
    "rewrite_decoder",
    "split_merged",
    "split_output_projection",
]


# -- files --------------------------------------------------------------------------------


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


def _decoder_session(
    source: Path | bytes, options: RuntimeOptions, name: str
) -> ort.InferenceSession:
    """A decoder session: its int8 activations quantized per token where
    `options.per_token` says so and the graph allows it, else the graph as it is."""
    if options.per_token:
        rewritten = per_token_graph(source, name)
        if rewritten is not None:
            return open_session(rewritten, options, per_token=True)
    return open_session(str(source) if isinstance(source, Path) else source, options)


def _open_file(
    path: Path, model_dir: Path, options: RuntimeOptions, *, decoder: bool = True
) -> ort.InferenceSession:
    """A session of `path`: a decoder's int8 activations per token (`_decoder_session`), the
    encoder's as in the file (`MarianOnnx.encode` runs its rows apart instead). A missing
    or unreadable file is a `ModelLoadError` that names it."""
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: missing {path.name}")
    try:
        if decoder:
            return _decoder_session(path, options, f"{model_dir}: {path.name}")
        return open_session(str(path), options)
    except Exception as exc:  # onnxruntime raises its own exception types for bad files
        raise ModelLoadError(f"{model_dir}: cannot load {path.name}: {exc}") from exc


# -- encoder and decoder -------------------------------------------------------------------


def open_encoder(files: ModelFiles, options: RuntimeOptions) -> ort.InferenceSession:
    session = _open_file(files.encoder, files.model_dir, options, decoder=False)
    check_encoder(session, f"{files.model_dir}: {files.encoder.name}")
    return session


@dataclass
class OpenDecoder:
    """The decoder sessions the files give (`with_past`: the same session as `no_past` for
    a merged or self-KV-only file, None without a cache), and their native layout."""

    layout: DecoderLayout
    no_past: ort.InferenceSession
    with_past: ort.InferenceSession | None
    split_at_load: bool = False  # the merged file's branches run as the split pair


_MERGED_FILE_LAYOUTS = {
    Signature.MERGED: DecoderLayout.MERGED,
    Signature.SELF_KV: DecoderLayout.SELF_KV_ONLY,
    Signature.NO_PAST: DecoderLayout.NO_CACHE,
}


def open_decoder(
    graphs: DecoderGraphs, config: ModelConfig, options: RuntimeOptions
) -> OpenDecoder:
    """The decoder's sessions, its layout read from their signatures (never from file names
    alone); a merged file runs as its split branches where `prefer_split` and the cache
    allow it and they give the merged file's logits."""
    files, layers = graphs.files, config.decoder_layers
    where = f"{files.model_dir}: {files.decoder.name}"
    no_past = _open_file(files.decoder, files.model_dir, options)
    kind = signature(no_past, layers, where)
    if files.merged:
        layout = _MERGED_FILE_LAYOUTS.get(kind)
        if layout is None:
            raise ModelLoadError(f"{where} has the signature of a {kind.value}")
        if layout is DecoderLayout.MERGED and options.prefer_split and options.use_cache:
            split = _split_at_load(graphs, no_past, config, options)
            if split is not None:
                return OpenDecoder(DecoderLayout.SPLIT, *split, split_at_load=True)
        with_past = None if layout is DecoderLayout.NO_CACHE else no_past
        return OpenDecoder(layout, no_past, with_past)
    if kind is Signature.SELF_KV:
        return OpenDecoder(DecoderLayout.SELF_KV_ONLY, no_past, no_past)
    if kind is Signature.NO_PAST and files.with_past is not None and options.use_cache:
        with_past = _open_file(files.with_past, files.model_dir, options)
        step_where = f"{files.model_dir}: {files.with_past.name}"
        step_kind = signature(with_past, layers, step_where)
        if step_kind is not Signature.WITH_PAST:
            raise ModelLoadError(f"{step_where} has the signature of a {step_kind.value}")
        return OpenDecoder(DecoderLayout.SPLIT, no_past, with_past)
    if kind is Signature.NO_PAST:
        return OpenDecoder(DecoderLayout.NO_CACHE, no_past, None)
    raise ModelLoadError(f"{where} has the signature of a {kind.value}")


def _split_at_load(
    graphs: DecoderGraphs,
    merged: ort.InferenceSession,
    config: ModelConfig,
    options: RuntimeOptions,
) -> tuple[ort.InferenceSession, ort.InferenceSession] | None:
    """The merged decoder's branches as the split pair (no `If` per step), if they can be
    cut out and give the merged session's logits on a probe; else None (logged)."""
    branches = graphs.branches()
    if branches is None:
        return None
    files = graphs.files
    where = f"{files.model_dir}: {files.decoder.name}"
    no_past = _decoder_session(branches[0], options, where)
    with_past = _decoder_session(branches[1], options, where)
    layers = config.decoder_layers
    if signature(no_past, layers, where) is not Signature.NO_PAST or (
        signature(with_past, layers, where) is not Signature.WITH_PAST
    ):
        return None
    worst = check_merged_split(merged, no_past, with_past)
    if worst > SPLIT_TOLERANCE:
        log.warning(
            "%s: its branches, run apart, differ from the merged decoder by %.3g "
            "(tolerance %g): keeping the merged file",
            files.decoder.name,
            worst,
            SPLIT_TOLERANCE,
        )
        return None
    return no_past, with_past


# -- the masks rewrite -------------------------------------------------------------------


@dataclass(frozen=True)
class BatchedDecoder:
    """The decoder graphs rewritten with masks and positions, serialised for
    `InferenceSession`: `no_past` (start token plus forced prefix, padded rows allowed) and
    `with_past` (steps), both taking `decoder_attention_mask` [B, past + cur] and
    `decoder_position_ids` [B, cur] besides the inputs of the files they came from.

    With int8 activations per token both are per token, and `one_token` is the with-past
    graph with the files' own quantization: the same values for a call of one token, and
    faster. None otherwise.
    """

    no_past: bytes
    with_past: bytes
    sources: tuple[str, ...]
    max_difference: float | None  # None: not checked (`load_batched_decoder(check=False)`)
    one_token: bytes | None = None


_PROBES = (("no past", 0, 3), ("with past", 4, 1))
"""(label, past_len, cur_len) of each graph's check: a forced prefix, then a cached step."""


def _masked_graphs(
    rewritten: list[bytes], sources: tuple[str, ...], worst: float | None, per_token: bool
) -> BatchedDecoder:
    """The rewritten pair, with its activations per token where asked and possible."""
    if per_token:
        no_past = per_token_graph(rewritten[0], f"{sources[0]} (no past)")
        with_past = per_token_graph(rewritten[1], f"{sources[0]} (with past)")
        if no_past is not None and with_past is not None:
            return BatchedDecoder(no_past, with_past, sources, worst, rewritten[1])
    return BatchedDecoder(rewritten[0], rewritten[1], sources, worst)  # fp32, or logged why


def _rewrite(graphs: DecoderGraphs) -> list[bytes] | None:
    """Both graphs with masks and positions, or None (logged why)."""
    pair = graphs.pair()
    if pair is None:
        return None
    out = []
    for part, (label, _, _) in zip(pair, _PROBES, strict=True):
        model = rewrite_decoder(load_model(part), f"{graphs.sources[0]} ({label})")
        if model is None:
            return None
        out.append(model.SerializeToString())
    return out


def load_batched_decoder(
    model_dir: Path,
    *,
    quantized: bool = False,
    check: bool = True,
    tolerance: float = REWRITE_TOLERANCE,
    per_token: bool = False,
) -> BatchedDecoder | None:
    """A model directory's no-past and with-past decoders rewritten and checked, or None
    (logged), outside a model load (tests, benchmarks).

    The files are those a load with default options takes (`choose_files`): the split pair
    when both files exist, else the merged file cut into its two branches. Each rewrite is
    compared with the file it came from on a multi-token no-past probe and a one-token
    cached step; a difference above `tolerance` rejects it. `check=False` skips that (it
    opens four sessions); `max_difference` is then None. `per_token`: the int8 graphs with
    activations quantized per token, as a model load opens them; the check covers the mask
    rewrite, on the files' quantization.
    """
    graphs = DecoderGraphs(choose_files(model_dir, RuntimeOptions(quantized=quantized)))
    rewritten = _rewrite(graphs)
    if rewritten is None:
        return None
    worst: float | None = None
    if check:
        worst = 0.0
        name = graphs.sources[0]
        for data, original, (label, past_len, cur_len) in zip(
            rewritten, graphs.originals, _PROBES, strict=True
        ):
            try:
                difference = check_rewrite(original, data, past_len=past_len, cur_len=cur_len)
            except Exception as exc:  # onnxruntime raises its own types for graphs it rejects
                log.warning("%s (%s): rewritten decoder does not run: %s", name, label, exc)
                return None
            if not difference <= tolerance:
                log.warning(
                    "%s (%s): rewritten decoder differs by %.3g (tolerance %g): not used",
                    name,
                    label,
                    difference,
                    tolerance,
                )
                return None
            worst = max(worst, difference)
    return _masked_graphs(rewritten, graphs.sources, worst, per_token)


def load_masked(
    graphs: DecoderGraphs,
    originals: tuple[ort.InferenceSession, ort.InferenceSession],
    config: ModelConfig,
    options: RuntimeOptions,
    calls: Counter[str],
) -> MaskedDecoder | None:
    """The batchable layout: both decoder graphs rewritten, checked against `originals`
    (the no-past and with-past sessions the model runs otherwise, per token where int8
    is) on a forced prefix and a cached step; None, logged once with the reason, when the
    rewrite or its check fails, and the model batches in lockstep."""
    model_dir = graphs.files.model_dir
    try:
        rewritten = _rewrite(graphs)
        if rewritten is None:
            return None  # logged why
        graph = _masked_graphs(rewritten, graphs.sources, None, options.per_token)
        per_token = graph.one_token is not None
        no_past = open_session(graph.no_past, options, per_token=per_token)
        with_past = open_session(graph.with_past, options, per_token=per_token)
        one = None if graph.one_token is None else open_session(graph.one_token, options)
        worst = max(
            check_rewrite(originals[0], no_past, past_len=0, cur_len=3),
            check_rewrite(originals[1], with_past, past_len=4, cur_len=1),
            # The files' quantization for one token: the same values as per token.
            0.0
            if one is None
            else check_rewrite(originals[1], one, past_len=4, cur_len=1, batch=1),
        )
    except Exception as exc:  # a graph the rewriter did not foresee: fall back
        log.warning("%s: decoder rewrite failed (%s): lockstep batching", model_dir, exc)
        return None
    if not worst <= REWRITE_TOLERANCE or MASK_INPUT not in {i.name for i in with_past.get_inputs()}:
        log.warning(
            "%s: rewritten decoder differs from the original by %.3g (tolerance %g): "
            "not used, lockstep batching",
            model_dir,
            worst,
            REWRITE_TOLERANCE,
        )
        return None
    lookahead = causal_over_new_tokens(no_past, with_past, config, options.quantized)
    # The step's projection on the lane's threads is shared by the prefill, and the one on
    # every core (for a lane alone) by the prefill and the one-token step, where they give
    # those graphs' own heads' values (`_cut` checks). Why: the projection is the largest
    # weight (33 MB in int8 at OPUS-MT's sizes); a copy per graph cost memory at load, and
    # a lane's prefill read one copy and its next step another, from memory rather than
    # the cache. The one-token step keeps its own on the lane's threads: the files' fused
    # kernel projects one token in 1.3 ms where the per-token graph takes 1.5.
    steps = _cut(model_dir, graph.with_past, with_past, config, options, per_token=per_token)
    # A position's logits depend on no other position's in fp32 and int8 per token, so
    # the prefill's projection may run on the positions a search reads only.
    prefills = (
        CutGraph(no_past, None)
        if options.quantized and not options.per_token
        else _cut(
            model_dir,
            graph.no_past,
            no_past,
            config,
            options,
            prefill=True,
            per_token=per_token,
            alone=steps.alone,
            head=steps.head,
        )
    )
    ones = (
        None
        if one is None or graph.one_token is None
        else _cut(model_dir, graph.one_token, one, config, options, alone=steps.alone, rows=1)
    )
    log.info(
        "%s: continuous batching (decoder rewritten with masks and positions; "
        "max logit difference to the original %.2g)%s%s%s",
        model_dir,
        worst,
        f"; output projection on {options.head_threads} threads" if steps.head else "",
        "" if lookahead else "; one token per row per step (no lookahead)",
        "; int8 activations quantized per token" if ones is not None else "",
    )
    masked = MaskedDecoder(prefills, steps, config.decoder_layers, worst, calls, lookahead, ones)
    graphs_bytes = (graph.no_past, graph.with_past, graph.one_token)
    wanted = options.kv_slots
    if wanted is None:
        wanted = device_of(options)[0] != "cpu"  # by default only where the scheduler uses them
    masked.slots = (
        None
        if not wanted
        else open_slot_graphs(graphs_bytes, masked, config, options, per_token, str(model_dir))
    )
    inplace = options.inplace_attention
    if inplace is None:
        inplace = device_of(options)[0] == "cpu"
    if inplace:
        _open_inplace(masked, graph, (with_past, one), config, options, per_token, model_dir)
    return masked


def _open_inplace(
    masked: MaskedDecoder,
    graph: BatchedDecoder,
    ordinary: tuple[ort.InferenceSession, ort.InferenceSession | None],
    config: ModelConfig,
    options: RuntimeOptions,
    per_token: bool,
    model_dir: Path,
) -> None:
    """`masked.inplace` (and `inplace_one`, for the one-token graph) where the step's
    self-attention can be rewritten in place (`passes.inplace`) and the rewrite gives the
    ordinary step's logits on a probe; left None otherwise, logged."""
    # The projection is not rewritten: each graph shares its ordinary twin's head. The
    # batched step is per token where int8 is; the one-token graph has the files' kernels.
    step = _inplace_twin(
        "step",
        graph.with_past,
        ordinary[0],
        masked.steps,
        rows=2,
        per_token=per_token,
        masked=masked,
        config=config,
        options=options,
        model_dir=model_dir,
    )
    if step is None:
        return
    masked.inplace = step
    one_token, one = graph.one_token, ordinary[1]
    if one_token is not None and one is not None and masked.one_token is not None:
        masked.inplace_one = _inplace_twin(
            "one-token step",
            one_token,
            one,
            masked.one_token,
            rows=1,
            per_token=False,
            masked=masked,
            config=config,
            options=options,
            model_dir=model_dir,
        )
    log.info("%s: steps with self-attention in place (passes.inplace)", model_dir)


def _inplace_twin(
    label: str,
    source: bytes,
    session: ort.InferenceSession,
    twin: CutGraph,
    *,
    rows: int,
    per_token: bool,
    masked: MaskedDecoder,
    config: ModelConfig,
    options: RuntimeOptions,
    model_dir: Path,
) -> CutGraph | None:
    """One graph's in-place rewrite, opened, checked against its ordinary `session` on a
    probe of `rows` rows and cut at its projection as its `twin` is; None, logged, where
    the rewrite does not apply, ONNX Runtime refuses it or it differs."""
    rewritten = rewrite_inplace(source, f"{model_dir} ({label})")
    if rewritten is None:
        return None
    quantized = options.quantized
    try:
        opened = open_session(rewritten, options, per_token=per_token)
        worst = check_rewrite(
            session, opened, past_len=4, cur_len=1, batch=rows, relative=quantized
        )
    except Exception as exc:  # a kernel or graph ONNX Runtime refuses: keep the ordinary
        log.warning("%s: %s with self-attention in place not used (%s)", model_dir, label, exc)
        return None
    if not worst <= (KERNEL_INT8_TOLERANCE if quantized else REWRITE_TOLERANCE):
        log.warning(
            "%s: %s with self-attention in place differs by %.3g: not used",
            model_dir,
            label,
            worst,
        )
        return None
    if ENCODER_HIDDEN_STATES in {i.name for i in opened.get_inputs()}:
        # The in-place batch keeps only the encoder mask and cross-attention keys and
        # values of its rows (`InPlaceBatch`); a step that reads the hidden states too
        # keeps the copied state.
        log.warning(
            "%s: %s with self-attention in place reads the encoder's hidden states: not used",
            model_dir,
            label,
        )
        return None
    return _cut(
        model_dir,
        rewritten,
        opened,
        config,
        options,
        per_token=per_token,
        alone=masked.steps.alone,
        rows=rows,
        label=f"in-place {label}",
        head=twin.head,
    )


def _cut(
    model_dir: Path,
    graph: bytes,
    session: ort.InferenceSession,
    config: ModelConfig,
    options: RuntimeOptions,
    *,
    prefill: bool = False,
    per_token: bool = False,
    alone: tuple[ort.InferenceSession, str] | None = None,
    rows: int = 2,
    label: str | None = None,
    head: tuple[ort.InferenceSession, str] | None = None,
) -> CutGraph:
    """A rewritten decoder graph whole (`session`), or as its body on the lane's threads
    and its output projection on `options.head_threads` (`passes.head`) when those are
    more; whole when the graph cannot be cut or the parts do not give the whole's outputs
    (one log line).

    Why: at one row a step is hundreds of tiny ops and one large matmul, the vocabulary
    projection. An intra-op thread pool wakes its workers for every op it splits, which
    costs more than the small ops gain, while the projection gains from more cores.
    `prefill`: the no-past graph, cut even where the threads are the same (the head then
    on the body's), because its logits are needed at a few of its positions only
    (`MaskedDecoder.prefill`). `per_token`: the graph is quantized per token
    (`open_session`).

    `rows`: the rows of the probe (1 for the one-token graph, which runs one row only:
    its quantization is per call). Never cut on a GPU. A lane alone may run the projection on
    `options.alone_head_threads` (all the cores)
    when those are more: `alone`, another graph's such head, is attached where it gives
    this graph's values; without one, this graph's own is opened (also a reason to cut).
    `head`: another graph's head on the same threads, taken instead of opening one where
    it reads the same hidden state (one copy of the projection's weights); the check
    below still decides, and where it refuses the shared head, this graph's own is
    opened and checked.
    """
    if device_of(options)[0] != "cpu":
        # Threads for the projection and positions it may skip are the CPU's concern; on
        # a GPU the whole graph's projection is one kernel among hundreds.
        return CutGraph(session, None)
    threads, body_threads = options.head_threads, options.intra_op_threads
    apart = bool(threads and body_threads and threads > body_threads)
    threads = threads if apart else body_threads
    everyone = options.alone_head_threads
    wide = bool(everyone and threads and everyone > threads)
    if not apart and not prefill and not wide:
        return CutGraph(session, None)
    what, past_len, cur_len = ("prefill", 0, 3) if prefill else ("step", 4, 1)
    what = label or what
    try:
        split = split_output_projection(graph, config.vocab_size)
        if split is None:
            log.info(
                "%s: output projection not cut from the %s (unexpected graph)", model_dir, what
            )
            return CutGraph(session, None)
        body = open_session(split.body, options, per_token=per_token)

        def own() -> ort.InferenceSession:
            return open_session(split.head, options, threads=threads or None, per_token=per_token)

        def check(projection: ort.InferenceSession) -> float:
            return check_cut(
                session,
                body,
                projection,
                split.hidden,
                past_len=past_len,
                cur_len=cur_len,
                batch=rows,
            )

        shared = head[0] if head is not None and head[1] == split.hidden else None
        projection = shared if shared is not None else own()
        worst = check(projection)
        if shared is not None and not worst <= REWRITE_TOLERANCE:  # the graph's own, then
            projection = own()
            worst = check(projection)
        if wide and alone is None:
            alone = (
                open_session(split.head, options, threads=everyone, per_token=per_token),
                split.hidden,
            )
        if wide and alone is not None:
            apart_worst = check_cut(
                session,
                body,
                alone[0],
                split.hidden,
                alone[1],
                past_len=past_len,
                cur_len=cur_len,
                batch=rows,
            )
            if not apart_worst <= REWRITE_TOLERANCE:
                log.info("%s: the %s keeps its projection on its lane's threads", model_dir, what)
                alone = None
    except Exception as exc:  # a graph the cut did not foresee: keep it whole
        log.warning("%s: output projection not cut from the %s (%s)", model_dir, what, exc)
        return CutGraph(session, None)
    if not worst <= REWRITE_TOLERANCE:
        log.warning(
            "%s: %s cut at the output projection differs by %.3g: kept whole",
            model_dir,
            what,
            worst,
        )
        return CutGraph(session, None)
    return CutGraph(body, (projection, split.hidden), alone if wide else None)


def _release_freed_memory() -> None:
    """Give freed heap pages back to the OS (glibc only; elsewhere a no-op). The rewrite
    parses and serialises whole decoder graphs in Python and the original sessions are
    dropped after the check (call it once nothing refers to them)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


# -- the whole load -----------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    """What a load gives `MarianOnnx`: the encoder session, the decoder's calls
    (`decoder`: one layout object) and, for continuous batching, the rewritten decoder
    (`masked`), with what was chosen on the way."""

    encoder: ort.InferenceSession
    decoder: LayoutDecoder
    masked: MaskedDecoder | None
    layout: DecoderLayout
    files: dict[str, Path]  # by role: encoder, no_past, with_past (the file that serves it)
    split_at_load: bool
    float_type: type[np.floating[Any]]


def load(
    model_dir: Path, config: ModelConfig, options: RuntimeOptions, calls: Counter[str]
) -> Loaded:
    """Files -> encoder -> decoder (split at load) -> layout -> masks rewrite."""
    files = choose_files(model_dir, options)
    graphs = DecoderGraphs(files)
    encoder = open_encoder(files, options)
    decoder = open_decoder(graphs, config, options)
    layout = decoder.layout if options.use_cache else DecoderLayout.NO_CACHE
    check_outputs(
        decoder.no_past,
        decoder.with_past,
        config.decoder_layers,
        self_kv=layout is not DecoderLayout.NO_CACHE,
        cross_kv=layout in (DecoderLayout.MERGED, DecoderLayout.SPLIT),
        where=str(model_dir),
    )
    by_role = {"encoder": files.encoder, "no_past": files.decoder}
    if decoder.with_past is not None:
        own_file = decoder.with_past is not decoder.no_past and not decoder.split_at_load
        by_role["with_past"] = files.with_past if own_file and files.with_past else files.decoder
    types = {i.name: i.type for i in decoder.no_past.get_inputs()}
    float_type = np.float16 if types.get(ENCODER_HIDDEN_STATES) == "tensor(float16)" else np.float32
    split_at_load = decoder.split_at_load
    masked = None
    if options.batchable and layout in (DecoderLayout.MERGED, DecoderLayout.SPLIT):
        assert decoder.with_past is not None
        originals = (decoder.no_past, decoder.with_past)
        masked = load_masked(graphs, originals, config, options, calls)
        del originals
    if masked is None:
        native = LAYOUTS[decoder.layout](
            decoder.no_past, decoder.with_past, config, float_type, calls
        )
        calls_by: LayoutDecoder = (
            native if layout is not DecoderLayout.NO_CACHE else NoCacheLayout(native)
        )
        return Loaded(encoder, calls_by, None, layout, by_role, split_at_load, float_type)
    # Checked equal to the originals: every call goes through the rewrite from here on, and
    # the original sessions and graphs (a second copy of the decoder's weights) are let go.
    del decoder, graphs
    _release_freed_memory()
    masked_layout = MaskedLayout(masked, config, float_type, calls)
    return Loaded(encoder, masked_layout, masked, layout, by_role, split_at_load, float_type)
