"""Attention fused at load (`passes.attention`), its projections of one input packed
(`passes.pack`): a graph's fused form, opened and checked against what it came from, or
None so that the caller runs the graph unfused.

Why apart from the passes and the checks: the encoder and the prefill each fuse their own
graph, with their own probe; a fused graph that ONNX Runtime refuses or that differs costs
its graph the fusion only, never the batchable layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import onnx
import onnxruntime as ort

from engine.model.passes.attention import fuse_attention
from engine.model.passes.pack import pack_projections
from engine.model.sessions import RuntimeOptions, open_session

log = logging.getLogger(__name__)


def open_fused(
    source: Path | bytes | onnx.ModelProto,
    name: str,
    options: RuntimeOptions,
    check: Callable[[ort.InferenceSession], float],
    tolerance: float,
    *,
    per_token: bool = False,
) -> tuple[bytes, ort.InferenceSession] | None:
    """`source` with its attention fused, serialised, and its session, where
    `options.fuses`, the pass finds cores, ONNX Runtime opens it and `check(session)` (a
    largest difference to the unfused graph's outputs) is within `tolerance`; else None,
    logged under `name`."""
    if not options.fuses:
        return None
    try:
        model = fuse_attention(source, name)
        if model is None:
            return None  # logged why
        if options.packs:
            packed(model, name)
        data: bytes = model.SerializeToString()
        del model
    except Exception as exc:  # a graph the pass did not foresee: run it unfused
        log.warning("%s: attention fused not used (%s)", name, exc)
        return None
    session = open_checked(
        data, name, "attention fused", options, check, tolerance, per_token=per_token
    )
    return None if session is None else (data, session)


def packed(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """`model` with its projections of one input packed (`passes.pack`, in place); as it
    was where the pass fails on a graph it did not foresee (logged; the pass changes
    nothing before it has the whole packed graph). The caller's check against the graph it
    came from decides, as for every rewrite."""
    try:
        pack_projections(model, name)
    except Exception as exc:  # a graph the pass did not foresee: as it was
        log.warning("%s: projections not packed (%s)", name, exc)
    return model


def open_checked(
    graph: bytes,
    name: str,
    what: str,
    options: RuntimeOptions,
    check: Callable[[ort.InferenceSession], float],
    tolerance: float,
    *,
    per_token: bool = False,
) -> ort.InferenceSession | None:
    """A session of a rewritten `graph` (`what` it is) where ONNX Runtime opens it and
    `check(session)`, its largest difference to the graph it came from, is within
    `tolerance`; else None, logged under `name`, and the caller keeps the original."""
    try:
        session = open_session(graph, options, per_token=per_token)
        worst = check(session)
    except Exception as exc:  # a graph or kernel ONNX Runtime refuses
        log.warning("%s: %s not used (%s)", name, what, exc)
        return None
    if not worst <= tolerance:
        log.warning("%s: %s differs by %.3g (tolerance %g): not used", name, what, worst, tolerance)
        return None
    return session
