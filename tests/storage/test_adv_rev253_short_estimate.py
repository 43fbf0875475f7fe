"""Review 253 of 654fb82 (a write's first try that evicts waits for the evicted files' unlinks
where the tier's estimate says the file system nearly full).

The tier looked at the free space again (``free_space_recheck_s``) only while the file system
held it below its budget. A tier at its budget whose estimate said "nearly full" (a start over a
full disk with the budget's worth of pages stored, or an ENOSPC while other writes held the room)
never looked again: once another program freed the disk, every first try that evicted still
waited for its unlinks, for the tier's life. Now a first try that waited on the estimate has the
tier look again when due (``free_space_recheck_s``), as while the file system limits it.

The faults are real: a small ext4 on a loop device, filled and then freed by another file (root
only). Each unlink of a first try's eviction is held until the write ended unless the write waits
for it (:func:`test_disk_fs.late_eviction_unlinks`), so a wait is seen, never a race."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from disk_helpers import BIG, PER_FILE, assert_clean, config, ready_pool, write_page
from fs_helpers import fill_up, loop_ext4
from test_disk_fs import late_eviction_unlinks

from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier


@pytest.fixture
def big_pool() -> Iterator[PagePool]:
    with ready_pool(BIG, 8) as pool:
        yield pool


@pytest.mark.root
@pytest.mark.asyncio
async def test_freed_disk_ends_the_waits_of_a_tier_at_its_budget(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    with loop_ext4(tmp_path, 24) as mount:
        # Its budget: the 10 pages written below. No recycling: a claim at the budget evicts.
        cfg = config(mount / "disk", backend, capacity=10 * PER_FILE, min_free_bytes=0,
                     free_space_recheck_s=0.0, recycle_files=False)
        async with DiskTier(cfg, BIG, big_pool) as tier:
            for i in range(10):
                ok, _ = await write_page(tier, big_pool, i)
                assert ok
        fill_up(mount / "ballast", leave=PER_FILE // 2)
        async with DiskTier(cfg, BIG, big_pool) as again:
            # At its budget (the disk's room is what it stores) and knowing the disk full.
            start = again.statistics()
            assert start.effective_capacity_bytes == start.capacity_bytes == start.bytes_stored
            # Another program frees its file: the disk has room for the budget many times over.
            os.unlink(mount / "ballast")
            waited = late_eviction_unlinks(again, monkeypatch)
            for i in range(10, 15):
                ok, _ = await write_page(again, big_pool, i)
                assert ok, f"page {i} was not stored"
            stats = again.statistics()
            assert (stats.evictions, stats.pages, sum(stats.errors.values())) == (5, 10, 0), stats.errors
            # The first waits (the estimate says the disk full); the look due at the next write sees
            # the room. Before: [True] * 5, and so on for good (no look at the free space again).
            assert waited == [True] + [False] * 4
    assert_clean(big_pool)
