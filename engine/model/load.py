"""Loading a model, top to bottom: choose its files once, apply the passes, check what they
made, open the sessions.

    choose_files     which encoder and decoder files this load runs (`ModelFiles`)
    open_encoder     its session, its inputs checked, its shape computations folded
                     (`passes.shapes`) and its attention fused (`passes.attention`,
                     `fused`), each checked
    open_decoder     the decoder's sessions and native layout, from their signatures; a
                     merged file's branches cut apart (`passes.merged_split`) and checked
    load_masked      the masks rewrite of both decoder graphs (`passes.masks`), their shape
                     computations folded (`passes.shapes`, the encoder's too), int8 per
                     token (`passes.per_token`), checked against the sessions above, the
                     prefill's attention fused (`fused`) and the output projection cut
                     apart (`cut`)
    open_backend     the KV backend `backend.select_backend` chooses, with its graphs
                     (`inplace`, `slots`), chosen again where they are refused
    load             all of it, in that order (`MarianOnnx` runs the result)

The merged file is split at most once per load (`DecoderGraphs`): the split pair and the
masks rewrite take the same branches.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engine.errors import ModelLoadError
from engine.model.backend import Backend, Built, Selection, select_backend
from engine.model.checks import (
    REWRITE_TOLERANCE,
    SPLIT_TOLERANCE,
    Signature,
    causal_over_new_tokens,
    check_encoder,
    check_encoder_rewrite,
    check_merged_split,
    check_outputs,
    check_rewrite,
    probe_feed,
    signature,
)
from engine.model.config import ModelConfig
from engine.model.cut import cut_graph
from engine.model.files import (
    DecoderGraphs,
    ModelFiles,
    choose_files,
    decoder_session,
    open_file,
)
from engine.model.fused import open_checked, open_fused
from engine.model.kv.inplace.steps import InPlaceSteps, open_inplace
from engine.model.kv.slots.pool import SlotGraphs, open_slot_graphs
from engine.model.layouts import LAYOUTS, DecoderLayout, LayoutDecoder, NoCacheLayout
from engine.model.logits import CutGraph
from engine.model.masked import MaskedDecoder, MaskedLayout, MaskedSources
from engine.model.names import CAUSAL_KEY, ENCODER_HIDDEN_STATES, MASK_INPUT, POSITIONS_INPUT
from engine.model.passes.graph import load_model
from engine.model.passes.head import HeadSplit, split_output_projection
from engine.model.passes.masks import rewrite_decoder
from engine.model.passes.merged_split import split_merged
from engine.model.passes.per_token import per_token_graph
from engine.model.passes.shapes import fold_shapes
from engine.model.sessions import RuntimeOptions, device_of, open_session

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


# -- encoder and decoder -------------------------------------------------------------------


def open_encoder(files: ModelFiles, options: RuntimeOptions) -> ort.InferenceSession:
    """The encoder's session: its shape computations folded (`passes.shapes`) where
    `options.folds`, then its attention fused (`passes.attention`) where `options.fuses`,
    each kept where it gives the file's outputs on a probe; else the file as it is."""
    where = f"{files.model_dir}: {files.encoder.name}"
    session = open_file(files.encoder, files.model_dir, options, decoder=False)
    check_encoder(session, where)
    folded: bytes | None = None
    if options.folds:
        try:
            graph = fold_shapes(load_model(files.encoder), where, in_place=True)
            folded = None if graph is None else graph.SerializeToString()  # None: logged why
            del graph
        except Exception as exc:  # a graph the pass did not foresee
            log.warning("%s: encoder with its shapes folded not used (%s)", where, exc)
    fused = open_fused(
        files.encoder if folded is None else folded,
        where,
        options,
        lambda rewritten: check_encoder_rewrite(session, rewritten),
        REWRITE_TOLERANCE,
    )
    if fused is not None:
        return fused[1]
    if folded is None:
        return session
    rewritten = open_checked(
        folded,
        where,
        "encoder with its shapes folded",
        options,
        lambda rewritten: check_encoder_rewrite(session, rewritten),
        REWRITE_TOLERANCE,
    )
    return session if rewritten is None else rewritten


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
    no_past = open_file(files.decoder, files.model_dir, options)
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
        with_past = open_file(files.with_past, files.model_dir, options)
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
    no_past = decoder_session(branches[0], options, where)
    with_past = decoder_session(branches[1], options, where)
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


def masked_graphs(
    rewritten: list[bytes],
    sources: tuple[str, ...],
    worst: float | None,
    per_token: bool,
    fold: bool = False,
) -> BatchedDecoder:
    """The rewritten pair, with its activations per token where asked and possible (and
    with `fold`, the shapes that adds folded: `passes.shapes`)."""
    if per_token:
        pair = []
        for data, (label, _, _) in zip(rewritten, _PROBES, strict=True):
            name = f"{sources[0]} ({label}, per token)"
            graph = per_token_graph(data, name)
            folded = None if graph is None or not fold else fold_shapes(graph, name)
            pair.append(graph if folded is None else folded.SerializeToString())
        if pair[0] is not None and pair[1] is not None:
            return BatchedDecoder(pair[0], pair[1], sources, worst, rewritten[1])
    return BatchedDecoder(rewritten[0], rewritten[1], sources, worst)  # fp32, or logged why


def rewrite_pair(graphs: DecoderGraphs, fold: bool = True) -> list[bytes] | None:
    """Both graphs with masks and positions, or None (logged why); with `fold`, their
    shape computations folded (`passes.shapes`) where they can be, which the masks
    rewrite's check covers."""
    pair = graphs.pair()
    if pair is None:
        return None
    out = []
    for part, (label, _, _) in zip(pair, _PROBES, strict=True):
        name = f"{graphs.sources[0]} ({label})"
        model = rewrite_decoder(load_model(part), name)
        if model is None:
            return None
        if fold:
            model = fold_shapes(model, name, in_place=True) or model
        out.append(model.SerializeToString())
    return out


def load_batched_decoder(
    model_dir: Path,
    *,
    quantized: bool = False,
    check: bool = True,
    tolerance: float = REWRITE_TOLERANCE,
    per_token: bool = False,
    fold: bool = True,
) -> BatchedDecoder | None:
    """A model directory's no-past and with-past decoders rewritten and checked, or None
    (logged), outside a model load (tests, benchmarks).

    The files are those a load with default options takes (`choose_files`): the split pair
    when both files exist, else the merged file cut into its two branches. Each rewrite is
    compared with the file it came from on a multi-token no-past probe and a one-token
    cached step; a difference above `tolerance` rejects it. `check=False` skips that (it
    opens four sessions); `max_difference` is then None. `per_token`: the int8 graphs with
    activations quantized per token, as a model load opens them; the check covers the mask
    rewrite, on the files' quantization. `fold`: shape computations folded, as a load
    does by default (`RuntimeOptions.fold_shapes`).
    """
    graphs = DecoderGraphs(choose_files(model_dir, RuntimeOptions(quantized=quantized)))
    rewritten = rewrite_pair(graphs, fold)
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
    return masked_graphs(rewritten, graphs.sources, worst, per_token, fold)


def load_masked(
    graphs: DecoderGraphs,
    originals: tuple[ort.InferenceSession, ort.InferenceSession],
    config: ModelConfig,
    options: RuntimeOptions,
    calls: Counter[str],
) -> tuple[MaskedDecoder, MaskedSources] | None:
    """The batchable layout: both decoder graphs rewritten, checked against `originals`
    (the no-past and with-past sessions the model runs otherwise, per token where int8
    is) on a forced prefix and a cached step, with what it was opened from (for the KV
    backend's graphs); None, logged once with the reason, when the rewrite or its check
    fails, and the model batches in lockstep."""
    model_dir = graphs.files.model_dir
    try:
        rewritten = rewrite_pair(graphs, options.folds)
        if rewritten is None:
            return None  # logged why
        graph = masked_graphs(rewritten, graphs.sources, None, options.per_token, options.folds)
        per_token = graph.one_token is not None
        # The prefill with its attention fused where that gives its logits. The steps'
        # graphs stay as they are: the KV backends rewrite their self-attention, and
        # their cross-attention (keys in heads) ran no faster fused (docs/performance.md).
        fused = open_fused(
            graph.no_past,
            f"{model_dir} (prefill)",
            options,
            lambda session: check_rewrite(originals[0], session, past_len=0, cur_len=3),
            REWRITE_TOLERANCE,
            per_token=per_token,
        )
        prefill_graph, no_past = (
            fused
            if fused is not None
            else (graph.no_past, open_session(graph.no_past, options, per_token=per_token))
        )
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
    # those graphs' own heads' values (`cut_graph` checks). Why: the projection is the largest
    # weight; a copy per graph cost memory at load, and a lane's prefill read one copy and
    # its next step another, from memory rather than the cache. The one-token step keeps
    # its own on the lane's threads: the files' fused kernel projects one token faster
    # than the per-token graph (docs/performance.md).
    steps = cut_graph(model_dir, graph.with_past, with_past, config, options, per_token=per_token)
    # A position's logits depend on no other position's in fp32 and int8 per token, so
    # the prefill's projection may run on the positions a search reads only.
    prefills = (
        CutGraph(no_past, None)
        if options.quantized and not options.per_token
        else cut_graph(
            model_dir,
            prefill_graph,
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
        else cut_graph(model_dir, graph.one_token, one, config, options, alone=steps.alone, rows=1)
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
    sources = MaskedSources(
        graph.no_past, graph.with_past, graph.one_token, with_past, one, per_token
    )
    return masked, sources


def open_backend(
    masked: MaskedDecoder | None,
    sources: MaskedSources | None,
    config: ModelConfig,
    options: RuntimeOptions,
    model_dir: Path,
) -> tuple[Selection, KvGraphs]:
    """The KV backend `select_backend` chooses, its graphs built from `sources` (the
    masked decoder's) and chosen again where they were refused; logged once, with why."""
    device = device_of(options)
    built = Built(masked is not None)
    graphs: KvGraphs = None
    while True:
        chosen = select_backend(device, options, built)
        own_graphs = chosen.backend in (Backend.SLOTS, Backend.INPLACE)
        if masked is None or sources is None or not own_graphs:
            break
        if chosen.backend is Backend.SLOTS and built.slots is None:
            graphs = open_slot_graphs(
                (sources.no_past, sources.with_past, sources.one_token),
                masked,
                config,
                options,
                sources.per_token,
                str(model_dir),
            )
            built = replace(built, slots=graphs is not None)
        elif chosen.backend is Backend.INPLACE and built.inplace is None:
            graphs = open_inplace(masked, sources, config, options, model_dir)
            built = replace(built, inplace=graphs is not None)
        else:
            break
    log.info("%s: KV backend %s: %s", model_dir, chosen.backend.value, chosen.reason)
    return chosen, graphs


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


KvGraphs = SlotGraphs | InPlaceSteps | None
"""The chosen KV backend's own graphs: the KV slots' (`engine.model.kv.slots.pool`), the in-place
steps (`engine.model.kv.inplace.steps`), or none (lockstep, and the state copied per step)."""


@dataclass(frozen=True)
class Loaded:
    """What a load gives `MarianOnnx`: the encoder session, the decoder's calls
    (`decoder`: one layout object) and, for continuous batching, the rewritten decoder
    (`masked`), the KV backend chosen (`backend`) with its graphs (`kv`), and what was
    chosen on the way."""

    encoder: ort.InferenceSession
    decoder: LayoutDecoder
    masked: MaskedDecoder | None
    layout: DecoderLayout
    files: dict[str, Path]  # by role: encoder, no_past, with_past (the file that serves it)
    split_at_load: bool
    float_type: type[np.floating[Any]]
    backend: Selection
    kv: KvGraphs


def load(
    model_dir: Path, config: ModelConfig, options: RuntimeOptions, calls: Counter[str]
) -> Loaded:
    """Files -> encoder -> decoder (split at load) -> layout -> masks rewrite -> the KV
    backend (`open_backend`)."""
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
    opened = None
    if options.batchable and layout in (DecoderLayout.MERGED, DecoderLayout.SPLIT):
        assert decoder.with_past is not None
        originals = (decoder.no_past, decoder.with_past)
        opened = load_masked(graphs, originals, config, options, calls)
        del originals
    if opened is None:
        backend, _ = open_backend(None, None, config, options, model_dir)
        native = LAYOUTS[decoder.layout](
            decoder.no_past, decoder.with_past, config, float_type, calls
        )
        calls_by: LayoutDecoder = (
            native if layout is not DecoderLayout.NO_CACHE else NoCacheLayout(native)
        )
        return Loaded(
            encoder, calls_by, None, layout, by_role, split_at_load, float_type, backend, None
        )
    # Checked equal to the originals: every call goes through the rewrite from here on, and
    # the original sessions and graphs (a second copy of the decoder's weights) are let go,
    # and what the backend's graphs were built from after them.
    masked, sources = opened
    del decoder, graphs, opened
    _release_freed_memory()
    backend, kv = open_backend(masked, sources, config, options, model_dir)
    del sources
    _release_freed_memory()
    masked_layout = MaskedLayout(masked, config, float_type, calls)
    return Loaded(
        encoder, masked_layout, masked, layout, by_role, split_at_load, float_type, backend, kv
    )
