"""KV slots: every batchable layout steps with its decoder state in preallocated slots
written in place (`engine.model.kv.slots.pool`, `engine.model.kv.slots.rows`), rows still equal
decoding alone, slots go back to the pool after finals and aborts, a full pool queues and
a request wider than the whole pool is refused with a clear error.

On the CPU slots are not the default (`SchedulerOptions.kv_slots`): every test here asks
for them; tests/test_scheduler.py checks the same guarantees with the state copied."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from engine import DecodeOptions, Translator
from engine.decoding.batch import LOOKAHEAD_POSITIONS, Member
from engine.decoding.continuous import ContinuousBatch
from engine.decoding.policy import NotEnoughSlots, Priority, new_request_id
from engine.decoding.scheduler import SchedulerOptions
from engine.decoding.search import DecodingCancelled, Hypothesis
from engine.model.config import ModelConfig
from engine.model.kv.slots.pool import slot_bytes
from engine.model.kv.slots.rewrite import SlotShape, rewrite_step
from engine.model.kv.slots.rows import SlotKv
from tests.conftest import FIXTURE_MODEL, needs_fixture
from tests.test_scheduler import (
    SCORE_TOLERANCE,
    SOURCES,
    alone,
    drafted_searches,
    layouts,
    requests,
)

SLOTS = 64


@pytest.fixture(scope="module", params=layouts(), ids=[name for name, _ in layouts()])
def translator(request: pytest.FixtureRequest) -> Translator:
    """Each layout with KV slots asked for (on the CPU they are not the default)."""
    needs_fixture()
    options = dict(request.param[1])
    scheduler = options.pop("scheduler", SchedulerOptions(lanes=1))
    assert isinstance(scheduler, SchedulerOptions)
    scheduler = dataclasses.replace(scheduler, kv_slots=SLOTS)
    return Translator.from_dir(FIXTURE_MODEL, scheduler=scheduler, **options)  # type: ignore[arg-type]


def small_pool(slots: int, **options: object) -> Translator:
    needs_fixture()
    scheduler = SchedulerOptions(lanes=1, kv_slots=slots)
    return Translator.from_dir(FIXTURE_MODEL, scheduler=scheduler, **options)  # type: ignore[arg-type]


def free(tr: Translator) -> int:
    pool = tr.scheduler.kv_slots
    assert pool is not None
    return pool["free"]


def test_every_batchable_layout_steps_over_kv_slots(translator: Translator) -> None:
    scheduler = translator.scheduler
    pool = scheduler.kv
    assert pool is not None, "the step was not rewritten over KV slots"
    batch = scheduler._lanes[0].batch
    assert isinstance(batch, ContinuousBatch) and isinstance(batch.kv, SlotKv)
    config = translator.config
    # Sized at start as asked, its size known.
    assert pool.slots == SLOTS
    assert pool.bytes == pool.slots * slot_bytes(pool.shape, 4)
    assert pool.shape.capacity == config.max_position_embeddings
    assert scheduler.kv_slots == {"total": pool.slots, "free": pool.slots, "bytes": pool.bytes}


def test_slots_go_back_after_finals_and_aborts() -> None:
    """Many more requests than slots, some aborted while they wait or run: every answer
    equals decoding alone, and every slot is free again at the end."""
    tr = small_pool(3)
    options = DecodeOptions()
    todo = requests(tr) * 3
    expected = {(t, tuple(p)): alone(tr, t, p, options) for t, p in todo[:12]}
    aborted = 0

    def one(index: int) -> Hypothesis | None:
        text, prefix = todo[index]
        enc = tr.encode([tr.source_ids(text)])
        request_id = new_request_id()
        futures = tr.scheduler.submit(
            enc, options, priority=Priority.PARTIAL, request_id=request_id, prefixes=[prefix]
        )
        if index % 4 == 3:
            tr.scheduler.abort([request_id])
        try:
            return futures[0].result()
        except DecodingCancelled:
            return None

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(len(todo))))
    for (text, prefix), hyp in zip(todo, got, strict=True):
        if hyp is None:
            aborted += 1
            continue
        ref = expected[(text, tuple(prefix))]
        assert hyp.token_ids == ref.token_ids, (text, prefix)
        assert hyp.score == pytest.approx(ref.score, abs=SCORE_TOLERANCE)
    assert free(tr) == 3
    kv = tr.scheduler._policy.kv
    assert kv is not None and kv.free == kv.total  # no request holds a slot


def test_thousands_of_joins_and_leaves_keep_the_pool_as_it_was() -> None:
    tr = small_pool(4)
    pool = tr.scheduler.kv
    assert pool is not None
    buffers = {name: id(value) for name, value in pool.buffers.items()}
    options = DecodeOptions(max_new_tokens=2)
    enc = tr.encode([tr.source_ids(SOURCES[0])])
    stop = threading.Event()

    def churn(worker: int) -> int:
        done = 0
        for i in range(250):
            request_id = new_request_id()
            futures = tr.scheduler.submit(
                enc, options, priority=Priority.PARTIAL, request_id=request_id
            )
            if (i + worker) % 3 == 0:
                tr.scheduler.abort([request_id])
            try:
                futures[0].result()
                done += 1
            except DecodingCancelled:
                pass
        return done

    with ThreadPoolExecutor(8) as workers:
        answered = sum(workers.map(churn, range(8)))
    stop.set()
    assert answered > 0
    assert free(tr) == 4
    assert {name: id(value) for name, value in pool.buffers.items()} == buffers
    assert pool.bytes == 4 * slot_bytes(pool.shape, 4)


def test_a_full_pool_queues_and_a_request_wider_than_the_pool_is_refused() -> None:
    tr = small_pool(1)
    todo = SOURCES[:5]
    expected = [alone(tr, text, [], DecodeOptions()) for text in todo]
    gate = threading.Barrier(len(todo))

    def one(text: str) -> Hypothesis:
        enc = tr.encode([tr.source_ids(text)])
        gate.wait()
        return tr.decode(enc, DecodeOptions())[0]

    with ThreadPoolExecutor(len(todo)) as pool:
        got = list(pool.map(one, todo))
    assert [h.token_ids for h in got] == [r.token_ids for r in expected]
    assert tr.scheduler.batch_sizes.keys() == {1}  # one row at a time: one slot
    enc = tr.encode([tr.source_ids(SOURCES[0])])
    with pytest.raises(NotEnoughSlots, match=r"needs 3 KV slots; the pool has 1 \(--kv-slots\)"):
        tr.decode(enc, DecodeOptions(beam_size=3))
    assert tr.translate([SOURCES[1]])[0].token_ids == expected[1].token_ids  # it goes on


def test_slot_rows_with_lookahead_and_minimum_lengths_equal_decoding_alone(
    translator: Translator,
) -> None:
    """Rows joining at different steps with drafts verified several tokens per step, and
    eos banned in the graph below their minimum length, each equal decoding alone."""
    drafted_rows_over_slots_equal_alone(translator)


def drafted_rows_over_slots_equal_alone(translator: Translator) -> None:
    """Drafted searches joining a continuous batch over slots at steps 0, 1, 3 and 6,
    stepped until all are done: each equals decoding it alone, and some lookahead tokens
    were accepted and some not (skipped for a layout without lookahead over slots)."""
    model = translator.model
    pool = translator.scheduler.kv
    if model.masked is None or pool is None or not model.masked.lookahead:
        pytest.skip("no lookahead over slots for this layout")
    todo = drafted_searches(translator)
    batch = ContinuousBatch(model, SlotKv(model, pool), LOOKAHEAD_POSITIONS)
    joins = {0: todo[:2], 1: todo[2:3], 3: todo[3:6], 6: todo[6:]}
    slots = iter(range(pool.slots))
    step = 0
    while step in joins or step < max(joins) or len(batch):
        batch.update()
        members = [
            Member(s, translator.encode([translator.source_ids(t)]), (next(slots),))
            for _, s, t in joins.get(step, [])
        ]
        batch.schedule(members)
        batch.execute()
        step += 1
    for ref, s, text in todo:
        got = s.result()
        assert got.token_ids == ref.token_ids, (text, s.draft)
        assert got.score == pytest.approx(ref.score, abs=SCORE_TOLERANCE)
    assert 0 < batch.stats["lookahead_accepted"] < batch.stats["lookahead_offered"]


def test_a_graph_of_another_shape_is_not_rewritten(caplog: pytest.LogCaptureFixture) -> None:
    """The original with-past graph (no masks rewrite): refused with a reason, so the
    model copies its state per step rather than run a wrong graph."""
    needs_fixture()
    config = ModelConfig.from_dir(FIXTURE_MODEL)
    shape = SlotShape(config.decoder_layers, config.decoder_attention_heads, config.head_dim, 8, 8)
    data = (FIXTURE_MODEL / "decoder_with_past_model.onnx").read_bytes()
    facts = (config.vocab_size, config.bad_token_ids, config.eos_token_id)
    assert rewrite_step(data, shape, *facts) is None
    assert "not a masks-rewritten decoder" in caplog.text


def test_slot_bytes_counts_self_and_cross_keys_and_values() -> None:
    shape = SlotShape(layers=6, heads=8, head_dim=64, capacity=512, source_capacity=256)
    assert slot_bytes(shape, 2) == 6 * 2 * 8 * 64 * (512 + 256) * 2
    assert np.float16(0).itemsize == 2


@pytest.mark.anyio
async def test_metrics_show_the_pool_its_free_slots_and_its_size() -> None:
    from tests.live_server import http_get, serving

    tr = small_pool(6)
    pool = tr.scheduler.kv
    assert pool is not None
    async with serving(tr) as server:
        body = (await http_get(server, "/metrics")).body
    lang = tr.config.target_lang
    assert f'nmt_kv_slots{{lang="{lang}",state="total"}} 6.0' in body
    assert f'nmt_kv_slots{{lang="{lang}",state="free"}} 6.0' in body
    (size,) = [line for line in body.splitlines() if line.startswith("nmt_kv_slot_bytes{")]
    assert size.startswith(f'nmt_kv_slot_bytes{{lang="{lang}"}} ')
    assert float(size.split()[-1]) == pool.bytes
