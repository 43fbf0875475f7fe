"""A writer that lost its lock (``.lock`` removed, another cache writing there now) drops from its
index the pages the new writer evicted.

Before: the lost writer followed from an empty seed, so its first look only added what it listed
and never removed a key: pages the new writer evicted stayed indexed (its ``pages`` counted them,
a load read a missing file, a later take-over evicted by stale entries). The faults are real: the
file unlinked, a second tier writing and evicting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of, page_files
from follow_helpers import WRITER_TAG, Looks, read_back, started, store_page
from test_lock_replaced import FILES, LockChecks, _cfg, _lock

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly


@pytest.mark.asyncio
async def test_a_writer_that_lost_its_lock_forgets_the_pages_the_new_writer_evicted(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as a:
        checks = LockChecks(a)
        for i in range(FILES):
            assert await store_page(a, pool, i)
        os.unlink(_lock(a))
        async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as b:
            assert b.read_only is None
            await checks.next()
            assert a.read_only is ReadOnly.LOCKED and a.statistics().lock_lost == 1
            looks = Looks(a)
            for i in range(FILES, 2 * FILES):  # B evicts every page A stored
                assert await store_page(b, pool, i)
            on_disk = {p.name for p in page_files(a.files.layout_dir)}
            assert on_disk == {key_of(i, WRITER_TAG).hex() for i in range(FILES, 2 * FILES)}
            await looks.next()
            gone = [i for i in range(FILES) if a.contains(key_of(i, WRITER_TAG))]
            assert not gone, f"A still indexes evicted pages {gone}"
            assert a.statistics().pages == FILES
            for i in range(FILES, 2 * FILES):
                assert await read_back(a, pool, i), i
            failed = a.statistics().errors
            assert not any(failed.values()), failed
    assert_clean(pool)
