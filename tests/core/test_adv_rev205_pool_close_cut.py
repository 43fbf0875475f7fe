"""A loop-wide cancel (an application's SIGTERM handler cancelling every task, a loop's shutdown)
that ends the pool's release task does not leave the pool for good: a later ``aclose()`` (or
``wait_freed()``) runs the release anew and the segment is freed, its memory unmapped once.

Before: the release ran in a task of its own awaited shielded; the cancel ended that task and every
later ``aclose()`` raised it at once: the /dev/shm segment stayed (TPCache.aclose, rerun since
458e74a, still raised there: found by review 205). And a cancel while the unmap waited for a thread
cancelled the unmap itself."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable

import pytest
import torch
from loop_probes import cancel_every_task_but_nowait, until_thread

from aiokv.layout import KVLayout
from aiokv.pool import PagePool

LAYOUT = KVLayout.mha(2, 2, 16, torch.bfloat16, page_tokens=8)


def _segment_left(pool: PagePool) -> bool:
    return os.path.exists("/dev/shm/" + pool.name.lstrip("/"))


@pytest.mark.asyncio
@pytest.mark.parametrize("again", ["aclose", "wait_freed"])
async def test_a_release_cut_while_unmapping_is_finished_by_the_next_close(
        monkeypatch: pytest.MonkeyPatch, again: str) -> None:
    pool = PagePool.create(LAYOUT, 4 * LAYOUT.page_bytes, register_cuda=False)
    await pool.wait_ready()
    entered, go = threading.Event(), threading.Event()
    real = pool.memory.close
    calls: list[int] = []

    def held_close() -> None:
        calls.append(1)
        entered.set()
        assert go.wait(30), "the test never let the unmap go"
        real()

    monkeypatch.setattr(pool.memory, "close", held_close)

    async def scenario() -> None:
        first = asyncio.ensure_future(pool.aclose())
        await until_thread(entered.is_set, "the unmap's thread in memory.close")
        cancel_every_task_but_nowait(asyncio.current_task())  # the application's SIGTERM handler
        await asyncio.wait({first})
        assert first.cancelled()
        go.set()
        async with asyncio.timeout(10):
            if again == "aclose":
                await pool.aclose()
            else:
                await pool.wait_freed()

    await scenario()
    assert pool._released and calls == [1], calls  # unmapped once, by the first release's thread
    assert not _segment_left(pool)


@pytest.mark.asyncio
async def test_a_release_cut_while_its_unmap_waits_for_a_thread_still_unmaps_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = PagePool.create(LAYOUT, 4 * LAYOUT.page_bytes, register_cuda=False, workers=1)
    await pool.wait_ready()
    free = threading.Event()
    calls: list[int] = []
    real_close = pool.memory.close

    def counted_close() -> None:
        calls.append(1)
        real_close()

    monkeypatch.setattr(pool.memory, "close", counted_close)
    submitted = asyncio.Event()
    real_submit = pool._executor.submit

    def submit(fn: Callable[..., object], /, *args: object, **kwargs: object) -> object:
        future = real_submit(fn, *args, **kwargs)
        if fn == counted_close:
            submitted.set()  # on the loop's thread: the release submits it there
        return future

    monkeypatch.setattr(pool._executor, "submit", submit)
    # The pool's one thread busy: the unmap queues behind it.
    real_submit(lambda: free.wait(30) or pytest.fail("the test never freed the pool's thread"))
    first = asyncio.ensure_future(pool.aclose())
    async with asyncio.timeout(10):
        await submitted.wait()
    cancel_every_task_but_nowait(asyncio.current_task())  # the application's SIGTERM handler
    await asyncio.wait({first})
    assert first.cancelled()
    free.set()
    async with asyncio.timeout(10):
        await pool.aclose()
    assert pool._released and calls == [1], calls
    assert not _segment_left(pool)
