"""One exactness suite over every KV backend and every decoder layout: whatever keeps the
rows' state (`engine.model.backend`: lockstep over the stock graphs, the state copied per
step, in place, KV slots) and whatever files hold the decoder (split or merged, fp32 or
int8 per token), each row of a shared batch equals decoding it alone: greedy and beam,
forced prefixes, drafts of every kind with lookahead and minimum lengths, a row aborted
mid-decode, and hundreds of joins and leaves.

The backend-specific checks (buffers, bindings, the slot pool's size, pages given back)
stay with their backends (`test_inplace_attention.py`, `test_kv_slots.py`)."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import DecodeOptions, Translator
from engine.decoding.backends import new_batch
from engine.decoding.batch import Member
from engine.decoding.continuous import ContinuousBatch
from engine.decoding.policy import Priority, new_request_id
from engine.decoding.scheduler import SchedulerOptions
from engine.decoding.search import DecodingCancelled, Hypothesis, Search, make_search
from engine.model.backend import Backend
from engine.model.kv.lockstep import LockstepKv
from engine.model.layouts import FloatArray
from tests.conftest import FIXTURE_MODEL, needs_fixture
from tests.test_scheduler import SCORE_TOLERANCE, SOURCES, _drafts, alone, requests

LAYOUTS: dict[str, dict[str, object]] = {
    "split fp32": {},
    "split int8": {"quantized": True},
    "merged fp32": {"prefer_split": False},
    "merged int8": {"prefer_split": False, "quantized": True},
}

BACKENDS: dict[Backend, dict[str, object]] = {
    Backend.LOCKSTEP: {"batchable": False},
    Backend.COPIED: {"inplace_attention": False},
    Backend.INPLACE: {},
    Backend.SLOTS: {"kv_slots": 12},
}

CASES = [(backend, layout) for backend in BACKENDS for layout in LAYOUTS]


@pytest.fixture(scope="module", params=CASES, ids=[f"{b.value}-{lay}" for b, lay in CASES])
def translator(request: pytest.FixtureRequest) -> Translator:
    """One lane, so that every request shares its batch."""
    needs_fixture()
    backend, layout = request.param
    options = {**LAYOUTS[layout], **BACKENDS[backend]}
    batchable = bool(options.pop("batchable", True))
    scheduler = SchedulerOptions(
        lanes=1,
        kv_slots=options.pop("kv_slots", None),  # type: ignore[arg-type]
        inplace_attention=options.pop("inplace_attention", None),  # type: ignore[arg-type]
    )
    tr = Translator.from_dir(
        FIXTURE_MODEL,
        scheduler=scheduler,
        batchable=batchable,
        **options,  # type: ignore[arg-type]
    )
    assert tr.model.backend.backend is backend, tr.model.backend.reason
    return tr


def _equal(hyp: Hypothesis, ref: Hypothesis, what: object) -> None:
    assert hyp.token_ids == ref.token_ids, what
    assert hyp.finished == ref.finished, what
    assert hyp.score == pytest.approx(ref.score, abs=SCORE_TOLERANCE), what


def _at_once(
    tr: Translator,
    todo: Sequence[tuple[str, list[int], list[int]]],
    options: DecodeOptions,
) -> list[Hypothesis]:
    """Each (source, prefix, draft) submitted from its own thread at the same moment."""
    gate = threading.Barrier(len(todo))

    def one(item: tuple[str, list[int], list[int]]) -> Hypothesis:
        text, prefix, draft = item
        enc = tr.encode([tr.source_ids(text)])
        gate.wait()
        drafts = [draft] if options.beam_size == 1 else None
        return tr.decode(enc, options, prefixes=[prefix], drafts=drafts)[0]

    with ThreadPoolExecutor(len(todo)) as pool:
        return list(pool.map(one, todo))


@pytest.mark.parametrize("beam", [1, 3])
def test_rows_sharing_steps_equal_decoding_alone(translator: Translator, beam: int) -> None:
    """Every source with and without a forced prefix, greedy and beam (whose rows reorder),
    at once: each answer is its own alone, and they shared steps."""
    # Beams forced past the fixture's eos, so that their rows reorder (copy their state).
    options = DecodeOptions(beam_size=beam, min_new_tokens=10 * (beam > 1))
    todo = [(text, prefix, []) for text, prefix in requests(translator)]
    expected = [alone(translator, text, prefix, options) for text, prefix, _ in todo]
    before = translator.scheduler.stats["decoder_steps"]
    got = _at_once(translator, todo, options)
    for item, hyp, ref in zip(todo, got, expected, strict=True):
        _equal(hyp, ref, item)
    steps = translator.scheduler.stats["decoder_steps"] - before
    assert steps < sum(len(ref.token_ids) for ref in expected)  # they shared steps


def test_drafts_and_lookahead_with_minimum_lengths_equal_decoding_alone(
    translator: Translator,
) -> None:
    """Drafts a revision could leave (shifted by a word, interleaved with wrong tokens,
    a middle dropped, none) on rows forced past the fixture's eos (a minimum length, so
    that eos is banned at the positions a draft and a lookahead verify): the answers are
    plain greedy decoding's."""
    options = DecodeOptions(min_new_tokens=12, max_new_tokens=16)
    todo, expected = [], []
    for i, (text, prefix) in enumerate(requests(translator)[:8]):
        ref = alone(translator, text, prefix, options)
        tail = list(ref.token_ids[len(prefix) :])
        kinds = list(_drafts(tail, translator.config.vocab_size).values())
        todo.append((text, prefix, kinds[i % len(kinds)]))
        expected.append(ref)
    got = _at_once(translator, todo, options)
    for item, hyp, ref in zip(todo, got, expected, strict=True):
        _equal(hyp, ref, item)


def test_a_row_aborted_mid_decode_leaves_the_others_exact(translator: Translator) -> None:
    """A partial aborted from its own hook between two steps (as a newer partial of its
    stream would) is answered with `DecodingCancelled`; the row decoded beside it goes on
    and equals decoding it alone."""
    scheduler = translator.scheduler
    options = DecodeOptions(min_new_tokens=20, max_new_tokens=20)
    stale_id = new_request_id()

    def stale_hook(rows: Sequence[Sequence[int]], scores: FloatArray) -> FloatArray:
        if len(rows[0]) == 4:
            scheduler.abort([stale_id])  # on the lane's thread, between two calls
        return scores

    enc = translator.encode([translator.source_ids(t) for t in SOURCES[1:3]])
    stale_enc = translator.encode([translator.source_ids(SOURCES[3])])
    futures = scheduler.submit(enc, options, priority=Priority.FINAL)
    (stale,) = scheduler.submit(
        stale_enc, options, priority=Priority.PARTIAL, request_id=stale_id, hook=stale_hook
    )
    assert isinstance(stale.exception(60), DecodingCancelled)
    for text, future in zip(SOURCES[1:3], futures, strict=True):
        _equal(future.result(60), alone(translator, text, [], options), text)


def test_hundreds_of_joins_and_leaves_stay_exact(translator: Translator) -> None:
    """Requests of several sources, prefixes and drafts from six threads, 96 in all: rows
    join and leave at nearly every step (over KV slots, more requests than slots wait
    for one), and every answer equals decoding it alone."""
    rng = random.Random(5)
    cases = requests(translator)
    expected = {(t, tuple(p)): alone(translator, t, p, DecodeOptions()) for t, p in cases}
    todo = []
    for _ in range(96):
        text, prefix = cases[rng.randrange(len(cases))]
        tail = list(expected[(text, tuple(prefix))].token_ids[len(prefix) :])
        todo.append((text, prefix, tail[: rng.randrange(len(tail) + 1)]))

    def one(item: tuple[str, list[int], list[int]]) -> Hypothesis:
        text, prefix, draft = item
        enc = translator.encode([translator.source_ids(text)])
        return translator.decode(enc, prefixes=[prefix], drafts=[draft])[0]

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, todo))
    for (text, prefix, _), hyp in zip(todo, got, strict=True):
        _equal(hyp, expected[(text, tuple(prefix))], (text, prefix))
    if translator.scheduler.kv_slots is not None:
        assert translator.scheduler.kv_slots["free"] == translator.scheduler.kv_slots["total"]


def test_lockstep_is_a_backend_of_the_one_batch() -> None:
    """Over the stock graphs the lane's batch is the one batch over a backend that is not
    `ragged`: newcomers with prefixes of different lengths and a draft start together
    (their common prefix prefilled, the rest forced, the draft not fed) and equal decoding
    alone; once rows run, the batch is not joinable and refuses a newcomer."""
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1), batchable=False)
    batch = new_batch(tr.model, SchedulerOptions(), None)
    assert isinstance(batch, ContinuousBatch) and isinstance(batch.kv, LockstepKv)
    assert not batch.kv.ragged and batch.joinable
    options = DecodeOptions(min_new_tokens=6, max_new_tokens=12)
    todo = requests(tr)[len(SOURCES) : len(SOURCES) + 3]  # forced prefixes of 1 to 3 tokens
    expected = [alone(tr, text, prefix, options) for text, prefix in todo]

    def member(text: str, prefix: list[int], draft: Sequence[int] = ()) -> Member:
        search = make_search(tr.config, prefix, options, draft=draft)
        return Member(search, tr.encode([tr.source_ids(text)]))

    joining = [
        member(text, prefix, ref.token_ids[len(prefix) :])
        for (text, prefix), ref in zip(todo, expected, strict=True)
    ]
    assert batch.schedule(joining) == []
    assert not batch.joinable
    with pytest.raises(RuntimeError, match="only takes searches when empty"):
        batch.schedule([member(*todo[0])])
    done: list[Search] = []
    while batch.searches:
        batch.execute()
        done += batch.update()
    assert batch.stats["draft_offered"] == 0  # rows of one length: no draft is fed
    by_search = {id(m.search): ref for m, ref in zip(joining, expected, strict=True)}
    assert len(done) == len(joining)
    for search in done:
        _equal(search.result(), by_search[id(search)], search.prefix)
    batch.execute()  # no row left: the backend lets its cache go
    assert batch.joinable
