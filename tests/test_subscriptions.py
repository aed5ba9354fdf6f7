"""Subscriptions, the local fan-out and the update bus (`engine.streaming.bus`): who gets
which reply, what a late viewer starts from, and when a subscription ends; the bus alone first, then
through the controller on the fixture model."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from engine.decoding.translator import Translator
from engine.glossary import Glossary
from engine.replies import RECENT_FINALS, Reply
from engine.streaming.bus import InProcessBus, UpdateBus, subscribe
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.fanout import Hub
from engine.streaming.history import Entry
from engine.streaming.lifecycle import Owner
from engine.streaming.redis_bus import RedisBus
from engine.streaming.subscriptions import Subscription, target_language
from protocol import (
    EngineClosed,
    ErrorMessage,
    InvalidEvent,
    PartialTranscript,
    TranslationUpdate,
)

A = Owner("connection 1")
B = Owner("connection 2")


def update(
    seq: int, final: bool, stream: str = "s", lang: str | None = None, segment: int | None = None
) -> TranslationUpdate:
    segment = seq if segment is None else segment
    return TranslationUpdate(stream, segment, seq, "x", "", final, 0.0, 0.0, lang=lang)


def bare(reply: Reply) -> Reply:
    """A reply without the cursor the bus stamps on it (its place in the history)."""
    return (
        dataclasses.replace(reply, cursor=None) if isinstance(reply, TranslationUpdate) else reply
    )


def queued(sub: Subscription) -> list[Reply]:
    return [bare(reply) for reply in sub._items]


def test_subscription_drops_oldest_partials_but_never_finals() -> None:
    sub = Subscription("s", max_items=3)

    def update(seq: int, final: bool) -> TranslationUpdate:
        return TranslationUpdate("s", seq, seq, "x", "", final, 0.0, 0.0)

    sub.put(update(0, True))
    for seq in range(1, 6):
        sub.put(update(seq, False))
    sub.put(update(6, True))
    kept = [u.seq for u in list(sub._items)]
    assert kept[0] == 0 and 6 in kept and len(kept) == 3
    assert sub.dropped == 4


def test_the_in_process_bus_is_an_update_bus() -> None:
    assert isinstance(InProcessBus(), UpdateBus)


def test_replies_go_to_the_owner_the_streams_viewers_and_every_stream_viewers() -> None:
    bus = InProcessBus()
    writer_a, writer_b = subscribe(bus, owner=A), subscribe(bus, owner=B)
    viewer_s, viewer_t, everything = subscribe(bus, "s"), subscribe(bus, "t"), subscribe(bus)
    only_de = subscribe(bus, "s", lang="de")
    zh, de = update(0, False, lang="zh"), update(1, False, lang="de", segment=0)
    error = ErrorMessage("internal", "boom", stream_id="s", seq=2)  # every language
    for reply in (zh, de, error):
        bus.publish(reply, A)
    other = update(0, True, stream="t", lang="zh")
    bus.publish(other, B)
    assert queued(writer_a) == [zh, de, error] and queued(writer_b) == [other]
    assert queued(viewer_s) == [zh, de, error] and queued(viewer_t) == [other]
    assert queued(everything) == [zh, de, error, other]
    assert queued(only_de) == [de, error]


def test_a_late_viewer_starts_from_the_recent_finals_and_the_current_line() -> None:
    bus = InProcessBus()
    finals = [update(seq, True, lang="zh") for seq in range(RECENT_FINALS + 2)]
    for final in finals:
        bus.publish(final, A)
    current = update(99, False, lang="zh", segment=50)
    bus.publish(current, A)
    bus.publish(update(100, True, stream="t", lang="de"), None)
    bus.publish(ErrorMessage("internal", "boom", stream_id="s", seq=101, lang="zh"), A)
    expected = [*finals[-RECENT_FINALS:], current]  # errors are no line of text
    assert [bare(u) for u in bus.backlog("s", None)] == expected
    assert queued(subscribe(bus, "s", lang="zh")) == expected
    assert bus.backlog("s", "de") == []
    assert [u.stream_id for u in bus.backlog(None, None)] == ["s"] * len(expected) + ["t"]
    assert queued(subscribe(bus, owner=A)) == []  # a writer subscribes before it pushes
    bus.publish(update(102, True, lang="zh", segment=50), A)  # the line is final now
    assert bus.backlog("s", "zh")[-1].seq == 102


@pytest.mark.anyio
async def test_ending_a_stream_ends_its_viewers_and_its_backlog_only() -> None:
    bus = InProcessBus()
    viewer, everything, writer = subscribe(bus, "s"), subscribe(bus), subscribe(bus, owner=A)
    bus.publish(update(0, True, lang="zh"), A)
    bus.end_stream("s")
    assert viewer.ended and not everything.ended and not writer.ended
    assert [u.seq async for u in viewer] == [0]  # what was queued is still read
    assert bus.backlog("s", None) == []  # a new life of the id starts empty
    again = subscribe(bus, "s")  # a viewer waiting for the next life
    bus.hub.unsubscribe(everything)
    assert everything.ended
    bus.hub.end_all()
    assert again.ended and writer.ended
    bus.publish(update(1, True, lang="zh"), A)
    assert queued(again) == [] and queued(writer) == [update(0, True, lang="zh")]


def test_both_buses_are_the_narrow_interface_over_one_kind_of_hub() -> None:
    for bus in (InProcessBus(), RedisBus("redis://127.0.0.1:1/0")):
        assert isinstance(bus, UpdateBus) and type(bus.hub) is Hub


def test_a_joining_viewer_takes_nothing_live_before_its_replay_and_ends_at_a_close_mark() -> None:
    hub = Hub(8)
    sub = hub.viewer("s", "zh")
    hub.deliver("s", "zh", Entry("9-0", update(9, True, lang="zh")))  # not joined yet
    assert queued(sub) == []
    entries = [
        Entry("1-0", update(0, True, lang="zh")),
        Entry("2-0", None),  # its writer closed the stream here
        Entry("3-0", update(1, True, lang="zh")),
    ]
    assert not hub.join(sub, [("zh", entries)], after="1-0")
    assert sub.ended and sub.cursor == "2-0" and queued(sub) == []
    gap = hub.viewer("s", "zh")
    assert hub.join(gap, [("zh", entries[2:])], after="1-0")  # older than what is kept
    assert [u.seq for u in queued(gap)] == [1] and hub.viewers() == {"s": 1}
    hub.deliver("s", "zh", Entry("4-0", update(2, True, lang="zh")))
    assert [u.seq for u in queued(gap)] == [1, 2]


def test_one_language_match_and_one_refusal_for_the_server_and_the_engine() -> None:
    assert target_language("zh-Hans", ["zh", "de"]) == "zh"
    assert target_language("de", ["zh", "de"]) == "de"
    with pytest.raises(InvalidEvent) as refused:
        target_language("fr", ["zh", "de"], "s1")
    error = refused.value.error
    assert (error.code, error.field, error.stream_id) == ("invalid_message", "lang", "s1")
    assert error.message == "no translation into 'fr' here; languages: zh, de"


# --- through the controller --------------------------------------------------------------


class CountingBus(InProcessBus):
    """The default bus, counting what the controller hands it."""

    def __init__(self) -> None:
        super().__init__(queue_size=16)
        self.published: list[Reply] = []
        self.ended: list[str] = []

    def publish(self, reply: Reply, owner: Owner | None, epoch: int | None = None) -> None:
        self.published.append(reply)
        super().publish(reply, owner, epoch)

    def end_stream(self, stream_id: str, closed: bool = True) -> None:
        self.ended.append(stream_id)
        super().end_stream(stream_id, closed)


@pytest.mark.anyio
async def test_the_controller_publishes_every_reply_through_its_bus(
    translator: Translator,
) -> None:
    bus = CountingBus()
    async with IncrementalTranslator(translator, bus=bus) as nmt:
        sub = nmt.updates("s1")
        assert sub.max_items == 16  # made by the bus
        await nmt.push(PartialTranscript("s1", 0, 0, "I will meet Tom at three", True))
        await nmt.close_stream("s1")
        replies = [reply async for reply in sub]
    assert [bare(r) for r in replies] == bus.published and len(replies) == 1
    assert bus.ended == ["s1"]
    final = replies[0]
    assert isinstance(final, TranslationUpdate) and final.epoch == 1 and final.lang == "zh"


@pytest.mark.anyio
async def test_a_closed_engine_refuses_pushes_and_ends_new_subscriptions(
    translator: Translator,
) -> None:
    async with IncrementalTranslator(translator) as nmt:
        await nmt.push(PartialTranscript("s1", 0, 0, "I will", False))
        await nmt.aclose()
        with pytest.raises(EngineClosed):
            await nmt.push(PartialTranscript("s1", 0, 1, "I will meet", False))
        late = nmt.updates("s1")
        assert late.ended and [reply async for reply in late] == []


def test_a_viewer_resumes_after_its_cursor_or_from_the_start() -> None:
    bus = InProcessBus()
    writer = subscribe(bus, owner=A)
    for seq in range(5):
        bus.publish(update(seq, seq % 2 == 1, lang="zh", segment=seq // 2), A)
    cursors = [u.cursor for u in writer._items if isinstance(u, TranslationUpdate)]
    assert all(cursors) and len(set(cursors)) == 5
    after_two = subscribe(bus, "s", lang="zh", after=cursors[1])
    assert [u.seq for u in queued(after_two)] == [2, 3, 4]
    everything = subscribe(bus, "s", lang="zh", after="0-0")
    assert [u.seq for u in queued(everything)] == [0, 1, 2, 3, 4]
    unknown = subscribe(bus, "s", lang="zh", after="1-0")  # older than the history: backlog
    assert [u.seq for u in queued(unknown)] == [1, 3, 4]
    bus.publish(update(5, True, lang="zh", segment=2), A)
    assert [u.seq for u in queued(after_two)] == [2, 3, 4, 5]  # live, nothing twice


@pytest.mark.anyio
async def test_resent_finals_answered_before_are_answered_from_the_history_in_any_order(
    translator: Translator,
) -> None:
    """A writer that lost its connection resends every final it has no reply for: some the
    old life answered (their replies were lost with the connection), some it never did
    (they failed). Each is answered once: the first kind from the history, the second
    translated, whatever their order."""
    x, y = Owner("x"), Owner("y")
    async with IncrementalTranslator(translator) as nmt:
        viewer = nmt.updates("s1")
        await nmt.push(PartialTranscript("s1", 1, 2, "Tom reads a book", True), x)
        await nmt.wait_idle("s1")
        nmt.owner_left(x)  # seq 1 never reached it; seq 2's reply is lost with x
        with anyio.fail_after(10):
            while "s1" in nmt.streams:
                await anyio.sleep(0.01)
        # The old life's viewers end with it; the server's follow on after their cursor.
        following = nmt.updates("s1", after=viewer.cursor)
        mine = nmt.updates(owner=y)
        await nmt.push(PartialTranscript("s1", 0, 1, "I will meet Tom at three", True), y)
        await nmt.push(PartialTranscript("s1", 1, 2, "Tom reads a book", True), y)
        await nmt.wait_idle("s1")
        await nmt.close_stream("s1", y)
        answers = [bare(r) for r in mine._items]
        seen = [r async for r in viewer] + [r async for r in following]
    assert nmt.stats["answered_from_history"] == 1
    assert [(r.seq, r.is_final) for r in answers if isinstance(r, TranslationUpdate)] == [
        (1, True),
        (2, True),
    ]
    finals = [r.seq for r in seen if isinstance(r, TranslationUpdate) and r.is_final]
    assert finals == [2, 1]  # the viewer saw seq 2 when it was first answered, once


async def hand_over(nmt: IncrementalTranslator, writer: Owner) -> None:
    """The writer's connection drops: its stream is handed over, not closed."""
    await nmt.wait_idle("s1")
    nmt.owner_left(writer)
    with anyio.fail_after(10):
        while "s1" in nmt.streams:
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_a_final_resent_after_its_history_was_trimmed_is_not_shown_again(
    translator: Translator,
) -> None:
    """(At seq 1: a seq-0 event that the history cannot place is a writer starting over,
    `test_writer_restart.py`.)"""
    x, y = Owner("x"), Owner("y")
    first = PartialTranscript("s1", 0, 1, "I will meet Tom at three", True)
    async with IncrementalTranslator(translator, bus=InProcessBus(history=4)) as nmt:
        viewer = nmt.updates("s1")
        await nmt.push(first, x)
        for seq, words in enumerate(["Tom", "Tom reads", "Tom reads a", "Tom reads a book"], 2):
            await nmt.push(PartialTranscript("s1", 1, seq, words, seq == 5), x)
            await nmt.wait_idle("s1")
        await hand_over(nmt, x)
        following = nmt.updates("s1", after=viewer.cursor)
        mine = nmt.updates(owner=y)
        await nmt.push(first, y)  # its reply was lost with x; the history kept 4 entries
        await nmt.push(PartialTranscript("s1", 2, 6, "we will see the film", True), y)
        await nmt.wait_idle("s1")
        await nmt.close_stream("s1", y)
        answers = [r for r in mine._items if isinstance(r, TranslationUpdate)]
        seen = [r async for r in viewer] + [r async for r in following]
    assert [(r.seq, r.is_final) for r in answers] == [(1, True), (6, True)]
    finals = [r.seq for r in seen if isinstance(r, TranslationUpdate) and r.is_final]
    assert finals == [1, 5, 6]  # seq 1 once, when it was first answered
    assert nmt.stats["resent_unshown"] == 1


@pytest.mark.anyio
async def test_a_final_resent_after_its_history_was_trimmed_counts_its_terms_once(
    translator: Translator,
) -> None:
    """Its terms were counted when it was first answered: translated again for its writer
    only (it may have been shown), it is not counted again (`/terms`)."""
    x, y = Owner("x"), Owner("y")
    glossary = Glossary.parse("en\tzh\nTom\t杰克\n")
    first = PartialTranscript("s1", 0, 1, "I will meet Tom at three", True)
    async with IncrementalTranslator(
        translator, bus=InProcessBus(history=4), glossaries=glossary
    ) as nmt:
        await nmt.push(first, x)
        for seq, words in enumerate(["Tom", "Tom reads", "Tom reads a", "Tom reads a book"], 2):
            await nmt.push(PartialTranscript("s1", 1, seq, words, seq == 5), x)
            await nmt.wait_idle("s1")
        assert (await nmt.terms("s1"))["zh"] == (2, 2)
        await hand_over(nmt, x)
        mine = nmt.updates(owner=y)
        await nmt.push(first, y)  # its reply was lost with x; the history kept 4 entries
        await nmt.push(PartialTranscript("s1", 2, 6, "Tom will see the film", True), y)
        await nmt.wait_idle("s1")
        counts = await nmt.terms("s1")
        await nmt.close_stream("s1", y)
        answers = [r for r in mine._items if isinstance(r, TranslationUpdate)]
    assert [(r.seq, r.is_final) for r in answers] == [(1, True), (6, True)]
    assert nmt.stats["resent_unshown"] == 1
    assert counts["zh"] == (3, 3)  # seq 1, seq 5 and seq 6: seq 1 once


@pytest.mark.anyio
async def test_a_resend_with_the_same_seq_and_other_text_is_refused_not_shown(
    translator: Translator,
) -> None:
    x, y = Owner("x"), Owner("y")
    async with IncrementalTranslator(translator) as nmt:
        viewer = nmt.updates("s1")
        await nmt.push(PartialTranscript("s1", 0, 0, "I will meet Tom at three", True), x)
        await nmt.push(PartialTranscript("s1", 1, 1, "we eat noodles", True), x)
        await hand_over(nmt, x)
        following = nmt.updates("s1", after=viewer.cursor)
        mine = nmt.updates(owner=y)
        await nmt.push(PartialTranscript("s1", 1, 1, "Tom reads a book", True), y)
        await nmt.wait_idle("s1")
        await nmt.close_stream("s1", y)
        answers = list(mine._items)
        seen = [r async for r in viewer] + [r async for r in following]
    (refused,) = answers
    assert isinstance(refused, ErrorMessage) and refused.code == "out_of_order"
    assert refused.seq == 1 and "other text" in refused.message
    finals = [r.seq for r in seen if isinstance(r, TranslationUpdate) and r.is_final]
    assert finals == [0, 1]
    assert nmt.stats["resent_refused"] == 1


@pytest.mark.anyio
async def test_a_writer_that_numbers_from_0_again_starts_a_new_stream(
    translator: Translator,
) -> None:
    """Seq 0 with other words after the writer left: a restarted client, whose stream is
    a new one (another epoch), shown as such; not a resend."""
    x, y = Owner("x"), Owner("y")
    async with IncrementalTranslator(translator) as nmt:
        viewer = nmt.updates("s1")
        await nmt.push(PartialTranscript("s1", 0, 0, "I will meet Tom at three", True), x)
        await hand_over(nmt, x)
        following = nmt.updates("s1", after=viewer.cursor)
        mine = nmt.updates(owner=y)
        await nmt.push(PartialTranscript("s1", 0, 0, "Tom reads a book", True), y)
        await nmt.wait_idle("s1")
        await nmt.close_stream("s1", y)
        answers = [r for r in mine._items if isinstance(r, TranslationUpdate)]
        seen = [r async for r in viewer] + [r async for r in following]
    assert [(r.seq, r.is_final) for r in answers] == [(0, True)]
    finals = [r for r in seen if isinstance(r, TranslationUpdate) and r.is_final]
    assert [r.seq for r in finals] == [0, 0]
    assert finals[0].epoch != finals[1].epoch
    assert nmt.stats["resent_refused"] == 0
