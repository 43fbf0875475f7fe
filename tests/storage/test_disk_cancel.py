"""Cancelling read/write at every await leaves no leaked page reference or reservation."""

from __future__ import annotations

import asyncio

import pytest
import torch
from cancel_points import most_attempts, pause
from disk_helpers import assert_clean, fill, gated, key_of, payload, reserve, spin

from aiokv.pool import PagePool
from aiokv.storage import DiskTier


@pytest.mark.asyncio
async def test_cancelled_read_waits_for_its_io_then_raises(tier: DiskTier, pool: PagePool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    h = fill(pool, key_of(1), 1)
    assert await tier.write(key_of(1), h)
    pool.table.release(h)
    gate, entered = asyncio.Event(), asyncio.Event()
    monkeypatch.setattr(tier.backend, "start_load", gated(tier.backend.start_load, gate, entered))
    into = reserve(pool, key_of(2))
    task = asyncio.create_task(tier.read(key_of(1), into))
    await entered.wait()
    task.cancel()
    await spin(5)
    assert not task.done()  # the I/O into the caller's page is not finished: the caller must wait
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    pool.table.abort(into)  # safe now: nothing writes into the page any more
    assert tier.statistics().in_flight == 0
    assert_clean(pool)


@pytest.mark.asyncio
async def test_cancelled_write_returns_at_once_and_finishes_in_background(
        tier: DiskTier, pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    gate, entered = asyncio.Event(), asyncio.Event()
    monkeypatch.setattr(tier.backend, "start_publish", gated(tier.backend.start_publish, gate, entered))
    h = fill(pool, key_of(1), 1)
    expect = payload(pool, h)
    task = asyncio.create_task(tier.write(key_of(1), h))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pool.table.release(h)  # the caller lets go; the job holds its own reference
    assert pool.table.statistics().referenced == 1
    gate.set()
    await tier.aclose()
    assert tier.contains(key_of(1))
    assert_clean(pool)
    pool.table.evict(64)
    async with DiskTier(tier.config, tier.layout, pool) as again:
        into = reserve(pool, key_of(1))
        assert await again.read(key_of(1), into)
        assert torch.equal(payload(pool, into), expect)
        pool.table.abort(into)
    assert_clean(pool)


DENSE = 64
"""Attempts counted in loop turns before the sleeps."""


@pytest.mark.asyncio
async def test_cancel_at_every_step(tier: DiskTier, pool: PagePool) -> None:
    """Cancel after 0, 1, 2, ... loop turns, then after growing sleeps (cancel_points.pause: a loop
    spinning through turns starves the threads backend's workers of the GIL), until the operations
    complete uncancelled."""
    stored = fill(pool, key_of(0), 0)
    assert await tier.write(key_of(0), stored)
    pool.table.release(stored)
    finished_read = finished_write = False
    step = 0
    while not (finished_read and finished_write):
        assert step < most_attempts(DENSE), "operations never completed"
        h = fill(pool, key_of(1000 + step), step)
        into = reserve(pool, key_of(2000 + step))
        write = asyncio.create_task(tier.write(key_of(1000 + step), h))
        read = asyncio.create_task(tier.read(key_of(0), into))
        await pause(step, DENSE)
        write.cancel()
        read.cancel()
        for task, is_read in ((write, False), (read, True)):
            try:
                result = await task
            except asyncio.CancelledError:
                continue
            assert result
            if is_read:
                finished_read = True
            else:
                finished_write = True
        pool.table.release(h)
        pool.table.abort(into)
        # A cancelled write's job goes on holding its page: wait for it, and empty the pool, or on
        # a loaded machine 64 pages ran out before the operations completed (reserve refused).
        await tier.flush()
        pool.table.evict(pool.num_pages)
        step += 1
    await tier.aclose()
    assert tier.statistics().in_flight == 0
    assert_clean(pool)


@pytest.mark.asyncio
async def test_cancelled_write_behind_wait_takes_no_ownership(tier: DiskTier, pool: PagePool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    gate, entered = asyncio.Event(), asyncio.Event()
    monkeypatch.setattr(tier.backend, "start_publish", gated(tier.backend.start_publish, gate, entered))
    handles = [fill(pool, key_of(i), i) for i in range(11)]
    for i in range(10):  # 2 workers take one each (gated), 8 fill the queue
        assert tier.write_behind_nowait(key_of(i), handles[i])
        await spin(1)
    assert not tier.write_behind_nowait(key_of(10), handles[10])
    waiting = asyncio.create_task(tier.write_behind(key_of(10), handles[10]))
    await spin(3)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    pool.table.release(handles[10])  # still ours: the cancelled wait took nothing
    gate.set()
    await tier.aclose()
    assert tier.statistics().writes == 10
    assert_clean(pool)
