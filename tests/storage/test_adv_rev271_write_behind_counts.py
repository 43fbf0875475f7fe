"""Helper 271: three leftovers of the write-behind's reviews 263 and 264.

- Workers a loop-wide cancel ended (an application's SIGTERM handler cancelling every task of the
  loop but its own) that the queue replaced were counted only in ``WriteBehind.workers_replaced``,
  not in ``DiskStatistics``: ``write_behind_workers_replaced`` now.
- Write-behinds a ``delete`` of their key discarded (review 264) were counted nowhere:
  ``write_behind_voided`` now.
- A ``write_behind`` already waiting for room when such a cancel ended every worker but spared it
  waited until another call (a put, a flush, the close) replaced them, for ever if none came: the
  wait in ``Queue.put`` noticed nothing. Its wait now ends when a worker ends, and it replaces them.

The cancel is real (every other task of the loop, the tier's own included); each test then closes
the tier, reopens the directory and reads the pages back bit-exact.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, payload, read_page
from loop_probes import cancel_every_task_but, until, until_thread, waiting_in

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

BOUND_S = 10.0

pytestmark = pytest.mark.asyncio


def _hand_over(tier: DiskTier, pool: PagePool, i: int) -> torch.Tensor:
    """``key_of(i)``'s page (seed ``i``) queued with ``write_behind_nowait``; returns its payload."""
    h = fill(pool, key_of(i), i)
    data = payload(pool, h)
    assert tier.write_behind_nowait(key_of(i), h)  # ownership handed over
    return data


async def _reopened_serves(directory: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
                           pages: dict[int, torch.Tensor], absent: tuple[int, ...] = ()) -> None:
    """A fresh tier on ``directory`` serves every page of ``pages`` bit-exact and none of ``absent``."""
    pool.table.evict(pool.num_pages)  # (the pages' pool copies, unreferenced by now)
    async with DiskTier(config(directory, backend), layout, pool) as tier:
        for i, want in pages.items():
            got = await read_page(tier, pool, i)
            assert got is not None, f"page {i} not served after a reopen"
            assert torch.equal(got, want), f"page {i} differs"
        for i in absent:
            assert not tier.contains(key_of(i)), f"page {i} is on disk"
            assert await read_page(tier, pool, i) is None
    assert_clean(pool)


@pytest.mark.parametrize("then", ["flush", "write_behind"])
async def test_workers_a_loop_wide_cancel_ended_are_counted_replaced(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, then: str) -> None:
    """Six pages queued (no worker ran since), the cut: the next flush, or write-behind, replaces
    both workers (counted) and the pages are written."""
    directory = tmp_path / "disk"
    async with DiskTier(config(directory, backend, write_behind_workers=2), layout, pool) as tier:
        pages = {i: _hand_over(tier, pool, i) for i in range(6)}
        assert await cancel_every_task_but(asyncio.current_task()) >= 2  # the two workers at least
        stats = tier.statistics()
        assert (stats.write_behind_queued, stats.write_behind_workers_replaced) == (6, 0), stats
        if then == "write_behind":
            h = fill(pool, key_of(6), 6)
            pages[6] = payload(pool, h)
            await tier.write_behind(key_of(6), h)  # (room: no loop turn)
            assert tier.statistics().write_behind_workers_replaced == 2
        async with asyncio.timeout(BOUND_S):
            await tier.flush()
        stats = tier.statistics()
        assert (stats.write_behind_workers_replaced, stats.write_behind_queued, stats.writes) == (2, 0, len(pages)), \
            stats
    await _reopened_serves(directory, backend, layout, pool, pages)


async def test_write_behinds_a_delete_voided_are_counted(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """Key 1 queued twice and key 3 once, then both deleted; key 2 queued among them and kept:
    three write-behinds voided, counted (not as dropped), none on disk; key 2 written."""
    directory = tmp_path / "disk"
    async with DiskTier(config(directory, backend), layout, pool) as tier:
        _hand_over(tier, pool, 1)
        again = pool.table.acquire(key_of(1))
        assert again is not None
        assert tier.write_behind_nowait(key_of(1), again)
        kept = _hand_over(tier, pool, 2)
        _hand_over(tier, pool, 3)
        for i in (1, 3):
            await tier.delete(key_of(i))  # (no loop turn: no worker took an entry yet)
        assert tier.statistics().write_behind_queued == 4
        async with asyncio.timeout(BOUND_S):
            await tier.flush()
        stats = tier.statistics()
        assert (stats.write_behind_voided, stats.dropped, stats.writes) == (3, 0, 1), stats
    await _reopened_serves(directory, backend, layout, pool, {2: kept}, absent=(1, 3))


class _HeldWrites:
    """The tier's page writes held at the backend's start (a new file's publish, or the recycle of
    a spare or a victim) until :meth:`release`: those held start then, later ones at once. No task
    holds them (a loop-wide cancel would end it, and the write with it)."""

    NAMES = ("start_publish", "start_recycle")

    def __init__(self, tier: DiskTier) -> None:
        self._io = tier.backend
        self.held: list[Callable[[], None]] = []
        for name in self.NAMES:
            setattr(self._io, name, functools.partial(self._hold, getattr(self._io, name)))

    def _hold(self, real: Callable[..., None], *args: Any) -> None:
        self.held.append(functools.partial(real, *args))

    def release(self) -> None:
        for name in self.NAMES:
            if name in vars(self._io):
                delattr(self._io, name)  # the class's method again
        while self.held:
            self.held.pop(0)()


async def test_a_put_waiting_for_room_outlives_the_cut_of_every_worker(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """One worker, a queue of one. The worker's write of page 1 is held at the backend, page 2
    fills the queue, a ``write_behind`` of page 3 waits for room; the cut ends the worker and
    spares that put. With no other call the put queues its page (before: it waited for ever), the
    replacement is counted, and every page is written: page 1 by its job (which the cut worker
    left), pages 2 and 3 by the new worker."""
    directory = tmp_path / "disk"
    cfg = config(directory, backend, write_behind_depth=1, write_behind_workers=1)
    async with DiskTier(cfg, layout, pool) as tier:
        writes = _HeldWrites(tier)
        putting: asyncio.Task[None] | None = None
        try:
            pages = {1: _hand_over(tier, pool, 1)}
            await until_thread(lambda: len(writes.held) == 1, "page 1's write held")  # (hashed on a thread first)
            pages[2] = _hand_over(tier, pool, 2)
            h = fill(pool, key_of(3), 3)
            pages[3] = payload(pool, h)
            assert not tier.write_behind_nowait(key_of(3), h)  # the queue is full
            putting = asyncio.create_task(tier.write_behind(key_of(3), h))
            await until(lambda: waiting_in(putting, "put"))
            assert await cancel_every_task_but(asyncio.current_task(), putting) >= 1
            stats = tier.statistics()
            assert (stats.write_behind_queued, stats.write_behind_writing) == (1, 0), stats  # the worker ended
            async with asyncio.timeout(BOUND_S):
                await asyncio.shield(putting)  # TimeoutError before the fix
            assert tier.statistics().write_behind_workers_replaced == 1
        finally:
            writes.release()
            if putting is not None and not putting.done():
                putting.cancel()
                await asyncio.wait({putting})
                pool.table.release(h)  # (its ownership never taken)
        async with asyncio.timeout(BOUND_S):
            await tier.flush()
        stats = tier.statistics()
        assert (stats.write_behind_queued, stats.write_behind_writing, stats.writes) == (0, 0, 3), stats
        assert stats.write_behind_workers_replaced == 1
    await _reopened_serves(directory, backend, layout, pool, pages)

