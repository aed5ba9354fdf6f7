"""A task's wake-up (`engine.replies.Wake`: a stream runner's, a reply queue's): sets
before the task parks wake it once, a set while it is parked wakes it, a task cancelled
while parked leaves a wake that still works."""

from __future__ import annotations

import anyio
import pytest

from engine.replies import Wake

pytestmark = pytest.mark.anyio


async def test_sets_before_waiting_wake_once_then_it_parks() -> None:
    wake = Wake()
    wake.set()
    wake.set()
    with anyio.fail_after(1):
        await wake.wait()  # at once, and cleared
    assert not wake.is_set()
    with anyio.move_on_after(0.05) as parked:
        await wake.wait()
    assert parked.cancelled_caught  # nothing set since: it parks


async def test_a_set_wakes_the_parked_runner() -> None:
    wake = Wake()
    woken: list[int] = []

    async def runner() -> None:
        for i in range(3):
            await wake.wait()
            woken.append(i)

    with anyio.fail_after(2):
        async with anyio.create_task_group() as group:
            group.start_soon(runner)
            for i in range(3):
                await anyio.wait_all_tasks_blocked()
                assert woken == list(range(i))  # parked until set
                wake.set()
    assert woken == [0, 1, 2]


async def test_a_runner_cancelled_while_parked_leaves_a_working_wake() -> None:
    wake = Wake()
    with anyio.move_on_after(0.02):
        await wake.wait()
    wake.set()  # no waiter left, and nothing raised
    with anyio.fail_after(1):
        await wake.wait()
    assert not wake.is_set()
