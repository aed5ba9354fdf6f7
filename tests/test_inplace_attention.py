"""Self-attention in place (`engine.model.kv.inplace.rewrite`, `engine.model.kv.inplace.rows`):
the CPU's continuous batches step over buffers that each step extends where they are.

- The rewrite replaces every layer's attention core of each batchable layout's step and
  gives the ordinary step's logits for rows of different lengths in one call, each row
  reading only its own positions, the new position written in place.
- A graph it does not know gives None and a reason; the batch then copies the state.
- The scheduler's batches are in place by default on the CPU, `inplace_attention=False`
  copies the state; both give decoding alone's tokens (tests/test_scheduler.py checks
  every layout in place, here the copied state once more).
- Rows join and leave thousands of times without the buffers growing past the most rows
  held at once.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from engine import DecodeOptions, Translator
from engine.decoding.batch import Member
from engine.decoding.continuous import ContinuousBatch
from engine.decoding.policy import Priority
from engine.decoding.scheduler import SchedulerOptions
from engine.decoding.search import Hypothesis, make_search
from engine.model.backend import Backend
from engine.model.kv.inplace.rewrite import rewrite_inplace
from engine.model.kv.inplace.rows import INITIAL_ROWS, RELEASE_AFTER, SOURCE_STEP, InPlaceKv
from engine.model.kv.inplace.steps import InPlaceBinding, InPlaceSteps
from engine.model.names import (
    ENCODER_ATTENTION_MASK,
    ENCODER_HIDDEN_STATES,
    INPUT_IDS,
    MASK_INPUT,
    POSITIONS_INPUT,
    SEQLENS_INPUT,
    TOTAL_INPUT,
)
from tests.conftest import FIXTURE_MODEL, needs_fixture
from tests.test_scheduler import (
    SCORE_TOLERANCE,
    SOURCES,
    alone,
    concurrent_equal_alone,
    layouts,
)

Array = np.ndarray[Any, Any]
FP32_TOLERANCE = 1e-5


def in_place(batch: object) -> InPlaceKv:
    """The in-place KV backend of a lane's batch."""
    assert isinstance(batch, ContinuousBatch) and isinstance(batch.kv, InPlaceKv)
    return batch.kv


def _translator(**options: Any) -> Translator:
    needs_fixture()
    scheduler = options.pop("scheduler", SchedulerOptions(lanes=1))
    return Translator.from_dir(FIXTURE_MODEL, scheduler=scheduler, **options)


def _session(model: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _masked_step(tr: Translator) -> bytes:
    """The masked with-past graph of the files `tr` loaded (its layout's: split or merged,
    fp32 or int8 as the files quantize), as `load.masked_graphs` gives it. Not
    `load_batched_decoder`, which always takes the default files."""
    from engine.model.load import DecoderGraphs, choose_files, masked_graphs, rewrite_pair

    graphs = DecoderGraphs(choose_files(tr.model.model_dir, tr.model.options))
    rewritten = rewrite_pair(graphs)
    assert rewritten is not None
    return masked_graphs(rewritten, graphs.sources, None, per_token=False).with_past


@pytest.mark.parametrize("name,options", layouts(), ids=[name for name, _ in layouts()])
def test_every_batchable_layout_steps_with_self_attention_in_place(
    name: str, options: dict[str, object]
) -> None:
    tr = _translator(**dict(options))
    masked = tr.model.masked
    assert masked is not None and isinstance(tr.model.kv, InPlaceSteps), name
    assert tr.model.backend.backend is Backend.INPLACE
    in_place(tr.scheduler._lanes[0].batch)
    graph = onnx.load_from_string(rewrite_inplace(_masked_step(tr), name) or b"")
    kinds = [node.op_type for node in graph.graph.node]
    assert kinds.count("GroupQueryAttention") == tr.config.decoder_layers
    inputs = {i.name for i in graph.graph.input}
    assert MASK_INPUT not in inputs and {SEQLENS_INPUT, TOTAL_INPUT} <= inputs
    # No present is a concatenation any more: each comes out of the attention itself.
    produced = {out: node.op_type for node in graph.graph.node for out in node.output}
    presents = [o.name for o in graph.graph.output if ".decoder." in o.name]
    assert presents and all(produced[p] == "GroupQueryAttention" for p in presents)


def test_rows_of_different_lengths_read_their_own_positions_written_in_place() -> None:
    """Three rows with 2, 5 and 9 past positions in one call over buffers of 16: each
    row's logits are what the ordinary step gives it with its padding masked out, and the
    step wrote each row's new keys at its own length, nothing else."""
    tr = _translator()
    ordinary = _masked_step(tr)
    inplace = rewrite_inplace(ordinary, "fixture")
    assert inplace is not None
    plain, fast = _session(ordinary), _session(inplace)
    config = tr.config
    layers, lengths, capacity, source = config.decoder_layers, [2, 5, 9], 16, 6
    rng = np.random.default_rng(0)
    kv_shape = next(i.shape for i in plain.get_inputs() if i.name.endswith("0.decoder.key"))
    heads, dim = int(kv_shape[1]), int(kv_shape[3])
    hidden = heads * dim
    rows = len(lengths)
    widest = max(lengths)
    ids = rng.integers(3, 50, (rows, 1), dtype=np.int64)
    enc_mask = np.ones((rows, source), dtype=np.int64)
    enc_mask[0, 4:] = 0
    common: dict[str, Array] = {
        INPUT_IDS: ids,
        ENCODER_ATTENTION_MASK: enc_mask,
        ENCODER_HIDDEN_STATES: rng.standard_normal((rows, source, hidden)).astype(np.float32),
    }
    buffers: dict[str, Array] = {}
    padded: dict[str, Array] = {}
    for layer in range(layers):
        for kind in ("key", "value"):
            cross = rng.standard_normal((rows, heads, source, dim)).astype(np.float32)
            common[f"past_key_values.{layer}.encoder.{kind}"] = cross
            buffer = rng.standard_normal((rows, heads, capacity, dim)).astype(np.float32)
            name = f"past_key_values.{layer}.decoder.{kind}"
            buffers[name] = buffer
            # The ordinary step's layout: each row right-aligned over the widest, padded.
            left = np.zeros((rows, heads, widest, dim), dtype=np.float32)
            for r, length in enumerate(lengths):
                left[r, :, widest - length :] = buffer[r, :, :length]
            padded[name] = left
    mask = np.zeros((rows, widest + 1), dtype=np.int64)
    for r, length in enumerate(lengths):
        mask[r, widest - length :] = 1
    positions = np.array(lengths, dtype=np.int64).reshape(-1, 1)
    want_feed = {**common, **padded, MASK_INPUT: mask, POSITIONS_INPUT: positions}
    declared = {i.name for i in plain.get_inputs()}
    want = plain.run(["logits"], {k: v for k, v in want_feed.items() if k in declared})[0]

    before = {name: buffer.copy() for name, buffer in buffers.items()}
    binding = fast.io_binding()
    binding.bind_output("logits")
    fast_inputs = {i.name for i in fast.get_inputs()}
    extra = {
        POSITIONS_INPUT: positions,
        SEQLENS_INPUT: np.array(lengths, dtype=np.int32),
        TOTAL_INPUT: np.array(widest + 1, dtype=np.int32),
    }
    for key, value in {**common, **extra}.items():
        if key in fast_inputs:
            binding.bind_cpu_input(key, value)
    for name, buffer in buffers.items():
        address = buffer.ctypes.data
        binding.bind_input(name, "cpu", 0, np.float32, list(buffer.shape), address)
        present = name.replace("past_key_values", "present")
        binding.bind_output(present, "cpu", 0, np.float32, list(buffer.shape), address)
    fast.run_with_iobinding(binding)
    got = binding.get_outputs()[0].numpy()
    np.testing.assert_allclose(got, want, atol=FP32_TOLERANCE)
    # The ordinary step's new position (its present's last) is what the buffers got, at
    # each row's own length; every other position is as it was.
    present_names = [o.name for o in plain.get_outputs() if ".decoder." in o.name]
    presents = plain.run(present_names, {k: v for k, v in want_feed.items() if k in declared})
    for present, grown in zip(present_names, presents, strict=True):
        name = present.replace("present", "past_key_values")
        buffer, old = buffers[name], before[name]
        for r, length in enumerate(lengths):
            np.testing.assert_allclose(buffer[r, :, length], grown[r, :, -1], atol=FP32_TOLERANCE)
            untouched = np.delete(np.arange(capacity), length)
            np.testing.assert_array_equal(buffer[r][:, untouched], old[r][:, untouched])


def test_a_graph_it_does_not_know_gives_none_and_a_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [])
    graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1]))
    model = helper.make_model(graph)
    with caplog.at_level(logging.INFO):
        assert rewrite_inplace(model, "toy") is None
    assert "toy: self-attention stays as exported (no self-attention past inputs)" in caplog.text


def test_thousands_of_joins_and_leaves_keep_the_buffers_to_the_most_rows_held() -> None:
    """Requests of four lengths from 6 threads, 600 in all: every answer equals decoding
    alone, and the buffers hold no more rows than the most that ran at once, rounded up
    to a doubling of `INITIAL_ROWS`."""
    tr = _translator()
    batch = tr.scheduler._lanes[0].batch
    assert isinstance(batch, ContinuousBatch)
    in_place(batch)
    texts = SOURCES[:4]
    expected = {text: alone(tr, text, [], DecodeOptions()) for text in texts}
    encoded = {text: tr.encode([tr.source_ids(text)]) for text in texts}
    most = 0
    lock = threading.Lock()

    def one(i: int) -> None:
        nonlocal most
        text = texts[i % len(texts)]
        got = tr.decode(encoded[text], DecodeOptions())[0]
        assert got.token_ids == expected[text].token_ids
        assert got.score == pytest.approx(expected[text].score, abs=SCORE_TOLERANCE)
        with lock:
            most = max(most, batch.rows)

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(600)))
    held = batch.kv.buffer_rows
    bound = INITIAL_ROWS
    while bound < 6:  # never more rows than requests in flight
        bound *= 2
    assert INITIAL_ROWS <= held <= bound, (held, most)
    # Every row has left, within a span of `RELEASE_AFTER`: the rows stay resident (steady
    # load joins them again every turn). Two spans of single requests later, what the rows
    # past the first wrote has been given back (reads zeros); the first row is kept.
    assert most > 1 and batch.rows == 0
    assert any(buffer[1:].any() for buffer in batch.kv._buffers)
    now = [batch.kv.clock()]
    batch.kv.clock = lambda: now[0]
    for _ in range(2):
        now[0] += RELEASE_AFTER
        got = tr.decode(encoded[texts[0]], DecodeOptions())[0]
        assert got.token_ids == expected[texts[0]].token_ids
    for buffer in (*batch.kv._buffers, *batch.kv._cross):
        assert not buffer[1:].any()
        assert buffer[0].any()


def test_the_buffers_grow_by_doublings_of_the_initial_rows_whatever_the_first_join() -> None:
    """A lane whose first join brings more rows than `INITIAL_ROWS` takes buffers of the
    next doubling of it, as every later growth does: sized to that join alone (five rows),
    the next join of one row more doubled them to ten, past the doubling of the most rows
    held (eight). Each join is queued at once (under the scheduler's lock), so that the
    lane takes it in one turn whatever the load."""
    tr = _translator()
    scheduler = tr.scheduler
    kv = in_place(scheduler._lanes[0].batch)
    encoded = tr.encode([tr.source_ids(SOURCES[0])])  # the lane has started
    expected = alone(tr, SOURCES[0], [], DecodeOptions()).token_ids
    most = 0
    for count in (INITIAL_ROWS + 1, INITIAL_ROWS + 2):
        futures: list[Future[Hypothesis]] = []
        with scheduler._cond:  # the lane looks once they are all queued: one join
            for _ in range(count):
                futures += scheduler.submit(encoded, DecodeOptions(), priority=Priority.FINAL)
        assert [future.result(30).token_ids for future in futures] == [expected] * count
        most = max(most, max(scheduler.batch_sizes))
    assert most == INITIAL_ROWS + 2
    assert kv.buffer_rows == 2 * INITIAL_ROWS


def _after_a_burst(tr: Translator) -> tuple[ContinuousBatch, list[float], list[Any]]:
    """60 requests from 6 threads on a translator's one lane, its spans on a clock the
    test moves (the lane's waits stay on the real one). Returns the lane's batch, that
    clock and the encoded sources; asserts that the rows past the first stay resident."""
    batch = tr.scheduler._lanes[0].batch
    assert isinstance(batch, ContinuousBatch)
    in_place(batch)
    now = [batch.kv.clock()]
    batch.kv.clock = lambda: now[0]
    encoded = [tr.encode([tr.source_ids(text)]) for text in SOURCES[:4]]
    most = 0
    lock = threading.Lock()

    def one(i: int) -> None:
        nonlocal most
        tr.decode(encoded[i % len(encoded)], DecodeOptions())
        with lock:
            most = max(most, batch.rows)

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(60)))
    assert most > 1 and batch.rows == 0
    assert batch.quiet_in() is not None
    assert any(buffer[1:].any() for buffer in batch.kv._buffers)  # kept within the span
    return batch, now, encoded


def _wake(tr: Translator) -> None:
    with tr.scheduler._cond:  # the lane waits on the real clock: wake it to look
        tr.scheduler._cond.notify_all()


def test_an_idle_lane_gives_its_rows_back_after_a_quiet_spell_without_a_request() -> None:
    """After a burst, a lane that gets no more requests still gives the rows past the first
    back once two spans of `RELEASE_AFTER` have passed: its thread waits for work no
    longer than the batch's `quiet_in`, then settles. Nothing is decoded meanwhile."""
    tr = _translator()
    batch, now, _ = _after_a_burst(tr)
    steps = tr.scheduler.stats["decoder_steps"]
    now[0] += 2 * RELEASE_AFTER
    _wake(tr)
    deadline = time.monotonic() + 10
    while any(buffer[1:].any() for buffer in batch.kv._buffers) and time.monotonic() < deadline:
        time.sleep(0.01)
    for buffer in (*batch.kv._buffers, *batch.kv._cross):
        assert not buffer[1:].any()
        assert buffer[0].any()
    assert batch.quiet_in() is None  # nothing left to give back: the lane waits for work
    assert tr.scheduler.stats["decoder_steps"] == steps


def test_an_idle_lane_whose_memory_cannot_be_given_back_serves_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A settle that fails is logged; the lane does not die nor spin on it: it tries again
    a quiet spell later (the span starts before the release), and its next request is
    answered as before."""
    from engine.model.kv.inplace import rows as inplace_batch

    tr = _translator()
    batch, now, encoded = _after_a_burst(tr)
    expected = tr.decode(encoded[0], DecodeOptions())[0]
    calls: list[int] = []

    def failing(buffer: Any, begin: int, end: int) -> None:
        calls.append(begin)
        raise OSError("madvise refused")

    monkeypatch.setattr(inplace_batch, "release_rows", failing)
    now[0] += 2 * RELEASE_AFTER
    with caplog.at_level(logging.ERROR, logger="engine.decoding.scheduler"):
        _wake(tr)
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # a lane that spun would call it again and again
    assert len(calls) == 1
    assert "could not give its memory back" in caplog.text
    quiet = batch.quiet_in()
    assert quiet is not None and quiet > RELEASE_AFTER  # tried again a spell later
    monkeypatch.undo()
    got = tr.decode(encoded[0], DecodeOptions())[0]
    assert got.token_ids == expected.token_ids


def test_a_lanes_binding_is_kept_between_steps_and_bound_again_when_its_rows_change() -> None:
    """Three rows stepped three times over buffers with a kept binding, and over copies of
    them with a fresh binding each step: the same logits, written to the same positions;
    the binding is the same object from step to step (only the tokens and positions are
    bound again) and a step's logits are not overwritten by the next. When a row leaves
    (other buffer views, other cross-attention arrays) it is bound anew, and the two rows
    left still step as with a fresh binding; so too when the buffers move (grow)."""
    tr = _translator()
    masked, steps = tr.model.masked, tr.model.kv
    assert masked is not None and isinstance(steps, InPlaceSteps)
    enc = tr.encode([tr.source_ids(text) for text in SOURCES[:3]])
    start = tr.config.decoder_start_token_id
    ids = np.array([[start, 5, 7], [start, 9, 11], [start, 4, 6]], dtype=np.int64)
    _, self_kv, cross_kv = masked.prefill(enc, ids, np.ones(ids.shape, dtype=np.int64))
    kept = [np.zeros((*a.shape[:2], 8, a.shape[3]), dtype=a.dtype) for a in self_kv]
    for buffer, prefilled in zip(kept, self_kv, strict=True):
        buffer[:, :, :3] = prefilled
    fresh = [buffer.copy() for buffer in kept]
    lengths = np.array([3, 3, 3], dtype=np.int64)
    bound = InPlaceBinding()
    bindings, earlier = [], []
    for step in range(3):
        tokens = np.array([[13 + step], [17 + step], [19 + step]], dtype=np.int64)
        got = steps.step(enc, tokens, lengths, kept, cross_kv, bound=bound)
        want = steps.step(enc, tokens, lengths, fresh, cross_kv)
        np.testing.assert_array_equal(got, want)
        earlier.append((got, got.copy()))
        bindings.append(bound.binding)
        lengths = lengths + 1
    for buffer, other in zip(kept, fresh, strict=True):
        np.testing.assert_array_equal(buffer, other)
    assert bindings[0] is bindings[1] is bindings[2]
    for logits, copy in earlier:
        np.testing.assert_array_equal(logits, copy)

    two = np.array([0, 1])  # the last row left
    enc, cross_kv = enc.select(two), tuple(np.ascontiguousarray(a[:2]) for a in cross_kv)
    for step in range(2):
        tokens = np.array([[23 + step], [29 + step]], dtype=np.int64)
        views, other = [b[:2] for b in kept], [b[:2] for b in fresh]
        got = steps.step(enc, tokens, lengths[:2], views, cross_kv, bound=bound)
        want = steps.step(enc, tokens, lengths[:2], other, cross_kv)
        np.testing.assert_array_equal(got, want)
        lengths = lengths + 1
    assert bound.binding is not bindings[0]

    # The buffers grow (moved to new memory, as a lane's do): the same rows and arrays,
    # other addresses. The step must write the new buffers, not the old.
    moved = bound.binding
    kept = [np.concatenate([b, np.zeros_like(b)], axis=2) for b in kept]
    fresh = [np.concatenate([b, np.zeros_like(b)], axis=2) for b in fresh]
    tokens = np.array([[31], [37]], dtype=np.int64)
    views, other = [b[:2] for b in kept], [b[:2] for b in fresh]
    got = steps.step(enc, tokens, lengths[:2], views, cross_kv, bound=bound)
    want = steps.step(enc, tokens, lengths[:2], other, cross_kv)
    np.testing.assert_array_equal(got, want)
    for buffer, expected in zip(kept, fresh, strict=True):
        np.testing.assert_array_equal(buffer[:2], expected[:2])
    assert bound.binding is not moved


def test_a_row_count_that_comes_back_finds_its_binding_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One lane's batch whose rows go 2 -> 1 -> 2 -> 0 -> 1 -> 2 (a row leaves, one joins,
    every row leaves, rows join again): each session and row count is bound once, found
    again when the count comes back (through an empty batch too), and every search that
    ends gives decoding alone's tokens; when the buffers grow, the kept bindings are
    dropped (they bound the old buffers) and the counts are bound anew."""
    tr = _translator()
    masked, steps = tr.model.masked, tr.model.kv
    assert masked is not None and isinstance(steps, InPlaceSteps)
    batch = ContinuousBatch(tr.model, InPlaceKv(tr.model, masked, steps))
    kv = in_place(batch)
    binds: list[tuple[int, int]] = []
    stepped: list[tuple[int, int]] = []
    bind, step = InPlaceSteps._bind, InPlaceSteps.step

    def counted_bind(self: InPlaceSteps, session: Any, *args: Any) -> Any:
        binds.append((id(session), int(args[2].attention_mask.shape[0])))
        return bind(self, session, *args)

    def counted_step(self: InPlaceSteps, enc: Any, ids: Any, *args: Any, **kw: Any) -> Any:
        one = self.one is not None and ids.size == 1
        session = (self.one if one and self.one is not None else self.graph).session
        stepped.append((id(session), int(ids.shape[0])))
        return step(self, enc, ids, *args, **kw)

    monkeypatch.setattr(InPlaceSteps, "_bind", counted_bind)
    monkeypatch.setattr(InPlaceSteps, "step", counted_step)
    texts = SOURCES[:4]
    expected = {text: alone(tr, text, [], DecodeOptions()).token_ids for text in texts}
    options = DecodeOptions()

    def member(text: str) -> Member:
        search = make_search(tr.config, [], options)
        return Member(search, tr.encode([tr.source_ids(text)]))

    def turn(joining: list[Member], leaving: list[Any]) -> None:
        for search in batch.update():
            assert search.result().token_ids == expected[texts_of[id(search)]]
        batch.schedule(joining, leaving)
        if batch.rows:
            batch.execute()

    texts_of: dict[int, str] = {}

    def join(*chosen: str) -> list[Member]:
        members = [member(text) for text in chosen]
        texts_of.update((id(m.search), text) for m, text in zip(members, chosen, strict=True))
        return members

    turn(join(texts[0], texts[1]), [])  # 2 rows
    turn([], [])
    turn([], [batch.searches[-1]])  # 1
    turn([], [])
    turn(join(texts[2]), [])  # 2 again
    turn([], [])
    turn([], list(batch.searches))  # 0
    turn(join(texts[3]), [])  # 1 again
    turn(join(texts[0]), [])  # 2 again
    while batch.rows:
        turn([], [])
    assert len(binds) == len(set(binds)) == len(set(stepped)), (binds, stepped)
    assert kv.buffer_rows == INITIAL_ROWS

    before = set(binds)
    old = weakref.ref(kv._buffers[0].base)  # what views of the buffer hold
    turn(join(*texts, texts[0]), [])  # past the buffers' rows: they grow
    assert kv.buffer_rows == 2 * INITIAL_ROWS
    gc.collect()
    assert old() is None  # no kept binding holds the old buffers
    while batch.rows:
        turn([], [])
    assert before & set(binds[len(before) :])  # counts seen before, bound anew


@pytest.mark.parametrize("lanes", [1, None])
def test_a_kept_binding_takes_a_lookahead_step_between_steps_of_one_token(
    lanes: int | None,
) -> None:
    """One row stepped over a kept binding: one token, then four (lookahead: its logits
    at every position), then one again; each as a fresh binding gives, positions written
    alike. The tokens of one token a row go into inputs bound once (`TokenInputs`), with
    the step's output (the fixture's logits: its small projection stays in the graph),
    and a step of several reads its own output, not theirs."""
    tr = _translator(scheduler=SchedulerOptions(lanes=lanes))
    masked, steps = tr.model.masked, tr.model.kv
    assert masked is not None and isinstance(steps, InPlaceSteps)
    enc = tr.encode([tr.source_ids(SOURCES[0])])
    start = tr.config.decoder_start_token_id
    ids = np.array([[start, 5, 7]], dtype=np.int64)
    _, self_kv, cross_kv = masked.prefill(enc, ids, np.ones(ids.shape, dtype=np.int64))
    kept = tuple(np.zeros((*a.shape[:2], 16, a.shape[3]), dtype=a.dtype) for a in self_kv)
    for buffer, prefilled in zip(kept, self_kv, strict=True):
        buffer[:, :, :3] = prefilled
    fresh = tuple(buffer.copy() for buffer in kept)
    bound = InPlaceBinding()
    length = 3
    for tokens in ([[13]], [[17, 19, 23, 29]], [[31]], [[37]]):
        fed = np.array(tokens, dtype=np.int64)
        lengths = np.array([length], dtype=np.int64)
        got = steps.step(enc, fed, lengths, kept, cross_kv, bound=bound)
        want = steps.step(enc, fed, lengths, fresh, cross_kv)
        assert (
            got.shape
            == want.shape
            == ((1, 4, tr.config.vocab_size) if fed.shape[1] > 1 else (1, tr.config.vocab_size))
        )
        np.testing.assert_array_equal(got, want)
        length += fed.shape[1]
    for buffer, other in zip(kept, fresh, strict=True):
        np.testing.assert_array_equal(buffer, other)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_the_buffers_pages_come_as_rows_write_them() -> None:
    """A lane's buffers span every position of every row, but only written positions
    take memory: ten positions of each of 16 rows' 8 heads, in a 16 MiB buffer, take
    about 128 pages (NumPy's own zeros would take 2 MiB pages, the whole buffer)."""
    from engine.model.kv.inplace.rows import mapped_zeros

    buffer = mapped_zeros((16, 8, 512, 64), np.dtype(np.float32))
    assert buffer.nbytes == 16 * 2**20 and buffer.flags.writeable
    assert not buffer.any()
    before = _rss_mib()
    buffer[:, :, :10] = 1.0
    grown = _rss_mib() - before
    assert grown < 4, grown
    assert float(buffer.sum()) == 16 * 8 * 10 * 64


def test_rows_given_back_take_no_memory_and_read_zeros() -> None:
    """Rows 2-15 of a 16 MiB buffer, all written, given back: about 14 MiB less
    resident, those rows zeros, the first two as written; written again, they hold the
    new values. A view's rows are its own (offset from the map's start). Arrays that are
    not such buffers are left alone."""
    from engine.model.kv.inplace.rows import mapped_zeros, release_rows

    buffer = mapped_zeros((16, 8, 512, 64), np.dtype(np.float32))
    buffer[:] = 1.0
    before = _rss_mib()
    release_rows(buffer, 2, 16)
    assert before - _rss_mib() > 12
    assert not buffer[2:].any() and bool((buffer[:2] == 1.0).all())
    buffer[5, :, :3] = 2.0
    assert float(buffer[5].sum()) == 8 * 3 * 64 * 2.0
    # Rows of a view are its own rows: rows 1-2 of the view from row 4 are rows 5-6.
    buffer[:] = 3.0
    release_rows(buffer[4:], 1, 3)
    assert not buffer[5:7].any() and bool((buffer[:5] == 3.0).all())
    assert bool((buffer[7:] == 3.0).all())
    plain = np.ones((4, 1024), dtype=np.float32)
    release_rows(plain, 1, 4)
    assert bool((plain == 1.0).all())


@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "copied"])
def test_a_lanes_state_counts_its_rows_positions_and_sources(inplace: bool) -> None:
    """Before each step of a lone row, the lane's live state is its positions fed so far
    (the start token and every token but the one about to be fed) and its real source
    positions, each the model's keys and values over every layer; the arrays holding it
    span at least that. Once the row has ended the live state is 0, and the in-place
    buffers stay reserved for the lane's next rows."""
    tr = _translator(scheduler=SchedulerOptions(lanes=1, inplace_attention=inplace))
    batch = tr.scheduler._lanes[0].batch
    assert isinstance(batch, ContinuousBatch)
    assert isinstance(batch.kv, InPlaceKv) == inplace
    config = tr.config
    position = 2 * config.decoder_layers * config.d_model * np.dtype(np.float32).itemsize
    source = tr.source_ids(SOURCES[4])
    seen: list[tuple[int, int, int]] = []  # (live, reserved, positions fed)
    execute = batch.execute

    def counted() -> None:
        state = batch.state_bytes()
        assert state is not None
        (search,) = batch.searches
        seen.append((state.live, state.reserved, len(search.rows()[0])))
        execute()

    batch.execute = counted  # type: ignore[method-assign]
    got = tr.decode(tr.encode([source]), DecodeOptions())[0]
    assert got.token_ids == alone(tr, SOURCES[4], [], DecodeOptions()).token_ids
    assert len(seen) >= 3
    for live, reserved, fed in seen:
        assert live == (fed + len(source)) * position
        assert reserved >= live
    final = tr.scheduler.state_bytes
    assert final is not None and final.live == 0
    if inplace:  # self-attention over every position, cross over the source's width
        width = -(-len(source) // SOURCE_STEP) * SOURCE_STEP
        assert final.reserved == INITIAL_ROWS * (batch.kv.positions + width) * position
    else:
        assert final.reserved == 0


def test_a_lockstep_batch_does_not_count_its_state() -> None:
    tr = _translator(batchable=False)
    assert tr.scheduler.batching == "lockstep" and tr.scheduler.state_bytes is None


@pytest.mark.anyio
async def test_metrics_show_the_decoder_state_the_lanes_hold() -> None:
    from tests.live_server import http_get, serving

    tr = _translator()
    tr.translate([SOURCES[0]])
    state = tr.scheduler.state_bytes
    assert state is not None and state.reserved > 0
    async with serving(tr) as server:
        body = (await http_get(server, "/metrics")).body
    lang = tr.config.target_lang
    assert f'nmt_decoder_state_bytes{{lang="{lang}",state="live"}} 0.0' in body
    reserved = f'nmt_decoder_state_bytes{{lang="{lang}",state="reserved"}} {float(state.reserved)}'
    assert reserved in body


def test_cross_attention_state_is_written_once_and_widened_for_a_longer_source() -> None:
    """A lane keeps its rows' cross-attention keys and values and encoder mask in buffers
    of its own: a join writes the newcomers' rows, a longer source widens the buffers with
    the running rows kept, a leave moves rows down; each step binds views of them (no
    copies). Rows driven join by join equal decoding alone."""
    tr = _translator()
    masked, steps = tr.model.masked, tr.model.kv
    assert masked is not None and isinstance(steps, InPlaceSteps)
    batch = ContinuousBatch(tr.model, InPlaceKv(tr.model, masked, steps))
    short, longer = SOURCES[5], f"{SOURCES[4]} and {SOURCES[2]}"
    assert len(tr.source_ids(short)) < SOURCE_STEP < len(tr.source_ids(longer))
    options = DecodeOptions(min_new_tokens=6)  # the first row still runs when the next joins

    def member(text: str) -> Member:
        search = make_search(tr.config, [], options)
        return Member(search, tr.encode([tr.source_ids(text)]))

    first = member(short)
    ended: list[Any] = batch.schedule([first])
    batch.execute()
    assert batch.kv._mask.shape[1] == SOURCE_STEP  # the short source, rounded up
    ended += batch.update()
    assert first.search in batch.searches  # still running when the longer one joins
    second = member(longer)
    ended += batch.schedule([second])  # wider: the running row is kept in the new buffers
    assert batch.kv._mask.shape[1] == 2 * SOURCE_STEP
    rows = batch.kv._rows
    assert rows is not None
    for view, buffer in zip(rows.cross_kv, batch.kv._cross, strict=True):
        assert view.base is not None and np.shares_memory(view, buffer)
        assert view.flags.c_contiguous
    while batch.searches:
        batch.execute()
        ended += batch.update()
    for text, m in ((short, first), (longer, second)):
        ref = alone(tr, text, [], options)
        assert m.search.result().token_ids == ref.token_ids
        assert m.search.result().score == pytest.approx(ref.score, abs=SCORE_TOLERANCE)
    assert len(ended) == 2


def test_cross_attention_buffers_narrow_again_when_the_longer_source_leaves() -> None:
    """A longer source widens a lane's cross-attention buffers; when it leaves (here
    aborted) they narrow back to what the rows left need, and the row left still equals
    decoding alone."""
    tr = _translator()
    masked, steps = tr.model.masked, tr.model.kv
    assert masked is not None and isinstance(steps, InPlaceSteps)
    batch = ContinuousBatch(tr.model, InPlaceKv(tr.model, masked, steps))
    short, longer = SOURCES[5], f"{SOURCES[4]} and {SOURCES[2]}"
    options = DecodeOptions(min_new_tokens=6)
    first = make_search(tr.config, [], options)
    second = make_search(tr.config, [], options)
    assert not batch.schedule([Member(first, tr.encode([tr.source_ids(short)]))])
    batch.execute()
    assert not batch.update()
    assert not batch.schedule([Member(second, tr.encode([tr.source_ids(longer)]))])
    assert batch.kv._mask.shape[1] == 2 * SOURCE_STEP
    batch.execute()
    assert not batch.update()
    batch.schedule([], leaving=[second])
    assert batch.kv._mask.shape[1] == SOURCE_STEP and batch.searches == [first]
    while batch.searches:
        batch.execute()
        batch.update()
    ref = alone(tr, short, [], options)
    assert first.result().token_ids == ref.token_ids
    assert first.result().score == pytest.approx(ref.score, abs=SCORE_TOLERANCE)


def test_an_in_place_step_that_reads_the_hidden_states_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The in-place batch keeps no encoder hidden states for its rows: a rewritten step
    that reads them (here: the load told that the mask it reads is that input) is refused
    at load with a reason, and the lanes copy their state, with the same answers."""
    steps = "engine.model.kv.inplace.steps"
    monkeypatch.setattr(f"{steps}.ENCODER_HIDDEN_STATES", ENCODER_ATTENTION_MASK)
    with caplog.at_level(logging.WARNING):
        tr = _translator()
    assert "reads the encoder's hidden states: not used" in caplog.text
    masked = tr.model.masked
    assert masked is not None and tr.model.kv is None
    assert tr.model.backend.backend is Backend.COPIED
    batch = tr.scheduler._lanes[0].batch
    assert isinstance(batch, ContinuousBatch) and not isinstance(batch.kv, InPlaceKv)
    concurrent_equal_alone(tr, DecodeOptions())
