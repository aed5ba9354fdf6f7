"""The KV-slot step as CUDA graphs replay it (`engine.model.kv.slots.graphed`): fixed shapes in
buckets, rows padding a bucket in a scratch slot, no control flow and only the greedy
choice out (`passes.slots.rewrite_step(..., graphed=True)`).

The CPU provider cannot capture, but it runs the same graph over the same buckets and
padding (`cuda_graphs=True`): what a GPU would replay is checked here, rows equal to
decoding alone in every batchable layout. The capture itself needs a GPU
(`examples/benchmarks/gpu_decode.py`, docs/gpu.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx
import pytest

import engine.model.kv.slots.pool
from engine import DecodeOptions, Translator
from engine.decoding.scheduler import SchedulerOptions
from engine.model.config import ModelConfig
from engine.model.kv.slots.graphed import MIN_WIDTH, row_bucket, width_bucket
from engine.model.kv.slots.pool import slot_bytes
from engine.model.kv.slots.rewrite import rewrite_step
from engine.model.names import LOGITS, NEXT_IDS, NEXT_SCORES
from tests.conftest import FIXTURE_MODEL, needs_fixture
from tests.test_kv_slots import drafted_rows_over_slots_equal_alone
from tests.test_scheduler import (
    SOURCES,
    alone,
    concurrent_equal_alone,
    layouts,
)

SLOTS = 16


@pytest.fixture(scope="module", params=layouts(), ids=[name for name, _ in layouts()])
def graphed(request: pytest.FixtureRequest) -> Translator:
    """Each layout over KV slots with its greedy steps through the graphed buckets."""
    needs_fixture()
    options = dict(request.param[1])
    scheduler = options.pop("scheduler", SchedulerOptions(lanes=1))
    assert isinstance(scheduler, SchedulerOptions)
    scheduler = dataclasses.replace(scheduler, kv_slots=SLOTS)
    return Translator.from_dir(
        FIXTURE_MODEL,
        scheduler=scheduler,
        cuda_graphs=True,
        **options,  # type: ignore[arg-type]
    )


def test_buckets_round_rows_and_widths_up() -> None:
    assert [row_bucket(n) for n in (1, 2, 3, 5, 64, 65, 1000)] == [1, 2, 4, 8, 64, 128, 1024]
    assert width_bucket(1, 512) == MIN_WIDTH
    assert width_bucket(MIN_WIDTH + 1, 512) == 2 * MIN_WIDTH
    assert width_bucket(300, 512) == 512
    assert width_bucket(300, 400) == 400  # never past the slots' capacity
    with pytest.raises(ValueError, match="wider than the slots' 400"):
        width_bucket(401, 400)


def test_the_graphed_step_has_no_control_flow_and_returns_only_the_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a CUDA graph can capture: no `If`, and no logits to bind per shape."""
    needs_fixture()
    made: list[bytes | None] = []

    def spy(*args: Any, **kwargs: Any) -> bytes | None:
        data = rewrite_step(*args, **kwargs)
        if kwargs.get("graphed"):
            made.append(data)
        return data

    monkeypatch.setattr(engine.model.kv.slots.pool, "rewrite_step", spy)
    scheduler = SchedulerOptions(lanes=1, kv_slots=4)
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=scheduler, cuda_graphs=True)
    assert tr.scheduler.kv is not None and tr.scheduler.kv.graphed is not None
    (data,) = made
    assert data is not None
    graph = onnx.load_from_string(data).graph
    ops = {node.op_type for node in graph.node}
    assert not ops & {"If", "Loop", "Scan"}, ops
    outputs = {o.name for o in graph.output}
    assert {NEXT_IDS, NEXT_SCORES} <= outputs and LOGITS not in outputs


def test_greedy_rows_over_graphed_buckets_equal_decoding_each_alone(graphed: Translator) -> None:
    """Rows of several lengths, joining and leaving, padded into row and width buckets:
    each equals decoding it alone, and the steps went through the buckets."""
    pool = graphed.scheduler.kv
    assert pool is not None and pool.graphed is not None
    concurrent_equal_alone(graphed, DecodeOptions())
    assert pool.graphed.graphs >= 2  # several row counts
    assert graphed.scheduler.kv_slots is not None
    assert graphed.scheduler.kv_slots["free"] == SLOTS


def test_beams_take_the_ordinary_step_beside_graphed_rows(graphed: Translator) -> None:
    """A beam needs the logits: its steps are the ordinary ones; answers as alone."""
    concurrent_equal_alone(graphed, DecodeOptions(beam_size=3))


def test_drafts_and_minimum_lengths_over_graphed_buckets(graphed: Translator) -> None:
    """Several new positions per row (drafts verified) and eos banned below a minimum
    length, through the branch-free ban of the graphed step."""
    pool = graphed.scheduler.kv
    assert pool is not None and pool.graphed is not None
    drafted_rows_over_slots_equal_alone(graphed)
    assert pool.graphed.graphs >= 1


def test_rows_padding_a_bucket_write_only_their_scratch_slot() -> None:
    """Three rows run as a bucket of four: the fourth writes into the scratch slot past
    the pool's own, and no slot a request does not own changes."""
    needs_fixture()
    tr = Translator.from_dir(
        FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1, kv_slots=6), cuda_graphs=True
    )
    pool = tr.scheduler.kv
    assert pool is not None and pool.graphed is not None
    assert pool.graphed.scratch == pool.slots == 6
    assert pool.bytes == 7 * slot_bytes(pool.shape, 4)  # the scratch slot counted
    per_slot = pool.shape.heads * pool.shape.capacity
    before = [array.copy() for array in pool._arrays]
    enc = tr.encode([tr.source_ids(SOURCES[0])])
    hyps = tr.decode(enc.select(np.zeros(3, dtype=np.int64)), DecodeOptions())
    expected = alone(tr, SOURCES[0], [], DecodeOptions())
    assert all(h.token_ids == expected.token_ids for h in hyps)
    changed_self = set()
    for old, new in zip(before, pool._arrays, strict=True):
        if len(new) != 7 * per_slot:
            continue  # a cross-attention buffer (source capacity)
        rows = np.flatnonzero((old != new).any(axis=1))
        changed_self |= set((rows // per_slot).tolist())
    assert 6 in changed_self  # the padding row wrote its scratch slot
    assert len(changed_self - {6}) == 3  # and the three rows their own, no other


def test_pools_of_one_session_never_share_a_graph_id() -> None:
    """A session keeps what it captured under an id for as long as it lives, over the
    buffers it captured: the load's check captures over a pool of its own, so the
    scheduler's pool must never reuse one of its ids (it would replay the check's graph
    over the check's freed buffers and leave its own outputs as they were)."""
    needs_fixture()
    tr = Translator.from_dir(
        FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1, kv_slots=4), cuda_graphs=True
    )
    graphs = tr.model.kv
    assert isinstance(graphs, engine.model.kv.slots.pool.SlotGraphs)
    pools = [graphs.pool(4), graphs.pool(4), tr.scheduler.kv]
    enc = tr.encode([tr.source_ids(SOURCES[0])])
    for pool in pools[:2]:  # a step of one row in each, from a prefill of its own
        assert pool is not None and pool.graphed is not None
        ids = np.array([[tr.config.decoder_start_token_id]], dtype=np.int64)
        ones = np.ones((1, 1), dtype=np.int64)
        slot = np.zeros(1, dtype=np.int64)
        pool.prefill(enc, ids, ones, slot, slot, slot, np.zeros(1, dtype=np.bool_))
        pool.step(ids, ones, np.ones((1, 2), dtype=np.int64), enc.attention_mask, slot)
    tr.translate([SOURCES[1]])
    used = [
        bucket.graph
        for pool in pools
        if pool and pool.graphed
        for bucket in pool.graphed._buckets.values()
    ]
    assert len(used) >= 3 and len(set(used)) == len(used), used


def test_a_graphed_step_that_fails_turns_graphs_off_and_the_step_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bucket whose capture fails (on a GPU: memory, an operator) must not fail the
    rows: the step runs the ordinary graph, and so do the later ones, logged once."""
    needs_fixture()
    tr = Translator.from_dir(
        FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1, kv_slots=4), cuda_graphs=True
    )
    pool = tr.scheduler.kv
    assert pool is not None and pool.graphed is not None

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(pool.graphed, "step", refused)
    text = SOURCES[2]
    assert tr.translate([text])[0].token_ids == alone(tr, text, [], DecodeOptions()).token_ids
    assert pool.graphed is None
    assert caplog.text.count("CUDA graphs off") == 1


def test_two_lanes_step_without_graphs() -> None:
    """A capture forbids other threads' device work meanwhile: graphs with one lane only."""
    needs_fixture()
    tr = Translator.from_dir(
        FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=2, kv_slots=4), cuda_graphs=True
    )
    pool = tr.scheduler.kv
    assert pool is not None and pool.graphed is None
    text = SOURCES[1]
    assert tr.translate([text])[0].token_ids == alone(tr, text, [], DecodeOptions()).token_ids


def test_graphs_bring_one_lane_by_default() -> None:
    """Lanes not chosen: a model whose steps replay graphs runs one lane, with them."""
    needs_fixture()
    tr = Translator.from_dir(
        FIXTURE_MODEL, scheduler=SchedulerOptions(kv_slots=4, cores=2), cuda_graphs=True
    )
    assert tr.scheduler.lanes == 1
    assert tr.scheduler.kv is not None and tr.scheduler.kv.graphed is not None


def test_the_default_on_the_cpu_has_no_graphs() -> None:
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1, kv_slots=4))
    assert tr.scheduler.kv is not None and tr.scheduler.kv.graphed is None
    assert ModelConfig.from_dir(FIXTURE_MODEL).max_position_embeddings >= MIN_WIDTH
