"""Review 202: ``Cancels.finish`` runs a teardown step again when its own task is cancelled (a loop's
shutdown), a bounded number of times, and lets anything but a cancel through at once.

The worker's steps are covered with a real rank process in ``test_adv_rev202_loop_shutdown_teardown``;
these pin the helper's own bounds: a loop that cancels every task over and over must not keep the
teardown running a step for ever, and a ``KeyboardInterrupt`` (asyncio.run's second Ctrl-C, raised
inside whatever the loop runs) must reach the caller, not be taken for a cancel and run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from aiokv.tp.cancels import RUNS, Cancels, in_thread

BOUND_S = 10.0


async def _cancelled_in_its_own_task() -> None:
    """A step whose own task is cancelled while it waits (as a loop's shutdown does)."""
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    await asyncio.Event().wait()


@pytest.mark.asyncio
async def test_a_step_cancelled_once_runs_again_and_the_cancel_is_kept() -> None:
    runs = 0

    async def step() -> str:
        nonlocal runs
        runs += 1
        if runs == 1:
            await _cancelled_in_its_own_task()
        return "done"

    cancels = Cancels()
    async with asyncio.timeout(BOUND_S):
        assert await cancels.finish(step) == "done"
    assert runs == 2
    assert cancels.cancelled  # raised by raise_if_cancelled after the last step
    with pytest.raises(asyncio.CancelledError):
        cancels.raise_if_cancelled()


@pytest.mark.asyncio
async def test_a_step_cancelled_every_time_runs_a_bounded_number_of_times() -> None:
    runs = 0

    async def step() -> None:
        nonlocal runs
        runs += 1
        await _cancelled_in_its_own_task()

    cancels = Cancels()
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(asyncio.CancelledError):
            await cancels.finish(step)
    assert runs == RUNS, f"ran {runs} times, the bound is {RUNS}"


def test_a_keyboard_interrupt_in_a_step_is_not_run_again_nor_swallowed() -> None:
    runs = 0

    async def step() -> None:
        nonlocal runs
        runs += 1
        raise KeyboardInterrupt

    async def main() -> None:
        await Cancels().finish(step)

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    assert runs == 1


def test_a_thread_step_outlives_the_loop_s_shutdown() -> None:
    """asyncio.run ends while a thread step runs: the step's await goes on (a plain future, which
    the shutdown does not cancel) and the code after it runs once it is over."""
    entered, gate = threading.Event(), threading.Event()
    after: list[str] = []

    def work() -> str:
        entered.set()
        assert gate.wait(BOUND_S)
        return "unmapped"

    async def teardown() -> None:
        cancels = Cancels()
        after.append(await cancels.outlast(in_thread(work)))
        after.append(f"cancelled {cancels.cancelled}")

    async def watch() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            gate.set()  # the shutdown's cancel: it reached teardown() too, before the thread ends

    async def main() -> None:
        loop = asyncio.get_running_loop()
        left = {loop.create_task(teardown()), loop.create_task(watch())}  # left to the shutdown
        assert await asyncio.to_thread(entered.wait, BOUND_S)
        assert not any(task.done() for task in left)

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(main())
    assert after == ["unmapped", "cancelled True"]
