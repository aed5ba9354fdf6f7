"""A term's rendering (the model's translation of its source alone) is decoded off a
partial's path: a partial that ends with a term's source starts it for the next one, and a
partial whose term counts for the first time starts it without waiting; a final waits for
it, so that it still equals `translate` with the same glossary."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future

import anyio
import pytest

from engine.decoding.search import Hypothesis
from engine.decoding.translator import Translator
from engine.glossary import Glossary
from engine.streaming.calls import DecodeCall, Started
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.session import StreamSession
from protocol import PartialTranscript, TranslationUpdate
from tests.conftest import FIXTURE_MODEL, needs_fixture

ZH = Glossary.parse("en\tzh\nEmma\t爱丽丝\nwater\t果汁\n")


@pytest.fixture
def fresh() -> Iterator[Translator]:
    """A translator that has rendered no term yet (the cache is the translator's)."""
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL)
    yield tr
    tr.close()


def answered(
    session: StreamSession, seq: int, text: str, *, final: bool = False
) -> tuple[TranslationUpdate | None, list[type]]:
    """The session's answer to one event, and the kinds of call it yielded on the way."""
    event = PartialTranscript("s", 0, seq, text, is_final=final)
    steps = session.steps(event)
    kinds: list[type] = []
    try:
        call = next(steps)
        while True:
            kinds.append(type(call))
            call = steps.send(call.run(session.translator))
    except StopIteration as done:
        update: TranslationUpdate | None = done.value
        return update, kinds


def test_scan_keeps_the_terms_at_a_partials_open_end_apart() -> None:
    g = Glossary.parse("en\tde\nNew\tNeu\nNew York\tNeuyork\nTom\tThomas\n")
    found, heard = g.scan("Tom went to New York", partial=True)
    assert [m.term.source for m in found] == ["Tom", "New"]  # as `match` counts them
    assert [m.term.source for m in heard] == ["New York"]  # the longest only
    found, heard = g.scan("Tom went to New York ", partial=True)
    assert [m.term.source for m in found] == ["Tom", "New York"] and heard == []
    found, heard = g.scan("Tom went to New York")  # a final is complete
    assert [m.term.source for m in found] == ["Tom", "New York"] and heard == []
    assert (
        g.match("Tom went to New York", partial=True)
        == g.scan("Tom went to New York", partial=True)[0]
    )
    assert [m.term.source for m in g.scan("Tom went to New", partial=True)[1]] == ["New"]
    zh = Glossary.parse("zh\ten\n汤姆\tThomas\n")
    assert [m.term.source for m in zh.scan("我见汤姆", partial=True)[1]] == ["汤姆"]


def test_a_partial_ending_with_a_term_starts_its_rendering(fresh: Translator) -> None:
    session = StreamSession("s", fresh, glossary=ZH)
    terms = fresh.matched("We want to wait for Emma ", ZH, partial=True)
    assert fresh.unrendered(terms) == ["Emma"]
    update, kinds = answered(session, 0, "We want to wait for Emma")
    assert kinds == [DecodeCall]  # its own decode only: the rendering is not waited for
    assert update is not None and "爱丽丝" not in update.stable_text + update.unstable_text
    assert fresh.unrendered(terms) == []  # started (or done)
    update, kinds = answered(session, 1, "We want to wait for Emma at")
    assert DecodeCall in kinds and kinds.count(DecodeCall) == 1  # no rendering decode
    assert set(kinds) <= {DecodeCall, Started}
    assert update is not None and "爱丽丝" in update.stable_text + update.unstable_text
    assert fresh.rendering_started(terms) == []  # remembered
    final, _ = answered(session, 2, "We want to wait for Emma at the hotel", final=True)
    assert final is not None
    expected = fresh.translate(["We want to wait for Emma at the hotel"], glossary=ZH)[0].text
    assert final.stable_text == expected


def test_a_term_counting_at_first_sight_is_shown_without_waiting(fresh: Translator) -> None:
    session = StreamSession("s", fresh, glossary=ZH)
    update, kinds = answered(session, 0, "We want to wait for Emma at")
    assert kinds == [DecodeCall]  # the term is placed without its rendering, this once
    assert update is not None and "爱丽丝" in update.stable_text + update.unstable_text
    terms = fresh.matched("We want to wait for Emma at", ZH, partial=True)
    assert fresh.unrendered(terms) == []  # started for the next partials


def test_a_final_waits_for_the_rendering_and_equals_translate(fresh: Translator) -> None:
    text = "Emma wants water"
    expected = Translator.from_dir(FIXTURE_MODEL)
    try:
        offline = expected.translate([text], glossary=ZH)[0].text
    finally:
        expected.close()
    session = StreamSession("s", fresh, glossary=ZH)
    final, kinds = answered(session, 0, text, final=True)
    assert kinds.count(DecodeCall) == 3  # the two renderings, then the final's decode
    assert final is not None and final.stable_text == offline
    assert "爱丽丝" in offline and "果汁" in offline


@pytest.mark.anyio
async def test_on_the_event_loop(fresh: Translator) -> None:
    """The controller awaits a started rendering as it awaits a decode."""
    texts = ["We want to wait for Emma", "We want to wait for Emma at", "Emma waits at the hotel"]
    updates: list[TranslationUpdate] = []
    async with IncrementalTranslator(fresh, glossaries=ZH) as nmt:
        replies = aiter(nmt.updates("s"))
        for seq, text in enumerate(texts):
            await nmt.push(PartialTranscript("s", 0, seq, text, is_final=seq == len(texts) - 1))
            with anyio.fail_after(30):
                while not updates or updates[-1].seq != seq:  # each answered before the next
                    reply = await anext(replies)
                    if isinstance(reply, TranslationUpdate):
                        updates.append(reply)
        await nmt.close_stream("s")
    assert updates[-1].is_final
    assert updates[-1].stable_text == fresh.translate([texts[-1]], glossary=ZH)[0].text
    assert "爱丽丝" in updates[1].stable_text + updates[1].unstable_text


class _Failed(RuntimeError):
    """A rendering started ahead that failed on its lane."""


def _failing_ahead(tr: Translator, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """`source`'s rendering started ahead and failed, caught before its done-callback
    forgot it: the window between a lane failing the future and the callback running."""
    failed: Future[Hypothesis] = Future()
    monkeypatch.setattr(tr, "submit", lambda *args, **kwargs: [failed])
    monkeypatch.setattr(tr, "_rendered", lambda source, future: None)
    tr.render_ahead([source])
    failed.set_exception(_Failed("the lane failed"))
    monkeypatch.undo()
    assert fresh_started(tr, source) == [failed]


def fresh_started(tr: Translator, source: str) -> list[Future[Hypothesis]]:
    terms = [term for term in tr.matched(source, ZH) if term.source == source]
    return [future for _, future in tr.rendering_started(terms)]


def _offline(text: str) -> str:
    """`text` translated with the glossary by a translator of its own."""
    reference = Translator.from_dir(FIXTURE_MODEL)
    try:
        return reference.translate([text], glossary=ZH)[0].text
    finally:
        reference.close()


def test_a_failed_rendering_started_ahead_is_decoded_again(
    fresh: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = Translator.from_dir(FIXTURE_MODEL)
    try:
        expected = reference.rendering("Emma")
    finally:
        reference.close()
    _failing_ahead(fresh, monkeypatch, "Emma")
    assert fresh.rendering("Emma") == expected  # not the lane's error


def test_a_final_waiting_on_a_failed_rendering_decodes_it_itself(
    fresh: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "Emma wants water"
    offline = _offline(text)
    _failing_ahead(fresh, monkeypatch, "Emma")
    session = StreamSession("s", fresh, glossary=ZH)
    final = session.answer(PartialTranscript("s", 0, 0, text, is_final=True))
    assert final is not None and final.stable_text == offline  # not the lane's error


@pytest.mark.anyio
async def test_on_the_event_loop_a_failed_rendering_is_decoded_again(
    fresh: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "Emma wants water"
    offline = _offline(text)
    _failing_ahead(fresh, monkeypatch, "Emma")
    async with IncrementalTranslator(fresh, glossaries=ZH) as nmt:
        replies = aiter(nmt.updates("s"))
        await nmt.push(PartialTranscript("s", 0, 0, text, is_final=True))
        with anyio.fail_after(30):
            final = await anext(replies)
    assert isinstance(final, TranslationUpdate), final  # not an error reply
    assert final.is_final and final.stable_text == offline
