"""The decode scheduler: requests from many threads share decoder steps and still get
exactly what decoding each alone gives; aborted partials leave the batch; finals go first.

"Alone" is one source at a time through a scheduler on the original (not rewritten)
graphs, whose lockstep batch then holds that one row, so a test here fails if batching,
padding, the rewrite or the scheduler changes any row's tokens or scores. int8 graphs,
original and rewritten, run with activations quantized per token
(`engine.model.passes.per_token`; `tests/test_token_quantization.py` checks that against
the files themselves).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import DecodeOptions, Translator
from engine.decoding.batch import LOOKAHEAD_POSITIONS
from engine.decoding.policy import PREFILL_PADDING, Priority, new_request_id
from engine.decoding.scheduler import DecodeScheduler, SchedulerOptions
from engine.decoding.search import DecodingCancelled, Hypothesis, Search, make_search
from engine.decoding.targets import model_share
from engine.model.kv.base import LOOKAHEAD
from engine.model.kv.inplace.steps import InPlaceSteps
from engine.model.layouts import EncoderOutput, FloatArray
from tests.conftest import FIXTURE_MODEL, needs_fixture

SOURCES = [
    "I will meet Tom at three",
    "Tom reads a book in the library",
    "my sister will not call Lily tomorrow",
    "we eat noodles",
    "Lucy wants to play tennis with my brother on Sunday",
    "the teacher",
]


def layouts() -> list[tuple[str, dict[str, object]]]:
    return [
        ("split fp32", {}),
        ("split int8", {"quantized": True}),
        ("merged fp32", {"prefer_split": False}),
        ("merged int8", {"prefer_split": False, "quantized": True}),
        # A lone stream's step with its output projection on two threads, the rest on one
        # (the fixture's projection is small, kept whole unless `cut` below says so).
        ("head apart fp32", {"scheduler": HEAD_APART}),
        ("head apart int8", {"quantized": True, "scheduler": HEAD_APART}),
    ]


HEAD_APART = SchedulerOptions(lanes=1, threads_per_lane=1, head_threads=2)


def cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load the fixture with its output projection cut apart wherever threads or positions
    ask for it, as a larger model's is: the fixture's is under `SMALL_PROJECTION`."""
    import engine.model.cut

    monkeypatch.setattr(engine.model.cut, "SMALL_PROJECTION", 0)


SCORE_TOLERANCE = 1e-4
"""Score tolerance against decoding alone, fp32 and int8 alike: the engine quantizes int8
activations per token (`engine.model.passes.per_token`), so a row's values do not depend on
its batch mates, its padding or the other tokens of its call."""


_REFERENCES: dict[tuple[bool, bool], Translator] = {}


def reference(tr: Translator) -> Translator:
    """The same files loaded without the rewrite: the original decoder graphs."""
    key = (tr.model.options.quantized, tr.model.options.prefer_split)
    if key not in _REFERENCES:
        _REFERENCES[key] = Translator.from_dir(
            tr.model.model_dir, quantized=key[0], prefer_split=key[1], batchable=False
        )
    return _REFERENCES[key]


def alone(tr: Translator, text: str, prefix: Sequence[int], options: DecodeOptions) -> Hypothesis:
    ref = reference(tr)
    enc = ref.model.encode(*_ids(ref, [text]))
    return ref.decode(enc, options, prefixes=[prefix])[0]


def _ids(tr: Translator, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    sources = [tr.source_ids(t) for t in texts]
    width = max(map(len, sources))
    ids = np.full((len(sources), width), tr.config.pad_token_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for r, s in enumerate(sources):
        ids[r, : len(s)], mask[r, : len(s)] = s, 1
    return ids, mask


def requests(tr: Translator) -> list[tuple[str, list[int]]]:
    """Each source with no prefix and with a forced prefix of its own length."""
    full = {text: alone(tr, text, [], DecodeOptions()).token_ids for text in SOURCES}
    out = [(text, []) for text in SOURCES]
    out += [(text, list(full[text][: 1 + i % 4])) for i, text in enumerate(SOURCES)]
    return out


@pytest.fixture(scope="module", params=layouts(), ids=[name for name, _ in layouts()])
def translator(request: pytest.FixtureRequest) -> Translator:
    """One lane, so that every request shares its batch (lanes: see test_two_lanes_...)."""
    needs_fixture()
    options = dict(request.param[1])
    scheduler = options.pop("scheduler", SchedulerOptions(lanes=1))
    assert isinstance(scheduler, SchedulerOptions)
    with pytest.MonkeyPatch.context() as patch:
        if scheduler is HEAD_APART:  # the cut's paths, equal to decoding alone too
            cut(patch)
        return Translator.from_dir(FIXTURE_MODEL, scheduler=scheduler, **options)  # type: ignore[arg-type]


def test_the_fixture_decoders_are_rewritten_for_continuous_batching(
    translator: Translator,
) -> None:
    assert translator.scheduler.batching == "continuous"
    masked = translator.model.masked
    assert masked is not None
    # The output projection runs apart exactly when its threads differ from the lane's,
    # and only where it is not too small to pay for a call of its own (the fixture's is).
    threads = translator.model.options
    apart = threads.head_threads != threads.intra_op_threads
    cut = translator.scheduler.options is HEAD_APART
    assert (masked.head is not None) == (apart and cut)


def concurrent_equal_alone(translator: Translator, options: DecodeOptions) -> None:
    """Every request of `requests` submitted at once from its own thread: each answer
    equals decoding it alone, and they shared steps."""
    todo = requests(translator)
    expected = [alone(translator, text, prefix, options) for text, prefix in todo]
    gate = threading.Barrier(len(todo))

    def one(item: tuple[str, list[int]]) -> Hypothesis:
        text, prefix = item
        enc = translator.encode([translator.source_ids(text)])
        gate.wait()  # all submit at once: they share steps
        return translator.decode(enc, options, prefixes=[prefix])[0]

    before = translator.scheduler.stats["decoder_steps"]
    rows_before, sizes_before = (
        translator.scheduler.stats["decoder_step_rows"],
        translator.scheduler.batch_sizes,
    )
    with ThreadPoolExecutor(len(todo)) as pool:
        got = list(pool.map(one, todo))
    for (text, prefix), hyp, ref in zip(todo, got, expected, strict=True):
        assert hyp.token_ids == ref.token_ids, (text, prefix)
        assert hyp.finished == ref.finished
        assert hyp.score == pytest.approx(ref.score, abs=SCORE_TOLERANCE)
    steps = translator.scheduler.stats["decoder_steps"] - before
    alone_steps = sum(len(ref.token_ids) for ref in expected)
    assert steps < alone_steps / 2  # they did share steps
    # The steps' rows, counted for the metrics, agree with the batch sizes' histogram.
    sizes = translator.scheduler.batch_sizes - sizes_before
    step_rows = translator.scheduler.stats["decoder_step_rows"] - rows_before
    assert step_rows == sum(rows * n for rows, n in sizes.items()) > steps


@pytest.mark.parametrize("beam", [1, 3])
def test_concurrent_requests_equal_decoding_each_alone(translator: Translator, beam: int) -> None:
    concurrent_equal_alone(translator, DecodeOptions(beam_size=beam))


def test_rows_join_and_leave_a_running_batch(translator: Translator) -> None:
    """A request submitted while another is mid-decode joins at the next step (its
    decoder length differs), and both still equal decoding alone."""
    if translator.scheduler.batching != "continuous":
        pytest.skip("lockstep batching")
    long_text, short_text = SOURCES[4], SOURCES[3]
    options = DecodeOptions(min_new_tokens=30, max_new_tokens=30)  # a long first row
    ref_long = alone(translator, long_text, [], options)
    ref_short = alone(translator, short_text, [], DecodeOptions())
    started = threading.Event()
    sent = threading.Event()  # the short request is being submitted
    result: list[Hypothesis] = []

    def hook(rows: Sequence[Sequence[int]], scores: FloatArray) -> FloatArray:
        if len(rows[0]) == 5:
            started.set()
            # Hold the long row (this runs on the lane's thread) until the short request
            # waits (or another lane took it), so that it joins mid-decode however slow the
            # machine is: without the hold the long row can end first in a loaded run.
            assert sent.wait(30)
            deadline = time.monotonic() + 0.2
            while not translator.scheduler.waiting and time.monotonic() < deadline:
                time.sleep(0.0005)
        return scores

    def long_request() -> None:
        enc = translator.encode([translator.source_ids(long_text)])
        result.append(translator.decode(enc, options, hook=hook)[0])

    short_enc = translator.encode([translator.source_ids(short_text)])  # the lane encodes
    sizes_before = dict(translator.scheduler.batch_sizes)
    thread = threading.Thread(target=long_request)
    thread.start()
    assert started.wait(30)
    sent.set()
    short = translator.decode(short_enc, DecodeOptions())[0]
    thread.join(30)
    assert short.token_ids == ref_short.token_ids
    assert short.score == pytest.approx(ref_short.score, abs=SCORE_TOLERANCE)
    assert result[0].token_ids == ref_long.token_ids
    assert result[0].score == pytest.approx(ref_long.score, abs=SCORE_TOLERANCE)
    grew = translator.scheduler.batch_sizes[2] - sizes_before.get(2, 0)
    assert grew >= len(short.token_ids)  # they shared steps while both ran


def test_a_stale_partial_leaves_the_batch_and_others_go_on(translator: Translator) -> None:
    long_options = DecodeOptions(min_new_tokens=40, max_new_tokens=40)
    request_id = new_request_id()
    steps: list[int] = []

    def hook(rows: Sequence[Sequence[int]], scores: FloatArray) -> FloatArray:
        steps.append(len(rows[0]))
        if len(rows[0]) == 6:
            translator.abort([request_id])  # a newer partial of its stream arrived
        return scores

    def stale_partial() -> BaseException | None:
        enc = translator.encode([translator.source_ids(SOURCES[1])])
        try:
            translator.decode(
                enc, long_options, hook=hook, priority=Priority.PARTIAL, request_id=request_id
            )
        except DecodingCancelled as exc:
            return exc
        return None

    def other() -> Hypothesis:
        enc = translator.encode([translator.source_ids(SOURCES[4])])
        return translator.decode(enc, long_options)[0]

    cancelled_before = translator.scheduler.stats["rows_cancelled"]
    with ThreadPoolExecutor(2) as pool:
        stale, kept = pool.submit(stale_partial), pool.submit(other)
        assert isinstance(stale.result(30), DecodingCancelled)
        hyp = kept.result(30)
    assert max(steps) <= 7  # it left at the step after it went stale
    assert translator.scheduler.stats["rows_cancelled"] == cancelled_before + 1
    ref = alone(translator, SOURCES[4], [], long_options)
    assert hyp.token_ids == ref.token_ids and len(hyp.token_ids) == 40


def test_an_abort_takes_the_stale_partials_row_out_of_the_batch(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The abort pushed in while a partial's row is in the batch (a newer partial of its
    stream arrived) takes the row out before the next decoder call: the batch has one row
    fewer from then on, the request gets `DecodingCancelled`, the row decoded beside it
    goes on to its end and equals decoding it alone."""
    scheduler = translator.scheduler
    (lane,) = scheduler._lanes
    options = DecodeOptions(min_new_tokens=40, max_new_tokens=40)
    stale_id = new_request_id()
    queued = threading.Event()

    def stale_hook(rows: Sequence[Sequence[int]], scores: FloatArray) -> FloatArray:
        if len(rows[0]) == 6:
            scheduler.abort([stale_id])  # on the lane's thread, between two calls
        return scores

    def other_hook(rows: Sequence[Sequence[int]], scores: FloatArray) -> FloatArray:
        if not rows[0]:
            assert queued.wait(30)  # the stale partial waits: it joins next
        return scores

    calls: list[tuple[int, bool]] = []  # per decoder call: rows, the stale one among them
    batch = lane.batch
    execute = batch.execute

    def recorded() -> None:
        calls.append((batch.rows, any(s.hook is stale_hook for s in batch.searches)))
        execute()

    monkeypatch.setattr(batch, "execute", recorded)
    cancelled = scheduler.stats["rows_cancelled"]
    encs = [translator.encode([translator.source_ids(t)]) for t in SOURCES[1:3]]
    (other,) = scheduler.submit(encs[0], options, priority=Priority.FINAL, hook=other_hook)
    (stale,) = scheduler.submit(
        encs[1], options, priority=Priority.PARTIAL, request_id=stale_id, hook=stale_hook
    )
    queued.set()
    assert isinstance(stale.exception(30), DecodingCancelled)
    hyp = other.result(30)
    with_stale = [i for i, (_, stale_in) in enumerate(calls) if stale_in]
    assert len(with_stale) == 6  # tokens 1-5 and the one observed as the abort came
    assert with_stale == list(range(with_stale[0], with_stale[0] + 6))
    after = with_stale[-1] + 1
    assert calls[after][0] == calls[after - 1][0] - 1  # its row left before the next call
    assert all(rows == 1 for rows, _ in calls[after:])
    assert scheduler.stats["rows_cancelled"] == cancelled + 1
    ref = alone(translator, SOURCES[1], [], options)
    assert hyp.token_ids == ref.token_ids and len(hyp.token_ids) == 40


def test_an_abort_drops_a_waiting_request_and_refuses_a_later_one() -> None:
    """The abort may come before the request is admitted, or before it is even submitted
    (the worker thread was slow): a waiting one is answered with `DecodingCancelled` at
    once, while the lane is still busy; a submission with an aborted id fails at once
    (the policy's side: tests/test_scheduling_policy.py)."""
    needs_fixture()
    # One lane, held, so that it admits nothing meanwhile.
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1))
    scheduler = tr.scheduler
    release, holding = threading.Event(), threading.Event()

    def hold(rows: Sequence[Sequence[int]], scores: FloatArray) -> FloatArray:
        holding.set()
        assert release.wait(30)  # keeps the lane's thread until the checks are done
        return scores

    enc = tr.encode([tr.source_ids(SOURCES[0])])
    try:
        (blocker,) = scheduler.submit(enc, DecodeOptions(), priority=Priority.FINAL, hook=hold)
        assert holding.wait(30)
        waiting_id, late_id = new_request_id(), new_request_id()
        (waiting,) = scheduler.submit(
            enc, DecodeOptions(), priority=Priority.PARTIAL, request_id=waiting_id
        )
        assert scheduler.waiting == 1
        scheduler.abort([waiting_id, late_id])
        assert isinstance(waiting.exception(0), DecodingCancelled)
        assert scheduler.waiting == 0
        with pytest.raises(DecodingCancelled):
            scheduler.submit(enc, DecodeOptions(), priority=Priority.PARTIAL, request_id=late_id)
        assert scheduler.stats["rows_cancelled"] == 2
    finally:
        release.set()
    assert blocker.result(30).token_ids == alone(tr, SOURCES[0], [], DecodeOptions()).token_ids
    tr.close()


def test_a_closed_scheduler_refuses_work(tmp_path: Path) -> None:
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL)
    assert tr.translate(["we eat noodles"])[0].text
    tr.close()
    from engine.decoding.scheduler import SchedulerClosed

    with pytest.raises(SchedulerClosed):
        tr.translate(["we eat noodles"])


def test_a_result_that_cannot_be_built_is_that_requests_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A search that fails while its answer is built (after its row left the batch) gets
    the error rather than leaving its caller waiting for ever. The other requests and later
    calls are answered as usual."""
    needs_fixture()
    from engine.decoding.search import GreedySearch

    tr = Translator.from_dir(FIXTURE_MODEL)
    built = GreedySearch.result

    def result(self: GreedySearch) -> Hypothesis:
        if self.prefix == [5]:
            raise RuntimeError("broken result")
        return built(self)

    monkeypatch.setattr(GreedySearch, "result", result)
    ids, mask = _ids(tr, SOURCES[:2])
    enc = tr.encode([list(row[: int(m.sum())]) for row, m in zip(ids, mask, strict=True)])
    outcome: list[BaseException | list[Hypothesis]] = []

    def call() -> None:
        try:
            outcome.append(tr.decode(enc, DecodeOptions(), prefixes=[[5], []]))
        except BaseException as exc:  # what the caller gets, checked below
            outcome.append(exc)

    caller = threading.Thread(target=call, daemon=True)  # daemon: a hang fails, not blocks
    caller.start()
    caller.join(timeout=60)
    assert outcome, "the caller is still waiting for its answer"
    assert isinstance(outcome[0], RuntimeError) and "broken result" in str(outcome[0])
    assert tr.translate([SOURCES[0]])[0].text == alone_text(tr, SOURCES[0])
    tr.close()


def alone_text(tr: Translator, text: str) -> str:
    return tr.detokenize(alone(tr, text, [], DecodeOptions()).token_ids)


def test_scheduler_runs_encoder_jobs_batched() -> None:
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL)
    scheduler: DecodeScheduler = tr.scheduler
    ids, mask = _ids(tr, SOURCES)
    whole = tr.model.encode(ids, mask)
    out = scheduler.encode(ids[:1, : int(mask[0].sum())], mask[:1, : int(mask[0].sum())])
    width = int(mask[0].sum())
    assert np.allclose(out.hidden_states[0], whole.hidden_states[0, :width], atol=1e-5)


def test_a_rewrite_that_changes_the_logits_is_refused_for_lockstep(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The rewritten decoder is checked against the original before use: one whose
    numbers differ (here a weight nudged after the rewrite) is refused with one log line,
    and the model batches in lockstep, with the original graphs' results."""
    needs_fixture()
    import onnx
    from onnx import numpy_helper

    import engine.model.load as bd

    real = bd.rewrite_decoder

    def nudged(model: onnx.ModelProto, name: str = "decoder") -> onnx.ModelProto | None:
        out = real(model, name)
        if out is None:
            return None
        for init in out.graph.initializer:
            array = numpy_helper.to_array(init)
            if array.dtype == np.float32 and array.ndim == 2 and array.size > 1000:
                init.CopyFrom(numpy_helper.from_array(array + 0.05, init.name))
                break
        return out

    monkeypatch.setattr(bd, "rewrite_decoder", nudged)
    with caplog.at_level("WARNING"):
        tr = Translator.from_dir(FIXTURE_MODEL)
    assert tr.scheduler.batching == "lockstep"
    refusals = [r for r in caplog.records if "rewritten decoder differs" in r.getMessage()]
    assert len(refusals) == 1
    ref = alone(tr, SOURCES[0], [], DecodeOptions())
    assert tr.translate([SOURCES[0]])[0].token_ids == ref.token_ids


def test_a_cut_step_that_differs_from_the_whole_one_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The output projection cut apart is checked against the whole graph: a head whose
    numbers differ (here its bias nudged) is refused with one warning each for the step,
    the step in place and the prefill, which then run whole, continuous batching
    unchanged."""
    needs_fixture()
    import onnx
    from onnx import numpy_helper

    import engine.model.cut as bd
    from engine.model.passes.head import HeadSplit

    real = bd.split_output_projection

    def nudged(data: bytes, vocab: int, logits: str = "logits") -> HeadSplit | None:
        split = real(data, vocab, logits)
        assert split is not None
        head = onnx.load_from_string(split.head)
        bias = next(i for i in head.graph.initializer if "bias" in i.name)
        bias.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(bias) + 0.5, bias.name))
        return HeadSplit(split.body, head.SerializeToString(), split.hidden)

    monkeypatch.setattr(bd, "split_output_projection", nudged)
    cut(monkeypatch)
    with caplog.at_level("WARNING"):
        tr = Translator.from_dir(FIXTURE_MODEL, scheduler=HEAD_APART)
    assert tr.scheduler.batching == "continuous"
    assert tr.model.masked is not None and tr.model.masked.head is None
    assert tr.model.masked.prefills.head is None
    assert isinstance(tr.model.kv, InPlaceSteps) and tr.model.kv.graph.head is None
    refusals = sorted(
        r.getMessage().split()[1] for r in caplog.records if "kept whole" in r.getMessage()
    )
    assert refusals == ["in-place", "prefill", "step"]
    ref = alone(tr, SOURCES[0], [], DecodeOptions())
    assert tr.translate([SOURCES[0]])[0].token_ids == ref.token_ids


def test_a_small_projection_stays_in_its_graphs_whatever_the_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fixture's output projection (64 x 999 weights, under `SMALL_PROJECTION`) stays
    inside the step's, the prefill's and the in-place step's graphs even where a lane
    alone may project on both cores: a call of its own would cost more than the threads
    and the positions skipped save. The answers equal decoding alone; with the threshold
    at 0 the same load cuts all three, as it does a larger model's."""
    needs_fixture()
    options = SchedulerOptions(cores=2, lanes=2)
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=options)
    masked, steps = tr.model.masked, tr.model.kv
    assert masked is not None and isinstance(steps, InPlaceSteps)
    assert tr.model.options.alone_head_threads == 2
    assert masked.steps.head is masked.prefills.head is steps.graph.head is None
    assert masked.steps.alone is None
    for text in SOURCES[:3]:
        got, ref = tr.translate([text])[0], alone(tr, text, [], DecodeOptions())
        assert got.token_ids == ref.token_ids
        assert got.score == pytest.approx(ref.score, abs=SCORE_TOLERANCE)
    tr.close()
    cut(monkeypatch)
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=options)
    masked, steps = tr.model.masked, tr.model.kv
    assert masked is not None and isinstance(steps, InPlaceSteps)
    assert None not in (masked.steps.head, masked.prefills.head, steps.graph.head)
    tr.close()


def test_two_lanes_share_the_work_and_give_the_same_results() -> None:
    needs_fixture()
    # A small prefill budget: one lane cannot take the whole burst in its first turns
    # before the other lane's thread has started (which, on a loaded machine, it did).
    options = SchedulerOptions(lanes=2, prefill_positions=8)
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=options)
    assert (tr.scheduler.lanes, tr.scheduler.threads_per_lane) == (2, 1)
    todo = requests(tr) * 3
    expected = [alone(tr, text, prefix, DecodeOptions()) for text, prefix in todo]
    gate = threading.Barrier(len(todo))

    def one(item: tuple[str, list[int]]) -> Hypothesis:
        text, prefix = item
        enc = tr.encode([tr.source_ids(text)])
        gate.wait()
        return tr.decode(enc, prefixes=[prefix])[0]

    with ThreadPoolExecutor(len(todo)) as pool:
        got = list(pool.map(one, todo))
    assert [h.token_ids for h in got] == [r.token_ids for r in expected]
    for h, r in zip(got, expected, strict=True):
        assert h.score == pytest.approx(r.score, abs=1e-4)
    steps = [lane.stats["decoder_steps"] for lane in tr.scheduler._lanes]
    assert all(steps), steps  # both lanes decoded


@pytest.mark.parametrize("quantized", [False, True])
def test_a_lane_alone_projects_on_every_core_with_the_same_results(
    quantized: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two lanes of one thread: a lane that runs alone gives its output projection both
    cores (one session shared by steps, prefills and one-token steps, checked at load
    against each graph's own), a lane with company its own thread; the answers equal
    decoding alone either way."""
    needs_fixture()
    cut(monkeypatch)
    tr = Translator.from_dir(
        FIXTURE_MODEL, scheduler=SchedulerOptions(cores=2, lanes=2), quantized=quantized
    )
    masked = tr.model.masked
    assert masked is not None and tr.model.options.alone_head_threads == 2
    alone_head = masked.steps.alone
    assert alone_head is not None and masked.prefills.alone is alone_head
    # int8: a one-row step runs the files' quantization, whose projection of one token is
    # the per-token one's.
    assert (masked.one_token is not None) == quantized
    assert masked.one_token is None or masked.one_token.alone is alone_head
    # A lane with company projects on its own thread, with one session for the prefill
    # and the step too: one copy of the projection's weights, which a lane's prefill
    # leaves in the cache for its next step.
    lane_head = masked.steps.head
    assert lane_head is not None and masked.prefills.head is not None
    assert masked.prefills.head[0] is lane_head[0]
    session = alone_head[0]
    calls = []

    def counted(call: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(threading.current_thread().name)
            return call(*args, **kwargs)

        return run

    session.run = counted(session.run)  # type: ignore[method-assign]  # steps
    # prefills (bound calls)
    session.run_with_iobinding = counted(session.run_with_iobinding)  # type: ignore[method-assign]
    for text in SOURCES:  # one request at a time: its lane is alone
        got = tr.translate([text])[0]
        ref = alone(tr, text, [], DecodeOptions())
        assert got.token_ids == ref.token_ids
        assert got.score == pytest.approx(ref.score, abs=SCORE_TOLERANCE)
    assert len(calls) >= sum(len(alone(tr, t, [], DecodeOptions()).token_ids) for t in SOURCES)
    tr.close()


def test_a_shared_head_the_load_check_refuses_gives_way_to_the_graphs_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefill takes the step's projection on the lane's threads only where the load's
    check says it gives the prefill's own values; refused, the prefill opens its own
    (still cut apart, so that it projects only the positions a search reads) and the
    answers are unchanged."""
    needs_fixture()
    from engine.model.checks import check_cut as real

    seen: set[int] = set()
    refused: list[object] = []

    def check(
        whole: Any, body: Any, head: Any, hidden: str, head_input: str | None = None, **kw: Any
    ) -> float:
        if id(head) in seen and head_input is None and not refused:
            refused.append(head)  # the first graph offered another's lane head
            return float("inf")
        seen.add(id(head))
        return float(real(whole, body, head, hidden, head_input, **kw))

    monkeypatch.setattr("engine.model.cut.check_cut", check)
    cut(monkeypatch)
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(cores=2, lanes=2))
    masked = tr.model.masked
    assert masked is not None and masked.steps.head is not None
    assert refused == [masked.steps.head[0]]
    assert masked.prefills.head is not None
    assert masked.prefills.head[0] is not masked.steps.head[0]
    for text in SOURCES:
        assert tr.translate([text])[0].token_ids == alone(tr, text, [], DecodeOptions()).token_ids
    tr.close()


def test_sources_given_as_ids_are_encoded_by_the_admitting_lane_once(
    translator: Translator,
) -> None:
    """An `Encoding` is encoded on the way, in the turn its request joins (no encoder trip
    of its own), and a later decode of the same `Encoding` reuses the states."""
    text = SOURCES[1]
    ref = alone(translator, text, [], DecodeOptions())
    pending = translator.encoding([translator.source_ids(text)])
    assert pending.encoded is None
    before = translator.scheduler.stats["encoder_calls"]
    assert translator.decode(pending)[0].token_ids == ref.token_ids
    assert pending.encoded is not None
    assert translator.scheduler.stats["encoder_calls"] == before + 1
    assert translator.decode(pending)[0].token_ids == ref.token_ids
    assert translator.scheduler.stats["encoder_calls"] == before + 1  # reused


def test_a_burst_is_prefilled_in_calls_within_the_position_budget() -> None:
    """`prefill_positions` bounds one prefill call; a request longer than the budget still
    joins alone. Results do not change."""
    needs_fixture()
    budget = SchedulerOptions(lanes=1, prefill_positions=8)
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=budget)
    todo = requests(tr) * 2
    expected = [alone(tr, text, prefix, DecodeOptions()) for text, prefix in todo]
    calls = tr.scheduler.stats["prefill_calls"]
    gate = threading.Barrier(len(todo))

    def one(item: tuple[str, list[int]]) -> Hypothesis:
        text, prefix = item
        enc = tr.encode([tr.source_ids(text)])
        gate.wait()
        return tr.decode(enc, prefixes=[prefix], drafts=[[5] * 6])[0]

    with ThreadPoolExecutor(len(todo)) as pool:
        got = list(pool.map(one, todo))
    assert [h.token_ids for h in got] == [r.token_ids for r in expected]
    # Each request feeds at least 7 positions (start token and a 6-token draft): at most
    # one fits in a budget of 8, so every request had a prefill call of its own.
    assert tr.scheduler.stats["prefill_calls"] - calls == len(todo)
    tr.close()


def test_thread_counts_are_set_in_one_place() -> None:
    # (lanes, threads per lane, threads of a step's output projection, and of the
    # projection of a lane that runs alone)
    # Several lanes: each projects on its own threads (the cores are the lanes' already),
    # on all of them while the others are idle.
    assert SchedulerOptions().resolved(2) == (2, 1, 1, 2)
    assert SchedulerOptions().resolved(16) == (2, 8, 8, 16)
    assert SchedulerOptions(lanes=4).resolved(16) == (4, 4, 4, 16)
    assert SchedulerOptions(cores=4).resolved() == (2, 2, 2, 4)
    assert SchedulerOptions(cores=2, head_threads=2).resolved() == (2, 1, 2, 2)
    # One lane: the projection gets the whole share.
    assert SchedulerOptions().resolved(1) == (1, 1, 1, 1)
    assert SchedulerOptions(lanes=1, threads_per_lane=3).resolved(2) == (1, 3, 3, 3)
    assert SchedulerOptions(lanes=1).resolved(2) == (1, 2, 2, 2)
    assert SchedulerOptions(lanes=1, threads_per_lane=1).resolved(4) == (1, 1, 4, 4)
    with pytest.raises(ValueError, match="cores"):
        SchedulerOptions(cores=0)
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(cores=2))
    assert (tr.model.options.intra_op_threads, tr.model.options.head_threads) == (1, 1)
    tr.close()
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(cores=2, lanes=1))
    assert (tr.model.options.intra_op_threads, tr.model.options.head_threads) == (2, 2)


def test_models_sharing_the_cores_split_them_instead_of_oversubscribing() -> None:
    """Fan-out loads one scheduler per target language; together they must not run more
    calls at once than there are cores."""
    for cores in (1, 2, 3, 4, 16):
        for models in (1, 2, 3):
            share = model_share(cores, models)
            lanes, threads, head, alone = SchedulerOptions(cores=share).resolved()
            assert lanes * threads * models <= max(cores, models), (cores, models)
            assert head * models <= max(cores, models), (cores, models)
            assert alone * models <= max(cores, models), (cores, models)
    assert SchedulerOptions(cores=model_share(2, 2)).resolved() == (1, 1, 1, 1)
    assert SchedulerOptions(cores=model_share(16, 2)).resolved() == (2, 4, 4, 8)


# -- draft verification ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["accepted", "longer", "rejected", "partly"])
def test_a_draft_changes_nothing_but_the_steps(translator: Translator, kind: str) -> None:
    """Whatever the draft (the true continuation, longer than it, wrong from its first
    token, right for a while), the result is plain greedy decoding's; only the number of
    stepwise decoder calls changes, by the tokens the draft got right: in the prefill
    (its run from the start) and, re-aligned, in later steps (lookahead)."""
    for text, prefix in requests(translator):
        ref = alone(translator, text, prefix, DecodeOptions())
        tail = list(ref.token_ids[len(prefix) :])
        wrong = (tail[0] + 1) % translator.config.vocab_size if tail else 5
        draft = {
            "accepted": tail,
            "longer": [*tail, 7, 8, 9],
            "rejected": [wrong, *tail],
            "partly": [*tail[:2], wrong, *tail[3:]],
        }[kind]
        enc = translator.encode([translator.source_ids(text)])
        before = translator.scheduler.stats
        hyp = translator.decode(enc, prefixes=[prefix], drafts=[draft])[0]
        after = translator.scheduler.stats
        assert hyp.token_ids == ref.token_ids, (kind, text, prefix)
        assert hyp.finished == ref.finished
        assert hyp.score == pytest.approx(ref.score, abs=SCORE_TOLERANCE)
        if translator.scheduler.batching != "continuous":
            continue
        accepted = after["draft_accepted"] - before["draft_accepted"]
        steps = after["decoder_steps"] - before["decoder_steps"]
        expected = {
            "accepted": len(tail),
            "longer": len(tail),
            "rejected": 0,
            "partly": min(2, len(tail)),
        }[kind]
        assert accepted == expected, (kind, text, prefix)
        ahead = after["lookahead_accepted"] - before["lookahead_accepted"]
        # The prefill gives the token after the confirmed ones; every later token and
        # the eos after the last cost one step each, less those a step confirmed ahead.
        assert steps == len(tail) - accepted - ahead, (kind, steps, ahead)
        if kind == "rejected" and len(tail) > 1 and translator.model.masked.lookahead:
            # The draft is the answer shifted by one: re-aligned after its first token,
            # each step confirms LOOKAHEAD tokens and gives the one after them.
            assert steps == -(-len(tail) // (LOOKAHEAD + 1)), (text, prefix, steps)


@pytest.mark.parametrize(
    ("fixture", "log"),
    [
        ("prefix", "fixture_en_zh"),
        ("prefix", "fixture_en_zh_asr"),
        ("offline", "fixture_en_zh"),
        ("offline", "fixture_offline_en_zh_asr"),
    ],
)
def test_replay_with_drafts_gives_the_same_updates_in_fewer_steps(fixture: str, log: str) -> None:
    """Every committed fixture and log: the same updates (stable and tentative text) with
    and without drafts, in fewer decoder steps; on the offline-trained fixture, whose
    partial translations are revised (not only extended), in at most half as many once the
    re-aligned draft is verified ahead (lookahead). The prefix-trained fixture's updates
    mostly add tokens no earlier hypothesis had (examples/benchmarks/draft_bound.py)."""
    needs_fixture()
    from engine.logs.format import read_log
    from engine.replay import ReplayOptions, replay
    from engine.streaming.session import StreamingOptions
    from tests.conftest import FIXTURE_MODELS, ROOT

    lines = read_log(ROOT / "examples" / "logs" / f"{log}.jsonl")
    shown, steps = {}, {}
    for drafts in (False, True):
        tr = Translator.from_dir(FIXTURE_MODELS[fixture], scheduler=SchedulerOptions(lanes=1))
        options = ReplayOptions(streaming=StreamingOptions(drafts=drafts), progress=False)
        result = replay(tr, lines, options)
        shown[drafts] = [
            (u.update.seq, u.update.stable_text, u.update.unstable_text) for u in result.updates
        ]
        steps[drafts] = result.counts["decoder_steps"]  # the finals' offline check left out
        if drafts:
            assert result.counts["draft_accepted"] > 0
    assert shown[True] == shown[False]
    assert steps[True] < steps[False]
    if fixture == "offline":
        assert 2 * steps[True] <= steps[False], steps


def _drafts(tail: list[int], vocab: int) -> dict[str, list[int]]:
    """Drafts a revision could leave: the answer shifted by a word put in front, every
    token followed by a wrong one (each lookahead fails at its first token), the answer
    with its middle dropped, and none."""
    wrong = [(t + 1) % vocab for t in tail]
    return {
        "shifted": [wrong[0], *tail],
        "interleaved": [x for pair in zip(tail, wrong, strict=True) for x in pair],
        "dropped": [*tail[:1], *tail[3:]],
        "none": [],
    }


def drafted_searches(translator: Translator) -> list[tuple[Hypothesis, Search, str]]:
    """Eight searches with drafts of every kind `_drafts` makes, each with what decoding it
    alone gives and its source: long rows (tokens forced past the fixture's eos), so that
    a batch's lookahead is rejected often."""
    config = translator.model.config
    options = DecodeOptions(min_new_tokens=12, max_new_tokens=16)
    todo = []
    for i, (text, prefix) in enumerate(requests(translator)[:8]):
        ref = alone(translator, text, prefix, options)
        tail = list(ref.token_ids[len(prefix) :])
        kinds = _drafts(tail, config.vocab_size)
        draft = list(kinds.values())[i % len(kinds)]
        todo.append((ref, make_search(config, prefix, options, None, draft), text))
    return todo


def test_lookahead_rows_join_and_leave_a_running_batch(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows whose re-aligned drafts are verified several tokens per cached step (lookahead)
    share steps with rows that take one, join at different steps, and each still gets what
    decoding it alone gives; rejected lookahead leaves holes in the cache that are
    squeezed out without changing anything."""
    from engine.decoding.batch import Member
    from engine.decoding.continuous import ContinuousBatch
    from engine.model.kv.arrays import RowState
    from engine.model.kv.copied import CopiedKv

    model = translator.model
    if model.masked is None or not model.masked.lookahead:
        pytest.skip("no lookahead for this layout")
    squeezed = []
    squeeze = RowState.squeeze

    def counted(self: RowState) -> None:
        squeezed.append(self.real.shape[1])
        squeeze(self)

    monkeypatch.setattr(RowState, "squeeze", counted)
    todo = drafted_searches(translator)
    batch = ContinuousBatch(model, CopiedKv(model, model.masked), LOOKAHEAD_POSITIONS)
    joins = {0: todo[:2], 1: todo[2:3], 3: todo[3:6], 6: todo[6:]}
    step = 0
    while step in joins or step < max(joins) or len(batch):
        batch.update()
        members = joins.get(step, [])
        batch.schedule(
            [Member(s, translator.encode([translator.source_ids(t)])) for _, s, t in members]
        )
        batch.execute()
        step += 1
    for ref, s, text in todo:
        got = s.result()
        assert got.token_ids == ref.token_ids, (text, s.draft)
        assert got.score == pytest.approx(ref.score, abs=SCORE_TOLERANCE)
    assert 0 < batch.stats["lookahead_accepted"] < batch.stats["lookahead_offered"]
    assert squeezed, "no holes to squeeze"


def test_lookahead_is_the_schedulers_to_turn_off() -> None:
    """`SchedulerOptions.lookahead_positions=0`: the draft is verified in the prefill only,
    every later token costs a step, and the answer is the same."""
    needs_fixture()
    tr = Translator.from_dir(
        FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1, lookahead_positions=0)
    )
    for text, prefix in requests(tr)[:4]:
        ref = alone(tr, text, prefix, DecodeOptions())
        tail = list(ref.token_ids[len(prefix) :])
        enc = tr.encode([tr.source_ids(text)])
        before = tr.scheduler.stats
        hyp = tr.decode(
            enc, prefixes=[prefix], drafts=[_drafts(tail, tr.config.vocab_size)["shifted"]]
        )[0]
        after = tr.scheduler.stats
        assert hyp.token_ids == ref.token_ids
        assert after["lookahead_offered"] == before["lookahead_offered"]
        assert after["decoder_steps"] - before["decoder_steps"] == len(tail)


def test_the_prefill_projects_only_the_positions_a_search_reads(translator: Translator) -> None:
    """Logits of a forced prefix before its last token are never read: with `needed_from`
    they are not computed (zeros), and the others are what the whole call gives."""
    masked = translator.model.masked
    assert masked is not None
    if masked.prefills.head is None:
        pytest.skip("the projection runs inside the prefill's graph")
    config = translator.config
    enc = translator.encode([translator.source_ids(SOURCES[2])])
    forced = alone(translator, SOURCES[2], [], DecodeOptions()).token_ids[:4]
    ids = np.array([[config.decoder_start_token_id, *forced]], dtype=np.int64)
    mask = np.ones_like(ids)
    whole_rows, self_kv, _ = masked.prefill(enc, ids, mask)
    part_rows, part_kv, _ = masked.prefill(enc, ids, mask, np.array([3]))
    whole, part = whole_rows.dense(ids.shape[1]), part_rows.dense(ids.shape[1])
    assert part_rows.values.shape[0] == ids.shape[1] - 3  # only those read were computed
    assert not np.any(part[0, :3]) and np.all(np.any(whole[0] != 0, axis=-1))
    np.testing.assert_allclose(part[0, 3:], whole[0, 3:], atol=1e-5, rtol=0)
    for a, b in zip(self_kv, part_kv, strict=True):
        np.testing.assert_array_equal(a, b)


def two_forced_rows(tr: Translator) -> tuple[EncoderOutput, np.ndarray, np.ndarray]:
    """Two sources' encoder states, and the start token with the first 7 tokens of each
    one's own translation as prefill rows (right-padded to 8, `mask` 1 where real)."""
    sources = [tr.source_ids(s) for s in SOURCES[:2]]
    enc = tr.encode(sources)
    forced = [alone(tr, s, [], DecodeOptions()).token_ids[:7] for s in SOURCES[:2]]
    ids = np.zeros((2, 8), dtype=np.int64)
    mask = np.zeros_like(ids)
    for r, tokens in enumerate(forced):
        ids[r, : 1 + len(tokens)] = [tr.config.decoder_start_token_id, *tokens]
        mask[r, : 1 + len(tokens)] = 1
    return enc, ids, mask


def test_the_projection_runs_in_bounded_calls_with_the_same_logits(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill's projection runs `HEAD_POSITIONS` at a time (ONNX Runtime's arena keeps
    the largest buffers it served): more calls, the same logits, packed by row."""
    from engine.model import logits as layouts

    masked = translator.model.masked
    assert masked is not None
    if masked.prefills.head is None:
        pytest.skip("the projection runs inside the prefill's graph")
    config = translator.config
    enc, ids, mask = two_forced_rows(translator)
    needed = np.array([2, 1])
    one_call, _, _ = masked.prefill(enc, ids, mask, needed)
    session, _ = masked.prefills.head
    runs: list[int] = []
    real_run = session.run_with_iobinding
    monkeypatch.setattr(
        session, "run_with_iobinding", lambda b, *a: (runs.append(1), real_run(b, *a))[1]
    )
    monkeypatch.setattr(layouts, "HEAD_POSITIONS", 3)
    chunked, _, _ = masked.prefill(enc, ids, mask, needed)
    wanted = int(mask.sum() - needed.sum())
    assert chunked.values.shape[0] == wanted and len(runs) == -(-wanted // 3)
    np.testing.assert_allclose(chunked.values, one_call.values, atol=1e-5, rtol=0)
    for r in range(2):
        end = int(mask[r].sum())
        assert len(chunked.row(r, int(needed[r]))) == end - needed[r]
        np.testing.assert_array_equal(chunked.row(r, end - 1)[0], chunked.dense(8)[r, end - 1])
        with pytest.raises(IndexError):
            chunked.row(r, int(needed[r]) - 1)
        with pytest.raises(IndexError):
            chunked.row(r, end - 1)[1]
    gaps = np.array([[True, False, True]])
    with pytest.raises(ValueError, match="consecutive"):
        layouts.project(masked.prefills.head, np.zeros((1, 3, config.d_model), np.float32), gaps)


def test_a_prefill_projects_a_chunk_when_a_search_first_reads_it(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The projection of a prefill runs when its positions are read, a chunk at a time
    into one buffer per thread: nothing is projected past where every search stopped,
    and a chunk another prefill's reads displaced is projected again, with the same
    values."""
    import threading

    from engine.model import logits as layouts

    masked = translator.model.masked
    assert masked is not None
    if masked.prefills.head is None:
        pytest.skip("the projection runs inside the prefill's graph")
    config = translator.config
    enc, ids, mask = two_forced_rows(translator)
    needed = np.array([1, 2])
    expected = masked.prefill(enc, ids, mask, needed)[0].values  # every position, at once
    calls: list[int] = []
    projections: list[object] = []  # the projection of each call
    real_into = layouts._Projected._into

    def counted(self: object, begin: int, out: np.ndarray, *owner: np.ndarray | None) -> None:
        calls.append(len(out))
        projections.append(self)
        real_into(self, begin, out, *owner)  # type: ignore[arg-type]

    monkeypatch.setattr(layouts._Projected, "_into", counted)
    monkeypatch.setattr(layouts, "HEAD_POSITIONS", 3)
    lazy = masked.prefill(enc, ids, mask, needed)[0]
    assert calls == []  # nothing before a read
    first = lazy.row(0, 1)
    np.testing.assert_array_equal(first[0], expected[0])
    np.testing.assert_array_equal(first[2], expected[2])
    assert calls == [3]  # one chunk for positions 0-2 of the packed run
    np.testing.assert_array_equal(first[3], expected[3])
    assert calls == [3, 3]
    other = masked.prefill(enc, ids, mask, needed)[0]
    np.testing.assert_array_equal(other.row(1, 2)[0], expected[int(lazy.offsets[1])])
    np.testing.assert_array_equal(first[3], expected[3])  # its chunk was displaced
    assert len(calls) == 4
    seen: list[np.ndarray] = []
    last = len(lazy.row(1, 2)) - 1
    worker = threading.Thread(target=lambda: seen.append(lazy.row(1, 2)[last].copy()))
    worker.start()
    worker.join()
    np.testing.assert_array_equal(seen[0], expected[int(lazy.offsets[1]) + last])
    np.testing.assert_array_equal(first[3], expected[3])  # another thread, its own buffer
    assert len(calls) == 5

    # A draft rejected at its first token: the search stops there, and the prefill's
    # positions past its first chunk are never projected.
    text = SOURCES[0]
    tail = list(alone(translator, text, [], DecodeOptions()).token_ids)
    wrong = (tail[0] + 1) % config.vocab_size
    calls.clear()
    projections.clear()
    enc_one = translator.encode([translator.source_ids(text)])
    hyp = translator.decode(enc_one, drafts=[[wrong, *tail, *tail]])[0]
    assert list(hyp.token_ids) == tail
    assert projections and projections.count(projections[0]) == 1 and calls[0] == 3, calls


def test_a_timeline_records_every_lane_turn_when_asked() -> None:
    """`DecodeScheduler.timeline`: each lane turn with its parts and rows (off by default)."""
    from engine.decoding.timeline import Timeline, format_summary, summary

    needs_fixture()
    translator = Translator.from_dir(FIXTURE_MODEL)
    try:
        scheduler = translator.scheduler
        assert scheduler.timeline is None
        scheduler.timeline = Timeline()
        translator.translate(["I will meet Tom at three", "Tom reads a book"])
        steps = scheduler.timeline.steps()
        assert steps and all(s.lane in range(scheduler.lanes) for s in steps)
        assert sum(s.encode_rows for s in steps) == 2  # one encoder call for both
        assert sum(s.joined for s in steps) == 2 and max(s.rows for s in steps) >= 1
        assert all(s.execute >= 0 and s.update >= 0 and s.waited >= 0 for s in steps)
        answered = scheduler.timeline.answered()
        assert len(answered) == 2 and not any(a.partial for a in answered)
        assert all(a.queued >= 0 and a.compute > 0 and a.past_draft >= 1 for a in answered)
        result = summary(steps, answered)
        assert result["steps"] == len(steps) and result["rows_p50"] >= 1
        assert result["partials_by_past_draft"] == []  # offline calls are not partials
        assert "rows per decoder call" in format_summary(result)
    finally:
        translator.close()


def test_partials_requests_are_grouped_by_the_tokens_they_decoded_past_their_draft() -> None:
    """`timeline.by_past_draft`: each partial's request in the band of its tokens past the
    draft, with its own times; finals' requests stay out unless asked for."""
    from engine.decoding.timeline import Answered, by_past_draft

    answered = [
        Answered(0, True, 0.010, 0.050, 0),
        Answered(1, True, 0.030, 0.070, 1),
        Answered(0, True, 0.000, 0.400, 9),
        Answered(0, False, 0.000, 0.900, 30),
    ]
    bands = by_past_draft(answered)
    assert [(b["tokens"], b["requests"]) for b in bands] == [("0-1", 2), ("8-15", 1)]
    assert bands[0]["compute_ms_p50"] == 70.0 and bands[0]["queued_ms_p50"] == 30.0
    assert bands[1]["compute_ms_p95"] == 400.0
    assert [b["tokens"] for b in by_past_draft(answered, partial=False)] == ["16+"]


def _hold_the_lane(tr: Translator) -> tuple[threading.Event, threading.Event]:
    """Submit a decode whose hook stops the lane at its first step (its prefill done)
    until `release` is set; returns (held, release) once the lane is held."""
    held, release = threading.Event(), threading.Event()

    def hold(rows: Sequence[Sequence[int]], scores: FloatArray) -> FloatArray:
        if len(rows[0]) == 1 and not held.is_set():
            held.set()
            assert release.wait(30)
        return scores

    enc = tr.encode([tr.source_ids(SOURCES[0])])
    tr.scheduler.submit(enc, DecodeOptions(), priority=Priority.FINAL, hook=hold)
    assert held.wait(30)
    return held, release


def test_a_prefill_takes_newcomers_of_about_its_length_and_leaves_the_others() -> None:
    """Rows of one prefill are padded to the longest, and padding costs what real
    positions do: a newcomer that would add more than `PREFILL_PADDING` padding positions
    waits for a call of its own, even when one that came after it joins. Results do not
    change."""
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1))
    todo = [(SOURCES[3], [5]), (SOURCES[4], [5] * 30), (SOURCES[1], [5] * 2)]
    assert 1 <= PREFILL_PADDING < 31 - 2  # the long one pads the first by 29 positions
    expected = [alone(tr, text, [], DecodeOptions()) for text, _ in todo]
    encs = [tr.encode([tr.source_ids(text)]) for text, _ in todo]
    _, release = _hold_the_lane(tr)
    before = tr.scheduler.stats
    futures = [
        tr.scheduler.submit(enc, DecodeOptions(), priority=Priority.FINAL, drafts=[draft])[0]
        for enc, (_, draft) in zip(encs, todo, strict=True)
    ]
    time.sleep(0.05)  # all three wait while the lane is held
    release.set()
    got = [future.result(30) for future in futures]
    assert [h.token_ids for h in got] == [r.token_ids for r in expected]
    after = tr.scheduler.stats
    # The first and the third (2 and 3 positions) shared a call; the 31-position one had
    # its own.
    assert after["prefill_calls"] - before["prefill_calls"] == 2
    assert after["prefill_rows"] - before["prefill_rows"] == 3
    tr.close()


@pytest.mark.parametrize("draft_kind", ["confirmed", "rejected"])
def test_an_abort_lets_a_row_that_confirmed_its_whole_draft_finish(draft_kind: str) -> None:
    """A running row whose prefill confirmed its whole draft has only the tokens past it
    left, its prefill spent: an abort lets it finish with its answer (counted in
    `rows_finished_on_abort`). A row whose draft was rejected still leaves at the next
    step."""
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1))
    text = SOURCES[4]
    ref = alone(tr, text, [], DecodeOptions())
    tokens = list(ref.token_ids)
    assert len(tokens) > 4
    draft = tokens[:-3] if draft_kind == "confirmed" else [(tokens[0] + 1) % 50, *tokens[1:-3]]
    request_id = new_request_id()
    steps: list[int] = []

    def hook(rows: Sequence[Sequence[int]], scores: FloatArray) -> FloatArray:
        steps.append(len(rows[0]))
        if len(rows[0]) == len(draft) + 1:  # the first step after the prefill's tokens
            tr.abort([request_id])  # a newer partial of its stream arrived
        return scores

    enc = tr.encode([tr.source_ids(text)])
    before = tr.scheduler.stats
    (future,) = tr.scheduler.submit(
        enc,
        DecodeOptions(),
        priority=Priority.PARTIAL,
        request_id=request_id,
        hook=hook,
        drafts=[draft],
    )
    after_abort = before["rows_finished_on_abort"]
    if draft_kind == "confirmed":
        assert future.result(30).token_ids == ref.token_ids
        assert tr.scheduler.stats["rows_finished_on_abort"] == after_abort + 1
    else:
        assert isinstance(future.exception(30), DecodingCancelled)
        assert tr.scheduler.stats["rows_finished_on_abort"] == after_abort
        assert max(steps) <= len(draft) + 2  # it left at the step after the abort
    tr.close()


def test_a_request_that_ends_in_its_prefill_is_answered_before_the_lanes_next_step() -> None:
    """Most partials end in their prefill (their draft was the whole answer): their callers
    get the answer before the lane steps its other rows, not a step later."""
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1))
    if tr.scheduler.batching != "continuous":
        pytest.skip("lockstep batching")
    long_text, short_text = SOURCES[4], SOURCES[3]
    whole = list(alone(tr, short_text, [], DecodeOptions()).token_ids)
    lane = tr.scheduler._lanes[0]
    short: list[Future[Hypothesis]] = []
    seen: list[tuple[int, bool]] = []  # at each step: prefill calls so far, short answered
    step = lane.batch.execute

    def execute() -> None:
        seen.append((lane.stats["prefill_calls"], bool(short) and short[0].done()))
        step()

    lane.batch.execute = execute  # type: ignore[method-assign]
    held = threading.Event()
    go = threading.Event()

    def hold(rows: Sequence[Sequence[int]], scores: FloatArray) -> FloatArray:
        if len(rows[0]) == 3:  # the long row runs: wait until the short one waits
            held.set()
            assert go.wait(30)
            deadline = time.monotonic() + 5
            while not tr.scheduler.waiting and time.monotonic() < deadline:
                time.sleep(0.0005)
        return scores

    enc = tr.encode([tr.source_ids(long_text)])
    short_enc = tr.encode([tr.source_ids(short_text)])  # the lane is held below
    options = DecodeOptions(min_new_tokens=12, max_new_tokens=12)
    (long,) = tr.scheduler.submit(enc, options, priority=Priority.FINAL, hook=hold)
    assert held.wait(30)
    prefills = lane.stats["prefill_calls"]
    partial = Priority.PARTIAL
    short.extend(tr.scheduler.submit(short_enc, DecodeOptions(), priority=partial, drafts=[whole]))
    go.set()
    assert list(short[0].result(30).token_ids) == whole
    long.result(30)
    joined = [done for calls, done in seen if calls == prefills + 1]
    assert joined and joined[0], seen  # the step of the turn it joined came after its answer


def test_encoder_jobs_of_different_widths_share_one_call_with_their_own_states() -> None:
    """A lane's encoder jobs run in one call over their rows right-padded to the widest;
    each job gets its own rows at its own width, what encoding it alone gives (padding is
    masked), and a lone job its own arrays as they are."""
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1))
    scheduler = tr.scheduler
    jobs = [
        tr.encoding([tr.source_ids(SOURCES[3])]),
        tr.encoding([tr.source_ids(SOURCES[4]), tr.source_ids(SOURCES[5])]),
        tr.encoding([tr.source_ids(SOURCES[0])]),
    ]
    lane = scheduler._lanes[0]
    before = lane.stats["encoder_calls"]
    scheduler._run_encodes(lane, jobs)
    assert lane.stats["encoder_calls"] == before + 1
    for job in jobs:
        got = job.future.result(0)
        assert got.hidden_states.shape[:2] == job.input_ids.shape
        assert np.array_equal(got.attention_mask, job.attention_mask)
        own = tr.model.encode(job.input_ids, job.attention_mask)
        real = job.attention_mask.astype(bool)
        assert np.allclose(got.hidden_states[real], own.hidden_states[real], atol=1e-5)
    lone = tr.encoding([tr.source_ids(SOURCES[1])])
    scheduler._run_encodes(lane, [lone])
    own = tr.model.encode(lone.input_ids, lone.attention_mask)
    assert np.array_equal(lone.future.result(0).hidden_states, own.hidden_states)


def test_a_submission_wakes_one_idle_lane_not_every_lane() -> None:
    """Two idle lanes and one request at a time: one lane wakes for it, runs it and looks
    once more for work before it waits again; the other sleeps on. Waking every lane per
    submission woke the others for nothing (each a thread switch and a turn of the lock)."""
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=2))
    scheduler = tr.scheduler
    sources = [tr.source_ids(text) for text in SOURCES]
    encoded = [tr.encode([source]) for source in sources]  # the lanes have started
    policy = scheduler._policy
    has_work = policy.has_work
    idle_checks = 0

    def counted(lane: int) -> bool:
        nonlocal idle_checks
        found = has_work(lane)
        idle_checks += not found
        return found

    time.sleep(0.2)  # both lanes wait
    policy.has_work = counted  # type: ignore[method-assign]
    rounds = 12
    for i in range(rounds):
        tr.decode(encoded[i % len(encoded)])
        time.sleep(0.01)  # the lane that ran it waits again
    policy.has_work = has_work  # type: ignore[method-assign]
    # One look that finds nothing per request (the lane that ran it, before it waits);
    # a lane woken for nothing adds one more each time.
    assert idle_checks <= rounds + 2, idle_checks


@pytest.mark.parametrize("delay_ms", [0.0, 200.0])
def test_partials_a_few_ms_apart_share_one_encoder_call_with_the_batch_delay(
    delay_ms: float,
) -> None:
    """Two streams' partials, a pair every 10 ms, to an idle lane: without the batch delay
    each pair has one encoder call and one prefill of its own; with it, the lane holds
    them all and runs them in one call of each once the delay has run out. The results
    are those of each decoded alone.

    The policy's clock is the test's (10 ms a pair, frozen in between) and each pair is
    queued at once (under the scheduler's lock), so that what the lane sees and decides
    does not hang on how the OS schedules the threads: on the real clock, a test thread
    or a lane late by tens of ms under load changed the outcome (a pair that found the
    previous one still running joined its batch; a silence ended the hold early)."""
    needs_fixture()
    options = SchedulerOptions(lanes=1, batch_delay_ms=delay_ms)
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=options)
    scheduler = tr.scheduler
    now = [0.0]
    scheduler.clock = lambda: now[0]
    texts = SOURCES[:5]
    expected = [alone(tr, text, [], DecodeOptions()).token_ids for text in texts]
    stats = scheduler.stats
    futures: list[Future[Hypothesis]] = []
    for i, text in enumerate(texts):
        now[0] = i * 0.01
        pair: list[Future[Hypothesis]] = []
        with scheduler._cond:  # the lane looks once both are queued: the second finds the first
            for _ in range(2):
                enc = tr.encoding([tr.source_ids(text)])
                pair += scheduler.submit(enc, DecodeOptions(), priority=Priority.PARTIAL)
        if not delay_ms:  # answered at once: the next pair finds the lane idle
            for future in pair:
                future.result(30)
        futures += pair
    if delay_ms:
        time.sleep(0.05)  # the real clock runs on; the policy's has not passed the delay
        assert not any(future.done() for future in futures)
        now[0] = delay_ms / 1000.0 + 0.001  # past the delay from the first pair's arrival
        with scheduler._cond:  # the held lane waits on the real clock: wake it to look
            scheduler._cond.notify_all()
    got = [f.result(30).token_ids for f in futures]
    assert got == [ids for ids in expected for _ in range(2)]
    after = scheduler.stats
    calls = after["encoder_calls"] - stats["encoder_calls"]
    prefills = after["prefill_calls"] - stats["prefill_calls"]
    if delay_ms:
        assert calls == 1 and prefills == 1, after  # every pair at once
        assert after["held_turns"] - stats["held_turns"] == 1
    else:
        assert calls == len(texts) and prefills == len(texts), after  # a pair a call
        assert after["held_turns"] == 0
    tr.close()


def test_a_held_lane_is_not_woken_by_partials_that_leave_its_hold_on() -> None:
    """A lane the batch delay holds wakes when a submission ends the hold (here a final),
    not for every partial that comes meanwhile: each such wake-up was two thread switches
    and a look at the queue that only waited again.

    The policy's clock is the test's (2 ms between arrivals, frozen in between) and the
    delay long (60 s on it, which the lane also waits on the real clock), so that whether
    the lane holds does not hang on how the OS schedules the threads: on the real clock
    and a 400 ms delay, a test thread late under load let the hold run out or end it."""
    needs_fixture()
    options = SchedulerOptions(lanes=1, batch_delay_ms=60_000)
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=options)
    scheduler = tr.scheduler
    now = [0.0]
    scheduler.clock = lambda: now[0]
    warm: list[Future[Hypothesis]] = []
    # The lane started, the arrival rate known (they overlap); the final ends any hold.
    for text, priority in zip(SOURCES[:2], (Priority.PARTIAL, Priority.FINAL), strict=True):
        enc = tr.encoding([tr.source_ids(text)])
        warm += scheduler.submit(enc, DecodeOptions(), priority=priority)
        now[0] += 0.002
    for future in warm:
        future.result(30)
    policy = scheduler._policy
    has_work = policy.has_work
    looks = 0

    def counted(lane: int) -> bool:
        nonlocal looks
        looks += 1
        return has_work(lane)

    held = scheduler.stats["held_turns"]
    policy.has_work = counted  # type: ignore[method-assign]
    partials: list[Future[Hypothesis]] = []
    for text in SOURCES[:5]:
        enc = tr.encoding([tr.source_ids(text)])
        partials += scheduler.submit(enc, DecodeOptions(), priority=Priority.PARTIAL)
        now[0] += 0.002
        time.sleep(0.002)  # a lane woken by it would look meanwhile
    looked = looks
    assert not any(future.done() for future in partials)  # held
    enc = tr.encoding([tr.source_ids(SOURCES[0])])
    final = scheduler.submit(enc, DecodeOptions(), priority=Priority.FINAL)
    for future in [*partials, *final]:
        future.result(30)
    policy.has_work = has_work  # type: ignore[method-assign]
    assert looked <= 2, looked  # the first partial's wake-up (one per partial before)
    assert scheduler.stats["held_turns"] > held
    tr.close()
