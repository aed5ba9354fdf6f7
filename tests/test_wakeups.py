"""The event loop's wake-ups coalesced under load (`engine.streaming.wakeups`): the
decision on a given clock, the selector carrying it out over real sockets, and a real
loop gathering a busy sender's messages while serving a lone one at once."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from engine.streaming.wakeups import CoalescingSelector, WakeCoalescing, coalescing_loop


def test_a_quiet_loop_is_never_held() -> None:
    policy = WakeCoalescing(0.005)
    assert policy.polling(10.0) == 0.0  # nothing seen yet
    for i in range(20):  # a lone stream: a message and its answer every 300 ms
        policy.woke(10.0 + 0.3 * i, 1)
        policy.woke(10.001 + 0.3 * i, 1)
    assert not policy.gathering()
    assert policy.polling(15.702) == 0.0


def test_a_busy_loop_waits_out_the_rest_of_the_interval() -> None:
    policy = WakeCoalescing(0.005)
    for i in range(40):  # an event a millisecond: five an interval
        policy.woke(1.0 + i * 0.001, 1)
    assert policy.gathering()
    assert policy.polling(1.040) == pytest.approx(0.004)  # polled at 1.039: 4 ms left
    assert policy.polling(1.050) == 0.0  # the interval is over: poll at once


def test_a_few_streams_whose_events_come_further_apart_are_not_held() -> None:
    policy = WakeCoalescing(0.005)
    for i in range(40):  # an event every 4 ms: 1.25 an interval, fewer than two
        policy.woke(1.0 + i * 0.004, 1)
    assert not policy.gathering()
    assert policy.polling(1.157) == 0.0


def test_a_silence_ends_the_coalescing() -> None:
    policy = WakeCoalescing(0.005)
    for i in range(40):
        policy.woke(1.0 + i * 0.005, 4)  # coalesced: four events a poll, 5 ms apart
    assert policy.gathering()
    policy.woke(2.2, 1)  # nothing came for a second
    assert policy.polling(2.201) == 0.0


def test_a_loop_near_its_limit_never_pauses() -> None:
    policy = WakeCoalescing(0.005)
    for i in range(40):  # three events a millisecond, and 0.6 ms of work after each poll
        now = 1.0 + i * 0.001
        policy.polling(now - 0.0004)
        policy.woke(now, 3)
    assert not policy.gathering()
    assert policy.polling(1.0396) == 0.0
    for i in range(40):  # the same events, the work a tenth of it
        now = 1.04 + i * 0.001
        policy.polling(now - 0.00094)
        policy.woke(now, 3)
    assert policy.gathering()


def test_polls_without_events_lower_the_rate() -> None:
    policy = WakeCoalescing(0.005)
    for i in range(40):
        policy.woke(1.0 + i * 0.001, 1)
    assert policy.gathering()
    for i in range(40):  # timers only
        policy.woke(1.04 + i * 0.001, 0)
    assert not policy.gathering()


def test_an_interval_of_zero_never_holds_and_a_negative_one_is_refused() -> None:
    policy = WakeCoalescing(0.0)
    for i in range(10):
        policy.woke(i * 0.0001, 5)
    assert policy.polling(0.00095) == 0.0
    with pytest.raises(ValueError, match="negative"):
        WakeCoalescing(-0.001)


class FakeTime:
    """A clock that only `sleep` moves (the selector's polls take no time)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def busy_selector(interval: float) -> tuple[CoalescingSelector, FakeTime]:
    fake = FakeTime()
    selector = CoalescingSelector(interval, clock=fake.clock, sleep=fake.sleep)
    for _ in range(40):  # three events a millisecond
        fake.now += 0.001
        selector.coalescing.woke(fake.now, 3)
    return selector, fake


def test_a_busy_selector_sleeps_then_takes_every_ready_socket_in_one_poll() -> None:
    selector, fake = busy_selector(0.005)
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        for reader, _ in pairs:
            selector.register(reader, 1)  # EVENT_READ
        for _, writer in pairs:
            writer.send(b"x")
        ready = selector.select(timeout=None)
        assert fake.slept == [pytest.approx(0.005)]
        assert {key.fileobj for key, _ in ready} == {reader for reader, _ in pairs}
        fake.now += 0.001  # the loop's callbacks ran; a poll that must not block:
        assert len(selector.select(timeout=0)) == 3
        assert len(fake.slept) == 1
    finally:
        selector.close()
        for a, b in pairs:
            a.close()
            b.close()


def test_a_timer_due_within_the_interval_waits_for_it_at_most() -> None:
    selector, fake = busy_selector(0.005)
    reader, writer = socket.socketpair()
    try:
        selector.register(reader, 1)
        assert selector.select(timeout=0.002) == []  # a timer due in 2 ms: no events
        assert fake.slept == [pytest.approx(0.005)]  # late by 3 ms, within the interval
    finally:
        selector.close()
        reader.close()
        writer.close()


def test_a_quiet_selector_polls_at_once() -> None:
    fake = FakeTime()
    selector = CoalescingSelector(0.005, clock=fake.clock, sleep=fake.sleep)
    reader, writer = socket.socketpair()
    try:
        selector.register(reader, 1)
        writer.send(b"x")
        assert len(selector.select(timeout=None)) == 1
        assert fake.slept == []
    finally:
        selector.close()
        reader.close()
        writer.close()


def serve_reads(interval: float, sends: list[float]) -> tuple[list[int], list[float]]:
    """Bytes sent at `sends` (seconds from the start) by another thread, read on a loop of
    `coalescing_loop(interval)`: the bytes each read took, and each byte's delay from its
    send to its read."""
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    reads: list[int] = []
    delays: list[float] = []
    start = time.monotonic() + 0.05
    sent_at: list[float] = []

    def send() -> None:
        for at in sends:
            time.sleep(max(0.0, start + at - time.monotonic()))
            sent_at.append(time.monotonic())
            writer.send(b"x")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def readable() -> None:
            now = time.monotonic()
            data = reader.recv(4096)
            reads.append(len(data))
            seen = sum(reads)
            delays.extend(now - t for t in sent_at[seen - len(data) : seen])
            if seen == len(sends):
                done.set()

        loop.add_reader(reader.fileno(), readable)
        thread = threading.Thread(target=send)
        thread.start()
        try:
            await asyncio.wait_for(done.wait(), 30)
        finally:
            loop.remove_reader(reader.fileno())
            await asyncio.to_thread(thread.join)

    try:
        with asyncio.Runner(loop_factory=coalescing_loop(interval)) as runner:
            runner.run(main())
    finally:
        reader.close()
        writer.close()
    return reads, delays


def test_a_real_loop_gathers_a_busy_senders_messages_and_serves_a_lone_one_at_once() -> None:
    # 150 messages 2 ms apart, then one alone after a second's silence.
    sends = [i * 0.002 for i in range(150)] + [0.3 + 1.0]
    reads, delays = serve_reads(0.05, sends)
    assert sum(reads) == len(sends)  # nothing lost
    busy = reads[:-1]
    assert max(busy) >= 5  # gathered: 2 ms apart, polled at most every 50 ms while busy
    assert len(busy) <= 75
    assert max(delays[:-1]) < 0.05 + 0.5  # held no longer than the interval (and slack)
    assert reads[-1] == 1
    assert delays[-1] < 0.045  # after the silence: served before the interval would end


def test_interval_zero_is_asyncios_plain_loop() -> None:
    loop = coalescing_loop(0)()
    try:
        assert isinstance(loop, asyncio.SelectorEventLoop)
        assert not isinstance(loop._selector, CoalescingSelector)  # type: ignore[attr-defined]
    finally:
        loop.close()
