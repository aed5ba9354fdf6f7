"""A rewritten decoder graph cut at its output projection (`cut_graph`), so that the
projection runs on more threads than the body, or on the positions a search reads only.

Why: at one row a step is hundreds of tiny ops and one large matmul, the vocabulary
projection; an intra-op thread pool wakes its workers for every op it splits, which costs
more than the small ops gain, while the projection gains from more cores
(docs/performance.md).
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnxruntime as ort

from engine.model.checks import REWRITE_TOLERANCE, check_cut
from engine.model.config import ModelConfig
from engine.model.logits import CutGraph
from engine.model.passes.head import split_output_projection
from engine.model.sessions import RuntimeOptions, device_of, open_session

log = logging.getLogger(__name__)

SMALL_PROJECTION = 1 << 17
"""Weights (`d_model` x vocabulary) of an output projection below which the graphs are
kept whole, whatever the threads: at such a size a position's projection costs less
than a call of its own (whose fixed cost grows several times on a lane that slept
between turns, as lanes under load do), and a second thread gains nothing (figures:
docs/performance.md, "The model's calls under load"). Read at each load, so that a test
may set it to 0 to cut the fixture's graphs."""


def cut_graph(
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
    if config.d_model * config.vocab_size < SMALL_PROJECTION:
        # Its threads and the positions it may skip cost less than a call of its own.
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
