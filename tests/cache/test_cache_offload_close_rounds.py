"""An offload whose close lands between two rounds counts only what still needed a copy.

Regression: when the pool was full and the close began while ``offload`` waited for room, every key
not yet reserved was counted dropped and withdrawn, pages already in the pool (which the next
round would have skipped) included. Now those count as skipped.

Everything is real: the pool is full of pages that a reference of the test's and the write-behind
hold; the page writes wait behind the disk tier's I/O threads (each busy with a job of the test's,
on a ``threading.Event``, until the offload has returned), so the offload waits for room in the
manager's own wait. Only the cache's close can end that wait: ``offload_wait`` is far beyond the
test (the test fails if the close's first step no longer ends the wait).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, config, make_kv, prompt
from loop_probes import until, waiting_in

from aiokv import CacheStatistics, DiskBackend, KVCache, OffloadResult, TransferPath
from aiokv.pagetable import PageState
from aiokv.storage.backends import ThreadPageIO

T = LAYOUT.page_tokens
BOUND_S = 60.0  # every wait of the test is bounded: a hang fails instead


def _faults(stats: CacheStatistics) -> dict[str, int]:
    return {kind: n for kind, n in stats.errors.items() if n}


@pytest.mark.asyncio
async def test_a_close_between_rounds_counts_pages_in_the_pool_as_skipped(tmp_path: Path) -> None:
    cfg = config(tmp_path, pool_pages=8, backend=DiskBackend.THREADS, transfer_path=TransferPath.REFERENCE,
                 offload_wait=600.0)
    cache = KVCache(cfg, LAYOUT, make_kv())
    disk_free = threading.Event()
    try:
        await cache.start()
        await cache.pool.wait_ready()
        manager, table, disk = cache.manager, cache.pool.table, cache.disk
        assert disk is not None
        io = disk.backend
        assert isinstance(io, ThreadPageIO)
        s, t_, u = prompt(1, 3 * T), prompt(2, 5 * T), prompt(3, 2 * T)
        keys = manager.keys(s)
        assert (await cache.offload(s, torch.arange(len(s)))).stored == 3
        await cache.flush()  # on disk: the write-behind let go of s's pages
        last = table.acquire(keys[2])  # the third page of s stays (referenced, as a load would)
        assert last is not None
        # The disk gets slow: every I/O thread is busy, page writes queue behind (and keep their pages).
        busy = [io._start(disk_free.wait, BOUND_S) for _ in range(disk.config.threads)]
        assert (await cache.offload(t_, torch.arange(len(t_)))).stored == 5
        assert (await cache.offload(u, torch.arange(len(u)))).stored == 2  # evicts s's first two pages
        assert [table.state_of(k) for k in keys] == [PageState.FREE, PageState.FREE, PageState.READY]
        before = cache.stats()
        assert before.pool_referenced == 8 and before.pool_reserved == 0  # full: nothing evictable
        writing = disk.statistics()
        assert writing.in_flight or writing.write_behind_queued
        assert before.pages_withdrawn == before.pages_dropped == 0

        offload = asyncio.ensure_future(cache.offload(s, torch.arange(len(s))))
        await until(lambda: waiting_in(offload, "_wait_for_room"))  # the real wait: no room, disk busy
        closing = asyncio.ensure_future(cache.aclose())
        # The close's first step ends the wait: the offload returns while the disk is still busy
        # (without it the wait went on until a page reached disk or offload_wait passed).
        await until(offload.done)
        assert not any(job.done() for job in busy)
        after = cache.stats()
        states = [table.state_of(k) for k in keys]
        table.release(last)
        disk_free.set()
        async with asyncio.timeout(BOUND_S):
            await closing  # the write-behind drains once the disk is free again
    finally:
        disk_free.set()
        await cache.aclose()
    result = offload.result()
    # Two pages needed a copy (withdrawn by the close); the third is in the pool: skipped.
    assert result == OffloadResult(0, 1, 2)
    assert after.pages_withdrawn == 2
    assert after.pages_dropped == 2
    assert after.pages_skipped == before.pages_skipped + 1
    assert after.pages_stored == before.pages_stored
    assert not _faults(after), after.errors  # no pool_exhausted, no copy_failed: nothing is a fault
    # Nothing reserved for s's missing pages, nothing copied from the caller's slots, nothing running.
    assert states == [PageState.FREE, PageState.FREE, PageState.READY]
    assert after.pool_reserved == 0 and after.background_jobs == 0
    assert after.bytes_moved["gpu_to_pool"] == before.bytes_moved["gpu_to_pool"]
    assert after.pool_referenced == 8  # the write-behind's pages and ours: the close freed none early
    assert not _faults(cache.stats())
    assert all(job.result() for job in busy)  # the I/O threads were let go, not timed out
