"""Decodes awaited on the event loop (`engine.streaming.awaiting`): futures resolved by
other threads wake their awaiters, each once, and the slots are taken in turn."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import weakref
from concurrent.futures import Future
from typing import Any

import anyio
import pytest

from engine.decoding.search import DecodingCancelled, Hypothesis
from engine.streaming.awaiting import Slots, hypotheses


def _hyp(n: int) -> Hypothesis:
    return Hypothesis((n,), 0.0, True)


@pytest.mark.anyio
async def test_futures_resolved_by_another_thread_wake_every_awaiter() -> None:
    """A lane answers many rows in one go: every awaiter gets its own answer."""
    futures: list[Future[Hypothesis]] = [Future() for _ in range(200)]
    got: dict[int, tuple[int, ...]] = {}

    async def wait(i: int) -> None:
        (hyp,) = await hypotheses([futures[i]])
        got[i] = hyp.token_ids

    def lane() -> None:
        for i, future in enumerate(futures):
            future.set_result(_hyp(i))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            for i in range(len(futures)):
                group.start_soon(wait, i)
            await anyio.sleep(0.01)
            threading.Thread(target=lane).start()
    assert got == {i: (i,) for i in range(200)}


@pytest.mark.anyio
async def test_several_futures_answered_by_several_threads_in_any_order() -> None:
    """One awaiter of several futures gets them all, in its order, once the last one is
    done, whichever thread answers which; an error among them is raised once all are."""
    futures: list[Future[Hypothesis]] = [Future() for _ in range(6)]
    lanes = [
        threading.Thread(target=lambda i=i: futures[i].set_result(_hyp(i)))
        for i in (4, 1, 5, 0, 3, 2)
    ]
    with anyio.fail_after(10):
        for lane in lanes:
            lane.start()
        hyps = await hypotheses(futures)
    assert [h.token_ids for h in hyps] == [(i,) for i in range(6)]
    failing: list[Future[Hypothesis]] = [Future(), Future()]
    threading.Thread(target=lambda: failing[0].set_exception(DecodingCancelled())).start()
    later = threading.Timer(0.05, lambda: failing[1].set_result(_hyp(7)))
    later.start()
    with anyio.fail_after(10), pytest.raises(DecodingCancelled):
        await hypotheses(failing)
    assert failing[1].done()  # raised only once all were answered


def test_a_loop_that_awaited_answers_is_let_go_with_its_descriptors() -> None:
    """Each loop's waking (its inbox) lives as long as the loop: a loop that is done
    is collected and leaves no descriptor open (before, the inbox held its loop, and
    every loop that ever awaited a decode stayed in memory)."""
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def one() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        future: Future[Hypothesis] = Future()
        threading.Timer(0.001, lambda: future.set_result(_hyp(1))).start()
        (hyp,) = await hypotheses([future])
        assert hyp.token_ids == (1,)

    for _ in range(20):
        asyncio.run(one())
    gc.collect()
    assert all(loop() is None for loop in loops)
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) <= fds


@pytest.mark.anyio
async def test_an_error_of_a_future_is_raised_and_a_cancelled_awaiter_leaves_it() -> None:
    failed: Future[Hypothesis] = Future()
    failed.set_exception(DecodingCancelled())
    with pytest.raises(DecodingCancelled):
        await hypotheses([failed])
    pending: Future[Hypothesis] = Future()
    with anyio.move_on_after(0.05):
        await hypotheses([pending])
    pending.set_result(_hyp(1))  # answered to no one: no error
    await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_slots_are_taken_in_turn_and_a_cancelled_waiter_passes_its_turn_on() -> None:
    slots = Slots(1)
    order: list[str] = []
    hold = anyio.Event()

    async def take(name: str, wait: Any = None) -> None:
        async with slots:
            order.append(name)
            if wait is not None:
                await wait.wait()

    gone = anyio.CancelScope()

    async def leave() -> None:
        with gone:
            await take("cancelled")

    async with anyio.create_task_group() as group:
        group.start_soon(take, "first", hold)
        await anyio.sleep(0.01)
        group.start_soon(leave)
        await anyio.sleep(0.01)
        group.start_soon(take, "second")
        group.start_soon(take, "third")
        await anyio.sleep(0.01)
        gone.cancel()
        await anyio.sleep(0.01)
        hold.set()
    assert order == ["first", "second", "third"]
    assert slots.free == 1
