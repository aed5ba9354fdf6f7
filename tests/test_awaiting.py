"""Decodes awaited on the event loop (`engine.streaming.awaiting`): futures resolved by
other threads wake their awaiters, each once, and the slots are taken in turn."""

from __future__ import annotations

import threading
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
