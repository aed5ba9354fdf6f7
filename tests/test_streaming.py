"""The streaming controller on the fixture model: skip what did not change, never retract
stable text, finals equal offline translation, latest wins, streams stay isolated."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine import Translator
from engine.decoding.policy import new_request_id
from engine.decoding.search import DecodingCancelled, StepHook
from engine.logs.make import generate_log
from engine.model.layouts import FloatArray
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.policies import BiasedDecoding, LocalAgreement, MaskK
from engine.streaming.session import StreamingOptions, StreamSession
from engine.streaming.subscriptions import Subscription
from protocol import InvalidEvent, NmtIncremental, PartialTranscript, TranslationUpdate
from tests.conftest import FIXTURE_DIR, FIXTURE_DIRS, FIXTURE_MODELS, needs_fixture

POLICIES = [LocalAgreement(2), LocalAgreement(3), MaskK(2), BiasedDecoding(0.3)]


def read_heldout(directory: Path) -> list[tuple[str, str]]:
    rows = (directory / "heldout.tsv").read_text(encoding="utf-8").splitlines()
    cells = [r.split("\t") for r in rows if r.strip()]
    return [(c[0], c[1]) for c in cells][:30]


@pytest.fixture(scope="module")
def heldout() -> list[tuple[str, str]]:
    needs_fixture()
    return read_heldout(FIXTURE_DIR)


@pytest.fixture(scope="module", params=sorted(FIXTURE_MODELS))
def each_fixture(request: pytest.FixtureRequest) -> tuple[Translator, list[tuple[str, str]]]:
    """Each committed fixture with its held-out sentences: the prefix-trained one, and the
    offline one that, like real OPUS-MT, invents endings for partials (its held-out rows mix
    written, lowercase, filler and fragment styles)."""
    needs_fixture(request.param)
    translator = Translator.from_dir(FIXTURE_MODELS[request.param])
    return translator, read_heldout(FIXTURE_DIRS[request.param])


def events_of(lines: Iterable[dict[str, Any]]) -> list[PartialTranscript]:
    keys = ("stream_id", "segment_id", "seq", "text", "is_final", "start_ms", "end_ms")
    return [PartialTranscript(**{k: line.get(k) for k in keys}) for line in lines]


def run_session(session: StreamSession, events: list[PartialTranscript]) -> list[TranslationUpdate]:
    out = []
    for event in events:
        update = session.answer(event)
        if update is not None:
            out.append(update)
    return out


def check_segments(updates: list[TranslationUpdate], translator: Translator) -> dict[str, int]:
    """Stable text only grows within a segment; the final is the offline translation."""
    by_segment: dict[tuple[str, int], list[TranslationUpdate]] = defaultdict(list)
    for u in updates:
        by_segment[(u.stream_id, u.segment_id)].append(u)
    counts = {"segments": 0, "early_stable": 0, "revised": 0}
    for segment in by_segment.values():
        counts["segments"] += 1
        seqs = [u.seq for u in segment]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        *partials, final = segment
        assert final.is_final and not any(u.is_final for u in partials)
        stable = ""
        for u in partials:
            assert u.stable_text.startswith(stable), (stable, u.stable_text)
            assert u.text.startswith(u.stable_text)
            stable = u.stable_text
        assert final.source_text is not None
        offline = translator.translate([final.source_text])[0].text
        assert final.stable_text == offline and final.unstable_text == ""
        assert final.revised == (not final.stable_text.startswith(stable))
        counts["revised"] += final.revised
        counts["early_stable"] += bool(stable)
    return counts


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_stable_text_only_grows_and_finals_are_offline(
    policy: Any, each_fixture: tuple[Translator, list[tuple[str, str]]]
) -> None:
    translator, heldout = each_fixture
    log = generate_log([en for en, _ in heldout], "en", seed=3)
    session = StreamSession("s1", translator, StreamingOptions(policy=policy))
    updates = run_session(session, events_of(log))
    counts = check_segments(updates, translator)
    assert counts["segments"] == len(heldout)
    assert session.segment is None  # the last final freed its state


def test_default_policy_shows_stable_text_early_and_rarely_revises(
    translator: Translator, heldout: list[tuple[str, str]]
) -> None:
    log = generate_log([en for en, _ in heldout], "en", seed=5)
    session = StreamSession("s1", translator)
    counts = check_segments(run_session(session, events_of(log)), translator)
    assert counts["early_stable"] > counts["segments"] / 2
    assert counts["revised"] <= counts["segments"] * 0.2


def test_a_partial_detokenizes_its_committed_part_only_when_it_changed(
    translator: Translator, heldout: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial whose committed tokens are those of the one before reuses their text:
    it detokenizes at most its shown tokens, not the committed ones again."""
    calls: list[list[int]] = []
    detokenize = translator.detokenize

    def counted(ids: Sequence[int]) -> str:
        calls.append(list(ids))
        return detokenize(ids)

    monkeypatch.setattr(translator, "detokenize", counted)
    log = generate_log([en for en, _ in heldout], "en", seed=5)
    session = StreamSession("s1", translator)
    unchanged = 0
    for event in events_of(log):
        before = list(session.segment.committed) if session.segment is not None else None
        made = len(calls)
        update = session.answer(event)
        if update is None or event.is_final:
            continue
        assert session.segment is not None
        changed = before is None or session.segment.committed != before
        unchanged += not changed
        assert len(calls) - made <= 1 + changed
    assert unchanged > 0


def test_unchanged_partial_runs_neither_encoder_nor_decoder(
    each_fixture: tuple[Translator, list[tuple[str, str]]],
) -> None:
    translator = each_fixture[0]
    session = StreamSession("s1", translator)
    first = session.answer(PartialTranscript("s1", 0, 0, "I will meet Tom", False))
    assert first is not None
    calls = dict(translator.model.calls)
    assert session.answer(PartialTranscript("s1", 0, 1, " I  will meet\tTom ", False)) is None
    assert dict(translator.model.calls) == calls
    # A changed source runs the encoder once more. The final reuses that encoding, unless
    # the model marks partials (prefix-trained), where the final's input differs by the marker.
    session.answer(PartialTranscript("s1", 0, 2, "I will meet Tom at three", False))
    assert translator.model.calls["encoder"] == calls["encoder"] + 1
    session.answer(PartialTranscript("s1", 0, 3, "I will meet Tom at three", True))
    marked = translator.config.prefix_trained
    assert translator.model.calls["encoder"] == calls["encoder"] + 1 + marked


def test_a_partial_is_answered_when_its_source_changed_empty_or_not(
    translator: Translator,
) -> None:
    """The one rule: a partial gets an update when its normalised source differs from the
    last answered one of its segment (which starts empty); finals always do."""
    session = StreamSession("s1", translator)
    texts = ["", "I will", "I  will ", "", " ", "I will meet", "I will meet"]
    answered = [
        session.answer(PartialTranscript("s1", 0, seq, text, False)) is not None
        for seq, text in enumerate(texts)
    ]
    assert answered == [False, True, False, True, False, True, False]
    assert session.answer(PartialTranscript("s1", 0, 7, "I will meet", True)) is not None


def test_committed_prefix_is_forced_in_one_decoder_call(translator: Translator) -> None:
    session = StreamSession("s1", translator)
    words = "Tom reads a book in the library".split()
    for i in range(1, len(words) + 1):
        session.answer(PartialTranscript("s1", 0, i, " ".join(words[:i]), False))
        if session.segment is not None and session.segment.committed:
            break
    seg = session.segment
    assert seg is not None and seg.committed, "nothing was committed"
    seen: list[int] = []
    # The prefill call: over KV slots where the model keeps them, else the rewritten
    # decoder's under continuous batching, else the layout's.
    owner: Any = translator.scheduler.kv or translator.model.masked or translator.model
    name = "prefill"
    original = getattr(owner, name)

    def spy(enc: Any, ids: Any, *rest: Any, **named: Any) -> Any:
        seen.append(int(ids.shape[1]))
        return original(enc, ids, *rest, **named)

    # The masked decoder is frozen: the spy goes on this one instance past that.
    object.__setattr__(owner, name, spy)
    try:
        session.answer(PartialTranscript("s1", 0, 99, " ".join(words) + " today", False))
    finally:
        object.__delattr__(owner, name)
    assert seen == [len(seg.committed) + 1]


def test_cancelled_decode_leaves_state_untouched(translator: Translator) -> None:
    session = StreamSession("s1", translator)
    session.answer(PartialTranscript("s1", 0, 0, "I will meet Tom", False))
    seg = session.segment
    assert seg is not None
    before = (seg.source, list(seg.committed), len(seg.history))
    request_id = new_request_id()
    translator.abort([request_id])  # a newer event came before the decode was submitted
    with pytest.raises(DecodingCancelled):
        session.answer(
            PartialTranscript("s1", 0, 1, "I will meet Tom at three", False),
            request_id=request_id,
        )
    assert (seg.source, list(seg.committed), len(seg.history)) == before
    # The same text again is not mistaken for "unchanged": it gets translated.
    assert session.answer(PartialTranscript("s1", 0, 2, "I will meet Tom at three", False))


# -- the async controller -------------------------------------------------------------------


async def collect(sub: Subscription) -> list[TranslationUpdate]:
    return [u async for u in sub]


@pytest.mark.anyio
async def test_controller_is_an_nmt_incremental(translator: Translator) -> None:
    async with IncrementalTranslator(translator) as nmt:
        assert isinstance(nmt, NmtIncremental)


@pytest.mark.anyio
async def test_latest_wins_bounds_stale_work(translator: Translator) -> None:
    words = "my sister will not call Lily at the station tomorrow".split()
    async with IncrementalTranslator(translator) as nmt:
        sub = nmt.updates("s1")
        for i in range(1, len(words) + 1):  # a burst: no time to translate each one
            await nmt.push(PartialTranscript("s1", 0, i, " ".join(words[:i]), False))
        await nmt.push(PartialTranscript("s1", 0, 100, " ".join(words), True))
        await nmt.close_stream("s1")
        updates = await collect(sub)
        stats = dict(nmt.stats)
    assert stats["events"] == len(words) + 1
    worked = stats.get("updates", 0) + stats.get("cancelled", 0) + stats.get("unchanged", 0)
    assert worked + stats.get("superseded", 0) == len(words) + 1
    assert stats.get("superseded", 0) >= len(words) - 3
    assert worked <= 4
    assert updates[-1].is_final and updates[-1].seq == 100
    assert [u.seq for u in updates] == sorted(u.seq for u in updates)


@pytest.mark.anyio
async def test_a_newer_partial_takes_the_running_decode_out_of_the_batch(
    translator: Translator,
) -> None:
    """A partial still decoding when a newer one of its stream arrives leaves the batch at
    the scheduler's next step; only the newer one is answered."""
    started, release = threading.Event(), threading.Event()

    class Gate(LocalAgreement):
        def hook(self, previous: Sequence[int] | None) -> StepHook:
            def hook(rows: Sequence[Sequence[int]], scores: FloatArray) -> FloatArray:
                if len(rows[0]) == 2:  # mid-decode: hold it until the newer partial is in
                    started.set()
                    release.wait(10)
                return scores

            return hook

    options = StreamingOptions(policy=Gate(), forced_length_ratio=4.0)  # long decodes
    cancelled = translator.scheduler.stats["rows_cancelled"]
    async with IncrementalTranslator(translator, options) as nmt:
        sub = nmt.updates("s1")
        await nmt.push(PartialTranscript("s1", 0, 0, "Tom reads a book", False))
        assert await anyio.to_thread.run_sync(started.wait, 10)
        await nmt.push(PartialTranscript("s1", 0, 1, "Tom reads a book in the library", False))
        release.set()
        await nmt.wait_idle("s1")
        await nmt.close_stream("s1")
        updates = await collect(sub)
    assert [u.seq for u in updates] == [1]
    assert nmt.stats["cancelled"] == 1
    assert translator.scheduler.stats["rows_cancelled"] == cancelled + 1


@pytest.mark.anyio
async def test_bad_events_error_and_the_stream_goes_on(translator: Translator) -> None:
    async with IncrementalTranslator(translator) as nmt:
        sub = nmt.updates("s1")
        await nmt.push(PartialTranscript("s1", 0, 5, "I will meet", False))
        with pytest.raises(InvalidEvent) as err:
            await nmt.push(PartialTranscript("s1", 0, 5, "I will meet Tom", False))
        assert err.value.error.code == "out_of_order" and err.value.error.field == "seq"
        with pytest.raises(InvalidEvent) as err:
            await nmt.push("not an event")  # type: ignore[arg-type]
        assert err.value.error.code == "invalid_message"
        with pytest.raises(InvalidEvent) as err:
            await nmt.push(PartialTranscript("s1", 0, 6, "word " * 2000, False))
        assert err.value.error.code == "too_large" and err.value.error.field == "text"
        await nmt.push(PartialTranscript("s1", 0, 7, "I will meet Tom", True))
        with pytest.raises(InvalidEvent) as err:
            await nmt.push(PartialTranscript("s1", 0, 8, "I will", False))
        assert err.value.error.field == "segment_id"
        await nmt.push(PartialTranscript("s1", 1, 9, "we eat noodles", True))
        with pytest.raises(InvalidEvent) as err:
            await nmt.close_stream("nobody")
        assert err.value.error.code == "unknown_stream"
        await nmt.close_stream("s1")
        updates = await collect(sub)
    finals = [u for u in updates if u.is_final]
    assert [(u.segment_id, u.seq) for u in finals] == [(0, 7), (1, 9)]
    assert finals[0].stable_text == translator.translate(["I will meet Tom"])[0].text


@pytest.mark.anyio
async def test_two_streams_interleaved_equal_each_alone(
    translator: Translator, heldout: list[tuple[str, str]]
) -> None:
    a = events_of(generate_log([en for en, _ in heldout[:6]], "en", stream_id="a", seed=1))
    b = events_of(generate_log([en for en, _ in heldout[6:12]], "en", stream_id="b", seed=2))

    async def run(events: list[PartialTranscript]) -> dict[str, list[tuple[int, str, str]]]:
        async with IncrementalTranslator(translator) as nmt:
            sub = nmt.updates()
            for event in events:
                await nmt.push(event)
                await nmt.wait_idle(event.stream_id)  # translate every event: deterministic
            await nmt.aclose()
            out: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
            async for u in sub:
                out[u.stream_id].append((u.seq, u.stable_text, u.unstable_text))
            return out

    interleaved = sorted([*a, *b], key=lambda e: (e.seq, e.stream_id))
    both = await run(interleaved)
    assert both["a"] == (await run(a))["a"]
    assert both["b"] == (await run(b))["b"]


@pytest.mark.anyio
async def test_close_stream_frees_its_state(translator: Translator) -> None:
    async with IncrementalTranslator(translator) as nmt:
        await nmt.push(PartialTranscript("s1", 0, 0, "I will meet Tom", False))
        await nmt.wait_idle("s1")
        assert nmt.streams == ["s1"]
        await nmt.close_stream("s1")
        assert nmt.streams == []
        # The id can be used again, with seq starting afresh.
        await nmt.push(PartialTranscript("s1", 0, 0, "I will meet Tom", True))
        await nmt.wait_idle("s1")


def test_state_per_stream_is_bounded(
    translator: Translator, heldout: list[tuple[str, str]]
) -> None:
    session = StreamSession("s1", translator)
    sizes = []
    for line in events_of(generate_log([en for en, _ in heldout], "en", seed=9)):
        session.answer(line)
        sizes.append(session.state_size())
    longest = max(len(translator.source_ids(en)) for en, _ in heldout)
    d_model = translator.config.d_model
    assert max(sizes) <= longest * (d_model + 1) + 4 * translator.config.max_length
    assert sizes[-1] == 0


def test_fillers_are_not_content_and_a_normaliser_hook_plugs_in(translator: Translator) -> None:
    """Recognisers write hesitations ("um") and, many of them, lowercase without
    punctuation. Fillers are dropped before translation (never committed); restoring
    casing is a model's job, plugged in as `source_normalizer` (here a toy one)."""
    session = StreamSession("s1", translator)
    assert session.answer(PartialTranscript("s1", 0, 0, "um", False)) is None  # nothing said
    with_filler = session.answer(PartialTranscript("s1", 0, 1, "uh I will, um, meet", False))
    plain = StreamSession("s2", translator).answer(
        PartialTranscript("s2", 0, 0, "I will meet", False)
    )
    assert with_filler is not None and plain is not None
    assert with_filler.source_text == "I will, meet"  # the filler's own comma goes with it
    final = session.answer(PartialTranscript("s1", 0, 2, "Um I will meet Tom at three", True))
    offline = translator.translate(["I will meet Tom at three"])[0].text
    assert final is not None and final.stable_text == offline

    names = {"i": "I", "tom": "Tom", "lucy": "Lucy"}

    def recase(text: str) -> str:
        return " ".join(names.get(word, word) for word in text.split())

    restore = StreamingOptions(source_normalizer=recase)
    cased = StreamSession("s3", translator, restore).answer(
        PartialTranscript("s3", 0, 0, "i will meet tom at three", True)
    )
    assert cased is not None and cased.stable_text == offline
    assert cased.source_text == "I will meet Tom at three"


@pytest.mark.anyio
async def test_a_late_viewer_gets_the_last_lines_not_only_the_current_one(
    translator: Translator,
) -> None:
    async with IncrementalTranslator(translator) as nmt:
        texts = ["Tom reads a book", "I will meet Tom at three"]
        for seg, text in enumerate(texts):
            await nmt.push(PartialTranscript("v", seg, seg, text, is_final=True))
        await nmt.push(PartialTranscript("v", 2, 2, "Lucy wants to", is_final=False))
        await nmt.wait_idle("v")
        late = nmt.updates("v")
        replayed = []
        with anyio.fail_after(5):
            while len(replayed) < 3:
                replayed.append(await late.__anext__())
    assert [(u.segment_id, u.is_final) for u in replayed] == [(0, True), (1, True), (2, False)]
    offline = [r.text for r in translator.translate(texts)]
    assert [u.stable_text for u in replayed[:2]] == offline


def test_source_agreement_commits_nothing_while_shown_words_are_rewritten(
    translator: Translator,
) -> None:
    """With source_agreement=2, stable text grows only after two partials in a row that
    merely extended the source; a partial that rewrites a shown word starts the count
    again."""
    options = StreamingOptions(source_agreement=2)
    session = StreamSession("s1", translator, options)
    texts = ["Tom will play", "Tom will play tennis", "Tom will play tennis with",
             "Mary will play tennis with Lucy", "Mary will play tennis with Lucy at",
             "Mary will play tennis with Lucy at three"]  # fmt: skip
    stable, settled = [], []
    for seq, text in enumerate(texts):
        update = session.answer(PartialTranscript("s1", 0, seq, text, False))
        assert update is not None and session.segment is not None
        stable.append(update.stable_text)
        settled.append(session.segment.source_settled_at)
    # Partials in a row that only extended the source shown before (the first extends
    # nothing); "Tom" -> "Mary" starts the count again.
    assert settled == [0, 1, 2, 0, 1, 2]
    # The target side agrees on 汤姆 at the second partial (committed then without the
    # option); with it, only once two partials extended the source.
    assert stable[0] == stable[1] == "" and stable[2] != ""
    plain = StreamSession("s2", translator)
    plain.answer(PartialTranscript("s2", 0, 0, texts[0], False))
    second = plain.answer(PartialTranscript("s2", 0, 1, texts[1], False))
    assert second is not None and second.stable_text != ""
