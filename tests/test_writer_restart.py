"""A writer that restarts (a new process that lost its count) and numbers from 0 again,
after its earlier connection dropped without closing the stream: every final of its new
speech is translated and shown (a new life), on the in-process bus and on Redis, while a
writer that only resends what it had no reply for still gets each final answered once.

The decision is the lifecycle's (`StreamLifecycle.starts_over`), checked alone first."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Collection, Iterator

import anyio
import pytest

from engine.decoding.translator import Translator
from engine.replies import Reply
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.history import Entry, Resent, answered_through, current_life
from engine.streaming.lifecycle import Owner, StreamLifecycle
from engine.streaming.redis_bus import RedisBus
from engine.streaming.subscriptions import Subscription
from protocol import ErrorMessage, PartialTranscript, TranslationUpdate
from tests.redis_server import RedisServer, redis_server

OLD = [
    "I will meet Tom at three",
    "Tom reads a book",
    "we eat noodles",
    "we will see the film",
    "Tom will play tennis",
]
NEW = [
    "Does Tom draw a horse",
    "Tom reads a book in the library",
    "the cat sleeps",
    "I will meet Tom",
    "Tom will play tennis with Lucy at three tomorrow",
]


def speech(
    sentences: list[str], partials: bool, stream: str = "s1", seq: int = 0
) -> list[PartialTranscript]:
    """One segment per sentence, numbered from `seq`: its final alone, or (`partials`) a
    partial of its first two words before it (finals at odd seqs then)."""
    events = []
    for segment, sentence in enumerate(sentences):
        if partials:
            first = " ".join(sentence.split()[:2])
            events.append(PartialTranscript(stream, segment, seq, first, False))
            seq += 1
        events.append(PartialTranscript(stream, segment, seq, sentence, True))
        seq += 1
    return events


def finals(replies: list[Reply]) -> list[tuple[int, str]]:
    return [
        (r.seq, r.source_text or "")
        for r in replies
        if isinstance(r, TranslationUpdate) and r.is_final
    ]


def errors(replies: list[Reply]) -> list[ErrorMessage]:
    return [r for r in replies if isinstance(r, ErrorMessage)]


def drained(sub: Subscription) -> list[Reply]:
    """What a subscription holds now, taken out of it."""
    got = list(sub._items)
    sub._items.clear()
    return got


# --- the decision, alone ---------------------------------------------------------------


def life(first: PartialTranscript, through: int | None = 4) -> StreamLifecycle:
    life = StreamLifecycle("s1", Owner("y"), 2, answered_through=through)
    life.accept(first)
    return life


def ev(seq: int, final: bool = True, segment: int | None = None) -> PartialTranscript:
    return PartialTranscript("s1", seq if segment is None else segment, seq, "x", final)


@pytest.mark.parametrize(
    ("found", "restart"),
    [
        ((Resent.NEW,), True),  # the earlier life has no seq 0 to repeat
        ((Resent.CONFLICT,), True),  # seq 0 with other words
        ((Resent.UNKNOWN,), True),  # older than what is kept: a long earlier talk
        ((), True),  # the history could not be read
        ((Resent.ANSWERED,), False),  # the earlier seq-0 final sent again unchanged
        ((Resent.ANSWERED, Resent.NEW), False),  # answered in one language
    ],
)
def test_a_final_at_seq_0_starts_over_unless_it_is_the_earlier_one_unchanged(
    found: Collection[Resent], restart: bool
) -> None:
    first = ev(0)
    stream = life(first)
    assert stream.resumes(first)
    assert stream.starts_over(first, found) is restart
    assert stream.answered_through == (None if restart else 4)


def test_a_partial_at_seq_0_starts_over() -> None:
    first = ev(0, final=False)
    stream = life(first)
    assert stream.starts_over(first, ())
    assert not stream.resumes(ev(1))  # every later seq is new


def test_after_an_unchanged_seq_0_the_first_event_no_resend_could_be_starts_over() -> None:
    first = ev(0)
    stream = life(first)
    assert not stream.starts_over(first, (Resent.ANSWERED,))
    assert not stream.starts_over(ev(1), (Resent.ANSWERED,))  # resent unchanged too
    assert not stream.starts_over(ev(2), (Resent.NEW,))  # never answered: new anyway
    stream.accept(ev(1))
    stream.accept(ev(2))
    assert stream.starts_over(ev(3), (Resent.CONFLICT,))  # other words under seq 3
    assert stream.answered_through is None
    other = life(first)
    other.accept(ev(1, final=False, segment=0))
    assert other.starts_over(ev(1, final=False, segment=0), ())  # a partial: never resent


def test_a_life_that_did_not_open_at_seq_0_never_starts_over() -> None:
    """A writer that resends from seq 2: other words under a used seq are refused, as a
    seq names one event in a life (`resent_final`'s CONFLICT)."""
    first = ev(2)
    stream = life(first)
    assert not stream.starts_over(first, (Resent.NEW,))
    stream.accept(ev(3))
    assert not stream.starts_over(ev(3), (Resent.CONFLICT,))
    assert not stream.starts_over(ev(4, final=False), ())
    fresh = life(ev(0), through=None)  # nothing earlier: nothing to judge
    assert not fresh.resumes(ev(0)) and not fresh.starts_over(ev(0), ())


def test_a_restart_mark_bounds_the_life_resends_are_judged_against() -> None:
    def final(seq: int, text: str) -> TranslationUpdate:
        return TranslationUpdate("s1", seq, seq, "x", "", True, 0.0, 0.0, source_text=text)

    entries = [Entry(f"{i + 1}-0", final(i, OLD[i]), 1) for i in range(5)]
    entries.append(Entry("6-0", None, 2, started_over=True))
    entries += [Entry(f"{i + 7}-0", final(i, NEW[i]), 2) for i in range(3)]
    assert [e.reply.seq for e in current_life(entries) if e.reply] == [0, 1, 2]
    assert answered_through(entries) == 2
    # Shown late (its seq 0 was the earlier one's words): its replies before the mark
    # are its own; a later close mark ends it all the same.
    late = [*entries[:5], Entry("6-0", final(0, OLD[0]), 2), Entry("6-1", final(1, NEW[1]), 2)]
    late += [Entry("7-0", None, 2, started_over=True), Entry("8-0", final(2, NEW[2]), 2)]
    assert [e.reply.source_text for e in current_life(late) if e.reply] == [OLD[0], *NEW[1:3]]
    assert current_life([*late, Entry("9-0", None, 2)]) == []


# --- through the controller, in one process ----------------------------------------------


async def hand_over(nmt: IncrementalTranslator, writer: Owner) -> None:
    """The writer's connection drops: its stream is handed over, not closed."""
    await nmt.wait_idle("s1")
    nmt.owner_left(writer)
    with anyio.fail_after(10):
        while "s1" in nmt.streams:
            await anyio.sleep(0.01)


@pytest.mark.anyio
@pytest.mark.parametrize("partials", [False, True], ids=["finals", "partials"])
async def test_a_restarted_writer_numbering_from_0_has_every_final_answered_and_shown(
    translator: Translator, partials: bool
) -> None:
    x, y = Owner("x"), Owner("y")
    async with IncrementalTranslator(translator) as nmt:
        viewer = nmt.updates("s1")
        for event in speech(OLD, partials):
            await nmt.push(event, x)
        await hand_over(nmt, x)
        # The old life's viewers end with it; the page's follow on after their cursor.
        following = nmt.updates("s1", after=viewer.cursor)
        mine = nmt.updates(owner=y)
        new = speech(NEW, partials)
        for event in new:
            await nmt.push(event, y)
        await nmt.wait_idle("s1")
        await nmt.close_stream("s1", y)
        answers = drained(mine)
        old_seen = [r async for r in viewer]
        seen = [r async for r in following]
    assert errors(answers) == []
    expected = [(e.seq, e.text) for e in new if e.is_final]
    assert finals(answers) == expected
    assert finals(seen) == expected  # viewers see the new life's every final, once
    old_epochs = {r.epoch for r in old_seen if isinstance(r, TranslationUpdate)}
    new_epochs = {r.epoch for r in seen if isinstance(r, TranslationUpdate)}
    assert len(old_epochs) == len(new_epochs) == 1 and old_epochs != new_epochs
    assert nmt.stats["started_over"] == 1 and nmt.stats["resent_refused"] == 0


@pytest.mark.anyio
async def test_a_restarted_writer_whose_first_final_repeats_the_earlier_one_goes_on(
    translator: Translator,
) -> None:
    """Its seq 0 is the earlier seq-0 final word for word: answered from the history
    (the same translation); its seq 1, other words, shows it started over."""
    x, y = Owner("x"), Owner("y")
    new = speech([OLD[0], *NEW[1:]], partials=False)
    async with IncrementalTranslator(translator) as nmt:
        viewer = nmt.updates("s1")
        for event in speech(OLD, partials=False):
            await nmt.push(event, x)
        await hand_over(nmt, x)
        following = nmt.updates("s1", after=viewer.cursor)
        mine = nmt.updates(owner=y)
        for event in new:
            await nmt.push(event, y)
        await nmt.wait_idle("s1")
        await nmt.close_stream("s1", y)
        answers = drained(mine)
        seen = [r async for r in following]
    assert errors(answers) == []
    assert finals(answers) == [(e.seq, e.text) for e in new]
    assert finals(seen) == [(e.seq, e.text) for e in new[1:]]
    assert nmt.stats["answered_from_history"] == 1 and nmt.stats["started_over"] == 1


@pytest.mark.anyio
async def test_after_a_restart_resends_are_judged_against_the_new_life_only(
    translator: Translator,
) -> None:
    """x says ten sentences; y restarts and says five (seq 0-4), then drops; z (y's
    ledger) resends seq 3 and 4, whose replies y lost, and seq 5, which never reached the
    engine: 3 and 4 are answered from the history, to z only, and 5, which x had used
    for other words, is the new life's: translated and shown."""
    x, y, z = Owner("x"), Owner("y"), Owner("z")
    new = speech(NEW, partials=False)
    later = PartialTranscript("s1", 5, 5, "we will see the film", True)
    async with IncrementalTranslator(translator) as nmt:
        viewer = nmt.updates("s1")
        for event in speech(OLD + NEW, partials=False):
            await nmt.push(event, x)
        await hand_over(nmt, x)
        following = nmt.updates("s1", after=viewer.cursor)
        for event in new:
            await nmt.push(event, y)
        await hand_over(nmt, y)
        again = nmt.updates("s1", after=following.cursor)
        mine = nmt.updates(owner=z)
        for event in [new[3], new[4], later]:
            await nmt.push(event, z)
        await nmt.wait_idle("s1")
        await nmt.close_stream("s1", z)
        answers = drained(mine)
        seen = [r async for r in following] + [r async for r in again]
    assert errors(answers) == []
    assert finals(answers) == [(3, NEW[3]), (4, NEW[4]), (5, later.text)]
    assert finals(seen) == [*((e.seq, e.text) for e in new), (5, later.text)]
    assert nmt.stats["answered_from_history"] == 2 and nmt.stats["started_over"] == 1


@pytest.mark.anyio
async def test_over_websocket_a_restarted_writers_finals_0_to_4_are_all_translated(
    translator: Translator,
) -> None:
    """The issue's report as it happened: finals 0-4, the connection drops; a new
    connection sends finals 0-4 of new speech. Each gets its final update."""
    import json

    from websockets.asyncio.client import connect

    from tests.conftest import partial_message, wait_for
    from tests.live_server import serving, ws_url

    async def speak(server: object, sentences: list[str]) -> list[dict[str, object]]:
        replies = []
        async with connect(ws_url(server)) as ws:  # type: ignore[arg-type]
            for seq, text in enumerate(sentences):
                await ws.send(partial_message("s", seq, text, final=True, segment=seq))
            with anyio.fail_after(30):
                while len(replies) < len(sentences):
                    reply = json.loads(await ws.recv())
                    if reply.get("type") == "error" or reply.get("is_final"):
                        replies.append(reply)
        return replies  # and the connection drops without close_stream

    async with serving(translator) as server:
        await speak(server, OLD)
        await wait_for(lambda: "s" not in server.engine.streams)
        replies = await speak(server, NEW)
    assert [(r["type"], r["seq"], r.get("source_text", r.get("code"))) for r in replies] == [
        ("translation_update", seq, text) for seq, text in enumerate(NEW)
    ]


# --- on Redis, across two nodes ------------------------------------------------------------


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@contextlib.asynccontextmanager
async def node(translator: Translator, redis: RedisServer) -> AsyncIterator[IncrementalTranslator]:
    async with IncrementalTranslator(translator, bus=RedisBus(redis.url, lease_ms=600)) as nmt:
        yield nmt


async def read_finals(sub: Subscription, count: int, timeout: float = 30) -> list[Reply]:
    got: list[Reply] = []
    with anyio.fail_after(timeout):
        async for reply in sub:
            got.append(reply)
            done = sum(isinstance(r, TranslationUpdate) and r.is_final for r in got)
            if done + len(errors(got)) >= count:
                break
    return got


async def left(nmt: IncrementalTranslator, writer: Owner) -> None:
    await nmt.wait_idle("s1")
    nmt.owner_left(writer)
    with anyio.fail_after(10):
        while "s1" in nmt.streams:
            await anyio.sleep(0.02)


@pytest.mark.anyio
@pytest.mark.parametrize("partials", [False, True], ids=["finals", "partials"])
async def test_on_redis_a_restarted_writer_on_another_node_has_every_final_answered(
    translator: Translator, redis: RedisServer, partials: bool
) -> None:
    x, y, z = Owner("x"), Owner("y"), Owner("z")
    old, new = speech(OLD + NEW, partials), speech(NEW, partials)
    later = PartialTranscript("s1", 9, new[-1].seq + 1, "we will see the film", True)
    async with node(translator, redis) as a, node(translator, redis) as b:
        viewer = b.updates("s1", lang="zh")
        await anyio.sleep(0.2)  # the viewer's node reads the stream's history
        theirs = a.updates(owner=x)
        for event in old:
            await a.push(event, x)
        await read_finals(theirs, len(OLD + NEW))
        await left(a, x)
        mine = b.updates(owner=y)
        for event in new:
            await b.push(event, y)
        answers = await read_finals(mine, len(NEW))
        await left(b, y)
        # y's ledger on a third connection, back on node a: the last two resent (their
        # replies lost), and one that never reached the engine.
        resent = a.updates(owner=z)
        finals_new = [e for e in new if e.is_final]
        for event in [*finals_new[-2:], later]:
            await a.push(event, z)
        answers_z = await read_finals(resent, 3)
        seen = await read_finals(viewer, len(OLD + NEW) + len(NEW) + 1)
    assert errors(answers) == [] and errors(answers_z) == []
    expected = [(e.seq, e.text) for e in finals_new]
    assert finals(answers) == expected
    assert finals(answers_z) == [*expected[-2:], (later.seq, later.text)]
    epochs = [r.epoch for r in seen if isinstance(r, TranslationUpdate) and r.is_final]
    shown = finals(seen)
    assert shown[len(OLD + NEW) :] == [*expected, (later.seq, later.text)]
    assert epochs[len(OLD + NEW)] != epochs[len(OLD + NEW) - 1]  # a new life, seen so
    assert b.stats["started_over"] == 1 and a.stats["answered_from_history"] == 2
