"""A batch of reads on a real ext4 that dies under it (``EXT4_IOC_SHUTDOWN``: every read fails
with a real EIO), two I/O slots for twelve pages: each failed page's completion starts the next
page and submits it inside the ring's wake-up (#14). Every page is a counted EIO miss (none
refused as corrupt, every file kept), the batch ends, nothing stays in flight, and the same holds
for a batch cancelled while it streams (it returns only once no page is read into)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, fill, key_of, reserve, spin
from fs_helpers import loop_ext4, shut_down_ext4

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind

URING = [DiskBackend.URING_FIXED, DiskBackend.URING]
PAGES = 12


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
@pytest.mark.parametrize("cancel_after", [None, 0, 1, 2, 3, 5, 8],
                         ids=["whole", *(f"cancel-{n}" for n in (0, 1, 2, 3, 5, 8))])
async def test_a_batch_on_a_dying_ext4_ends_with_counted_eio_misses(tmp_path: Path, backend: DiskBackend,
                                                                     layout: KVLayout, pool: PagePool,
                                                                     cancel_after: int | None) -> None:
    with loop_ext4(tmp_path, 32) as mount:
        async with DiskTier(config(mount / "d", backend, queue_depth=2, min_free_bytes=0), layout, pool) as tier:
            for i in range(PAGES):
                h = fill(pool, key_of(i), i)
                assert await tier.write(key_of(i), h)
                pool.table.release(h)
            shut_down_ext4(mount)
            into = [reserve(pool, key_of(100 + i)) for i in range(PAGES)]
            task = asyncio.create_task(tier.read_many([key_of(i) for i in range(PAGES)], into))
            if cancel_after is not None:
                await spin(cancel_after)
                task.cancel()
            try:
                oks = await asyncio.wait_for(asyncio.shield(task), 30)
            except asyncio.CancelledError:
                assert cancel_after is not None
                assert tier.statistics().in_flight == 0  # returned only once nothing reads into its pages
            else:
                assert oks == [False] * PAGES
            for h in into:
                pool.table.abort(h)
            await tier.flush()
            stats = tier.statistics()
            assert (stats.hits, stats.corrupt, stats.in_flight) == (0, 0, 0)
            if cancel_after is None:
                assert stats.misses == stats.errors[ErrorKind.EIO] == PAGES
            else:  # cancelled before its first step (nothing), or every page a miss (those taken out
                # of the slot queue by the cancel as well)
                assert stats.misses in (0, PAGES)
                assert stats.errors[ErrorKind.EIO] <= stats.misses
            assert all(tier.contains(key_of(i)) for i in range(PAGES))  # an I/O error is no corruption
            assert tier._index.readers == {}
        assert_clean(pool)
