"""The Redis update bus (`engine.streaming.redis_bus`) against a real `redis-server`: two
engines in one process stand for two server nodes sharing it. Ownership and fencing,
fan-out to viewers on another node, backlog and resume by cursor, finals resent after a
lost connection answered from the history, and Redis dying mid-talk. The same with real
processes, kill -9 and HAProxy is in `test_cluster.py`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator

import anyio
import pytest

from engine.decoding.translator import Translator
from engine.replies import Reply
from engine.streaming.bus import BusUnavailable
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.lifecycle import Owner
from engine.streaming.redis_bus import RedisBus
from engine.streaming.redis_store import redacted
from engine.streaming.subscriptions import Subscription
from protocol import ErrorMessage, InvalidEvent, PartialTranscript, TranslationUpdate
from tests.redis_server import RedisServer, free_port, redis_server

pytestmark = pytest.mark.anyio

SENTENCES = ["I will meet Tom at three", "Tom reads a book", "we will see the film"]


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@contextlib.asynccontextmanager
async def node(
    translator: Translator, redis: RedisServer, lease_ms: int = 600
) -> AsyncIterator[IncrementalTranslator]:
    bus = RedisBus(redis.url, lease_ms=lease_ms)
    async with IncrementalTranslator(translator, bus=bus) as nmt:
        yield nmt


def talk(stream: str, sentences: list[str], seq: int = 0) -> list[PartialTranscript]:
    events = []
    for segment, sentence in enumerate(sentences):
        words = sentence.split()
        for n in range(1, len(words) + 1):
            events.append(
                PartialTranscript(stream, segment, seq, " ".join(words[:n]), n == len(words))
            )
            seq += 1
    return events


async def read_until(sub: Subscription, finals: int, timeout: float = 20) -> list[Reply]:
    got: list[Reply] = []
    with anyio.fail_after(timeout):
        async for reply in sub:
            got.append(reply)
            if sum(isinstance(r, TranslationUpdate) and r.is_final for r in got) >= finals:
                break
    return got


def bare(reply: Reply) -> Reply:
    return (
        dataclasses.replace(reply, cursor=None) if isinstance(reply, TranslationUpdate) else reply
    )


async def test_a_viewer_on_another_node_gets_every_update_in_order_once(
    translator: Translator, redis: RedisServer
) -> None:
    writer = Owner("writer")
    async with node(translator, redis) as a, node(translator, redis) as b:
        viewer = b.updates("s1", lang="zh")
        mine = a.updates(owner=writer)
        await anyio.sleep(0.2)  # the viewer's node is reading the stream's history
        for event in talk("s1", SENTENCES):
            await a.push(event, writer)
            await anyio.sleep(0.02)
        written = await read_until(mine, len(SENTENCES))
        seen = await read_until(viewer, len(SENTENCES))
    assert all(isinstance(r, TranslationUpdate) for r in written)
    # The writer hears each update once Redis has it, with its place in the history.
    assert all(isinstance(r, TranslationUpdate) and r.cursor for r in written)
    assert seen == written  # the same updates, same order, same cursors, none twice
    epochs = {r.epoch for r in seen if isinstance(r, TranslationUpdate)}
    assert len(epochs) == 1 and epochs.pop() is not None


async def test_a_late_viewer_gets_the_backlog_and_a_returning_one_what_it_missed(
    translator: Translator, redis: RedisServer
) -> None:
    writer = Owner("writer")
    async with node(translator, redis) as a, node(translator, redis) as b:
        mine = a.updates(owner=writer)
        events = talk("s1", SENTENCES)
        first_final = next(i for i, e in enumerate(events) if e.is_final)
        for event in events[: first_final + 1]:
            await a.push(event, writer)
        early = await read_until(mine, 1)
        cursor = early[-1].cursor if isinstance(early[-1], TranslationUpdate) else None
        assert cursor is not None
        for event in events[first_final + 1 :]:
            await a.push(event, writer)
        rest = await read_until(mine, len(SENTENCES) - 1)
        # Resuming on another node after the first final: exactly what came after it.
        resumed = await read_until(b.updates("s1", lang="zh", after=cursor), len(SENTENCES) - 1)
        assert resumed == rest
        # A viewer joining now: the last finals, as on one node.
        late = b.updates("s1", lang="zh")
        with anyio.fail_after(10):
            while len(late) < len(SENTENCES):
                await anyio.sleep(0.02)
        finals = [r for r in [*early, *rest] if isinstance(r, TranslationUpdate) and r.is_final]
        assert [bare(r) for r in late._items] == [bare(r) for r in finals]


async def test_a_stream_moves_only_when_its_node_lets_go_and_its_old_life_is_fenced(
    translator: Translator, redis: RedisServer
) -> None:
    x, y = Owner("x"), Owner("y")
    async with node(translator, redis) as a, node(translator, redis) as b:
        await a.push(PartialTranscript("s1", 0, 0, "I will", False), x)
        # A live writer on another node holds it: the lease outlives the wait.
        with pytest.raises(InvalidEvent) as refused:
            await b.push(PartialTranscript("s1", 0, 0, "Tom reads", False), y)
        assert refused.value.error.code == "forbidden"
        assert "another server node" in refused.value.error.message
        # Node a freezes (its renewals stop): once the lease runs out, b takes over.
        bus_a = a.bus
        assert isinstance(bus_a, RedisBus)
        bus_a._held.clear()  # renews nothing from now on, as a paused process
        viewer = b.updates("s1", lang="zh")
        # The writer on b goes on numbering (a seq names one event in a stream's life).
        await b.push(PartialTranscript("s1", 0, 1, "Tom reads a book", True), y)
        taken = await read_until(viewer, 1)
        # a wakes up and publishes for the life it had: Redis refuses it.
        stale = a.updates(owner=x)
        await a.push(PartialTranscript("s1", 0, 1, "I will meet Tom at three", True), x)
        replies = await read_until_error(stale)
        await anyio.sleep(0.3)
    assert bus_a.stats["stale_refused"] >= 1
    error = replies[-1]
    assert isinstance(error, ErrorMessage) and error.code == "unavailable" and error.seq == 1
    assert "taken over" in error.message
    # The viewer saw a's line (its backlog), then b's life; nothing of a's late life.
    shown = [r for r in [*taken, *viewer._items] if isinstance(r, TranslationUpdate)]
    assert [r.seq for r in shown] == [0, 1] and shown[-1].is_final
    assert shown[0].epoch is not None and shown[1].epoch is not None
    assert shown[0].epoch < shown[1].epoch


async def read_until_error(sub: Subscription, timeout: float = 20) -> list[Reply]:
    got: list[Reply] = []
    with anyio.fail_after(timeout):
        async for reply in sub:
            got.append(reply)
            if isinstance(reply, ErrorMessage):
                break
    return got


async def test_a_resent_final_is_answered_from_the_history_not_translated_twice(
    translator: Translator, redis: RedisServer
) -> None:
    x, y = Owner("x"), Owner("y")
    final = PartialTranscript("s1", 0, 5, "I will meet Tom at three", True)
    async with node(translator, redis) as a, node(translator, redis) as b:
        viewer = b.updates("s1", lang="zh")
        mine = a.updates(owner=x)
        await a.push(final, x)
        (answer,) = await read_until(mine, 1)
        a.owner_left(x)  # the writer's connection drops before it read the answer
        await a.wait_idle()
        with anyio.fail_after(10):
            while "s1" in a.streams:
                await anyio.sleep(0.02)
        again = b.updates(owner=y)
        await b.push(final, y)  # resent, to another node
        (resent,) = await read_until(again, 1)
        following = PartialTranscript("s1", 1, 6, "Tom reads a book", True)
        await b.push(following, y)
        (next_answer,) = await read_until(again, 1)
        seen = await read_until(viewer, 2)
    assert b.stats["answered_from_history"] == 1
    assert resent == answer  # the same reply, cursor included
    assert isinstance(next_answer, TranslationUpdate) and next_answer.seq == 6
    assert [r.seq for r in seen if isinstance(r, TranslationUpdate) and r.is_final] == [5, 6]


async def test_a_node_that_cannot_reach_redis_says_so(translator: Translator) -> None:
    bus = RedisBus(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(BusUnavailable, match="cannot reach Redis"):
        await bus.start()


async def test_the_bus_password_is_never_printed() -> None:
    port = free_port()
    bus = RedisBus(f"redis://:s3cret-pw@127.0.0.1:{port}/0")
    with pytest.raises(BusUnavailable) as refused:
        await bus.start()
    assert "s3cret-pw" not in str(refused.value)
    assert f"redis://:***@127.0.0.1:{port}/0" in str(refused.value)
    assert redacted("redis://user:pw@[::1]:6379/2") == "redis://user:***@[::1]:6379/2"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


async def test_redis_dying_mid_talk_loses_no_accepted_final_silently(
    translator: Translator, redis: RedisServer
) -> None:
    writer = Owner("writer")
    async with node(translator, redis) as a, node(translator, redis) as b:
        mine = a.updates(owner=writer)
        await a.push(PartialTranscript("s1", 0, 0, "I will meet Tom at three", True), writer)
        await read_until(mine, 1)
        redis.kill()
        await a.push(PartialTranscript("s1", 1, 1, "Tom reads a book", True), writer)
        (error,) = await read_until_error(mine)
        with anyio.fail_after(10):
            while a.ready:
                await anyio.sleep(0.05)
        redis.start()
        with anyio.fail_after(15):
            while not (a.ready and b.ready):
                await anyio.sleep(0.05)
        # Back: the writer reconnects (a new life, as after any drop) and resends.
        a.owner_left(writer)
        with anyio.fail_after(10):
            while "s1" in a.streams:
                await anyio.sleep(0.02)
        viewer = b.updates("s1", lang="zh")
        again = a.updates(owner=Owner("writer again"))
        await a.push(PartialTranscript("s1", 1, 1, "Tom reads a book", True), Owner("writer again"))
        (answer,) = await read_until(again, 1)
        (seen,) = await read_until(viewer, 1)
    assert isinstance(error, ErrorMessage) and error.code == "unavailable" and error.seq == 1
    assert isinstance(answer, TranslationUpdate) and answer.seq == 1 and answer.is_final
    assert seen == answer
    assert a.bus.stats["redis_reconnects"] >= 1


async def test_term_counts_ride_on_the_append_fenced_and_closed_with_the_stream(
    redis: RedisServer,
) -> None:
    """`keep_terms` costs no round trip of its own when an append of the stream goes
    with it, is written alone when none does, is refused for a life that lost the
    stream, expires with the histories (kept while a life holds the stream) and is
    deleted by the close mark."""
    import redis as redis_py

    a, b = RedisBus(redis.url, lease_ms=600), RedisBus(redis.url, lease_ms=600)
    await a.start(["zh"])
    await b.start(["zh"])
    store = redis_py.Redis.from_url(redis.url, decode_responses=True)

    async def appended(bus: RedisBus, count: int) -> None:
        with anyio.fail_after(5):
            while bus.stats["appended"] + bus.stats["stale_refused"] < count:
                await anyio.sleep(0.005)

    def final(seq: int, epoch: int) -> TranslationUpdate:
        return TranslationUpdate("s1", seq, seq, "汤姆", "", True, 1.0, 1.0, epoch=epoch, lang="zh")

    try:
        epoch = (await a.claim("s1")).epoch
        a.keep_terms("s1", epoch, {"zh": (2, 1)})
        a.publish(final(0, epoch), Owner("w"), epoch)
        await appended(a, 1)
        riding = dict(a.stats), await b.kept_terms("s1"), store.pttl("nmt:t:s1")
        store.pexpire("nmt:t:s1", 60_000)  # the lease's renewal gives it the histories' term
        with anyio.fail_after(5):
            while store.pttl("nmt:t:s1") <= 60_000:
                await anyio.sleep(0.02)
        a.keep_terms("s1", epoch, {"zh": (3, 2)})  # nothing to ride on: written alone
        with anyio.fail_after(5):
            while a.stats["terms_written"] < 2:
                await anyio.sleep(0.005)
        alone = dict(a.stats), await b.kept_terms("s1")
        a.end_stream("s1", closed=False)  # handed over: b takes the stream (its claim waits)
        epoch_b = (await b.claim("s1")).epoch
        a.keep_terms("s1", epoch, {"zh": (9, 9)})  # the old life, late: fenced
        a.publish(final(1, epoch), Owner("w"), epoch)
        await appended(a, 2)
        fenced = await b.kept_terms("s1")
        b.end_stream("s1", closed=True)
        with anyio.fail_after(5):
            while await b.kept_terms("s1"):
                await anyio.sleep(0.005)
    finally:
        await a.aclose()
        await b.aclose()
        store.close()
    stats, kept, ttl = riding
    assert stats["append_round_trips"] == 1 and stats["terms_written"] == 1
    assert stats["terms_alone"] == 0
    assert kept == {"zh": (2, 1)}
    assert 0 < ttl <= 6 * 3600 * 1000
    stats, kept = alone
    assert stats["terms_alone"] == 1 and stats["append_round_trips"] == 2
    assert kept == {"zh": (3, 2)}
    assert epoch_b > epoch and fenced == {"zh": (3, 2)}


async def test_an_append_is_one_round_trip_and_survives_flushed_scripts(
    redis: RedisServer,
) -> None:
    """Appends go by their scripts' digests, one round trip a batch (Redis counts the
    reads it serves); a Redis that lost its scripts (restarted, flushed) gets them again
    and the append goes through."""
    import redis as redis_py

    bus = RedisBus(redis.url, lease_ms=60_000)  # no renewal or test write meanwhile
    await bus.start(["zh"])
    store = redis_py.Redis.from_url(redis.url, decode_responses=True)

    async def append(seq: int, epoch: int) -> None:
        update = TranslationUpdate("s1", seq, seq, "汤姆", "", True, 1.0, 1.0, epoch=epoch)
        bus.publish(dataclasses.replace(update, lang="zh"), Owner("w"), epoch)
        with anyio.fail_after(5):
            while bus.stats["appended"] <= seq:
                await anyio.sleep(0.002)

    try:
        epoch = (await bus.claim("s1")).epoch
        await append(0, epoch)  # the loop's connection made (its handshake is reads too)
        reads = store.info("stats")["total_reads_processed"]
        for seq in range(1, 21):
            await append(seq, epoch)
        reads = store.info("stats")["total_reads_processed"] - reads - 1  # the INFO itself
        store.script_flush()
        await append(21, epoch)
        history = await bus.history("s1", "zh")
    finally:
        await bus.aclose()
        store.close()
    # 20 appends, one read each (two before: SCRIPT EXISTS first); a connection the pool
    # opens meanwhile would add its handshake's.
    assert 20 <= reads <= 22
    assert bus.stats["scripts_loaded"] == 1 and bus.stats["appended"] == 22
    assert [entry.reply.seq for entry in history if entry.reply is not None] == list(range(22))


async def test_a_renewal_goes_by_digest_and_survives_flushed_scripts(
    redis: RedisServer,
) -> None:
    """Leases are renewed by their script's digest, one round trip a turn: a pipeline of
    redis-py's script objects asked Redis first whether it had the script (`SCRIPT
    EXISTS`, a command and a round trip more) at every turn. A Redis that lost its
    scripts gets the script again and the lease is still renewed."""
    import redis as redis_py

    bus = RedisBus(redis.url, lease_ms=300)  # a turn every 100 ms
    await bus.start(["zh"])
    store = redis_py.Redis.from_url(redis.url, decode_responses=True)

    def script_exists() -> int:
        stats = store.info("commandstats").get("cmdstat_script|exists", {})
        return int(stats.get("calls", 0)) if isinstance(stats, dict) else 0

    async def renewed(more: int) -> None:
        target = bus.stats["lease_renewals"] + more
        with anyio.fail_after(5):
            while bus.stats["lease_renewals"] < target:
                await anyio.sleep(0.01)

    try:
        await bus.claim("s1")
        await renewed(1)
        before, trips = script_exists(), bus.stats["renewal_round_trips"]
        await renewed(5)
        asked = script_exists() - before
        turns = bus.stats["renewal_round_trips"] - trips
        store.script_flush()
        loaded = bus.stats["scripts_loaded"]
        await renewed(2)
        reloaded = bus.stats["scripts_loaded"] - loaded
        lost = bus.stats["lease_losses"]
    finally:
        await bus.aclose()
        store.close()
    assert asked == 0 and turns >= 5
    assert reloaded >= 1 and lost == 0
