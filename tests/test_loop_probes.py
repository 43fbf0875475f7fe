"""tests/loop_probes.py's cancel_within (the bound that keeps the suite's task hygiene from hanging),
until_thread, and no_loop_reports (a report that comes only at a collection is caught; a failing
block's reports go on to the previous handler)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from loop_probes import cancel_within, no_loop_reports, until_thread


async def _ignores_cancel(never: asyncio.Future[None]) -> None:
    while True:
        try:
            await asyncio.shield(never)
            return
        except asyncio.CancelledError:
            continue


async def _sleeps() -> None:
    await asyncio.sleep(3600)


@pytest.mark.asyncio
async def test_a_task_that_ignores_its_cancel_is_reported_within_the_bound() -> None:
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    stubborn = asyncio.create_task(_ignores_cancel(never))
    plain = asyncio.create_task(_sleeps())
    await asyncio.sleep(0)
    start = time.monotonic()
    stuck = await cancel_within([stubborn, plain], 0.2)
    assert 0.2 <= time.monotonic() - start < 5
    assert stuck == {stubborn}
    assert plain.cancelled()
    never.set_result(None)  # let it end, for the suite's own hygiene
    await stubborn


@pytest.mark.asyncio
async def test_tasks_that_end_on_their_cancel_return_at_once_with_their_errors_retrieved() -> None:
    async def raises_on_cancel() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("ended badly") from None

    tasks = [asyncio.create_task(raises_on_cancel()) for _ in range(3)]
    await asyncio.sleep(0)
    start = time.monotonic()
    assert await cancel_within(tasks, 30) == set()
    assert time.monotonic() - start < 1
    assert all(isinstance(t.exception(), RuntimeError) for t in tasks)
    assert await cancel_within([], 30) == set()


@pytest.mark.asyncio
async def test_until_thread_sees_what_a_thread_sets_beside_a_spinning_loop_and_bounds_the_wait() -> None:
    import threading

    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    start = time.monotonic()
    await until_thread(flag.is_set, "the timer's flag")
    assert time.monotonic() - start < 5
    with pytest.raises(AssertionError, match=r"never set not reached in 0\.1 s"):
        await until_thread(lambda: False, "never set", timeout_s=0.1)


def _drop_unretrieved_in_a_cycle(loop: asyncio.AbstractEventLoop) -> None:
    """A failed future nobody retrieved, dropped inside a reference cycle: asyncio reports it
    ("Future exception was never retrieved") only when a garbage collection frees it."""
    failed: asyncio.Future[None] = loop.create_future()
    failed.set_exception(RuntimeError("dropped unread"))
    cycle: list[Any] = [failed]
    cycle.append(cycle)


@pytest.mark.asyncio
async def test_no_loop_reports_fails_on_a_report_that_comes_only_at_the_collection() -> None:
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    with pytest.raises(AssertionError, match=r"the dropped future: .*never retrieved.*dropped unread"):
        async with no_loop_reports("the dropped future") as reports:
            _drop_unretrieved_in_a_cycle(loop)
    assert loop.get_exception_handler() is before
    assert len(reports.contexts) == 1, reports.contexts
    async with no_loop_reports() as reports:  # nothing dropped: passes, checked mid-block too
        await reports.assert_none()
    assert loop.get_exception_handler() is before


@pytest.mark.asyncio
async def test_no_loop_reports_passes_a_failing_blocks_reports_on_to_the_previous_handler() -> None:
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    outer: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: outer.append(context))

    async def failing_block() -> None:
        async with no_loop_reports():
            loop.call_exception_handler({"message": "reported in the block"})
            raise KeyError("the block failed")

    try:
        with pytest.raises(KeyError):
            await failing_block()
    finally:
        loop.set_exception_handler(before)
    assert [context["message"] for context in outer] == ["reported in the block"]
