"""The tier's own tasks cancelled under it (a dying loop thread cancels every task on its loop):
no write hangs, ``aclose`` completes, nothing half-written is served."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import pytest
import torch
from disk_helpers import assert_clean, fill, key_of, reserve

from aiokv.pool import PagePool
from aiokv.storage import DiskTier
from aiokv.storage.backends import IOOp, UringPageIO

BOUND_S = 10.0
"""Upper bound on each wait here: the fixed code returns within a few loop iterations; without the
fix these waits never end (the bound turns a hang into a failure)."""


def _cancel_all_but_me() -> int:
    """Cancel every task on the loop but the test's own, as a dying loop thread does."""
    me = asyncio.current_task()
    others = [task for task in asyncio.all_tasks() if task is not me and not task.done()]
    for task in others:
        task.cancel()
    return len(others)


async def _caller(tier: DiskTier, pool: PagePool, how: str) -> tuple[asyncio.Task[bool], Any]:
    """A write of ``key_of(1)`` started as a task: from a pool page or from a caller's buffer."""
    if how == "write":
        held = fill(pool, key_of(1), 1)
        return asyncio.create_task(tier.write(key_of(1), held)), held
    buffer = torch.full((pool.layout.page_bytes,), 7, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    return asyncio.create_task(tier.write_from(key_of(1), view)), buffer


async def _check_after(tier: DiskTier, pool: PagePool, caller: asyncio.Task[bool]) -> None:
    async with asyncio.timeout(BOUND_S):
        result = await asyncio.gather(caller, return_exceptions=True)
    assert isinstance(result[0], asyncio.CancelledError) or result[0] is False
    assert not tier.contains(key_of(1))
    assert tier.statistics().in_flight == 0
    assert tier.statistics().bytes_stored == 0  # no room held by the ended write
    into = reserve(pool, key_of(2))
    assert not await tier.read(key_of(1), into)  # nothing served for the key
    pool.table.abort(into)
    async with asyncio.timeout(BOUND_S):
        await tier.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["write", "write_from"])
async def test_cancelled_internal_task_ends_the_write(tier: DiskTier, pool: PagePool, how: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A rename/unlink of the key in flight (planted): the write waits for it in ``_write_later``,
    # the tier's own task; that task (and every other one, the caller's included) is cancelled.
    planted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    tier._moving[key_of(1)] = planted
    spawned = asyncio.Event()
    real_spawn = tier._spawn

    def spawn(coro: Any) -> Any:
        spawned.set()
        return real_spawn(coro)

    monkeypatch.setattr(tier, "_spawn", spawn)
    caller, held = await _caller(tier, pool, how)
    async with asyncio.timeout(BOUND_S):
        await spawned.wait()  # hashed, its coroutine spawned
    assert _cancel_all_but_me() >= 2  # the caller and the tier's task (plus write-behind workers)
    await _check_after(tier, pool, caller)
    planted.cancel()
    if how == "write":
        pool.table.release(held)
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["write", "write_from"])
async def test_cancelled_chain_cleanup_ends_the_write(tier: DiskTier, pool: PagePool, how: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # io_uring: a broken write chain is cleaned up by a coroutine (close, unlink the temp file);
    # cancelling it must still end the write (ECANCELED), not orphan it.
    io = tier.backend
    if not isinstance(io, UringPageIO):
        pytest.skip("threads clean up inside the worker thread: no task to cancel")
    entered, gate = asyncio.Event(), asyncio.Event()
    real = io._publish_failed

    async def gated(*args: Any) -> None:
        entered.set()
        await gate.wait()  # cancelled here
        await real(*args)

    monkeypatch.setattr(io, "_publish_failed", gated)
    io.faults.inject(IOOp.WRITE, errno.EIO)
    caller, held = await _caller(tier, pool, how)
    async with asyncio.timeout(BOUND_S):
        await entered.wait()
    _cancel_all_but_me()
    await _check_after(tier, pool, caller)
    if how == "write":
        pool.table.release(held)
    assert_clean(pool)

