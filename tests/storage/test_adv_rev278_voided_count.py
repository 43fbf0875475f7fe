"""Review 278 of 20a237d: ``DiskStatistics.write_behind_voided`` (write-behinds a delete of their
key discarded) against deletes racing queued and taken write-behinds of one key: a write a worker
took before the delete (in flight: discarded when it lands, not voided) is not counted; a second
delete does not count again what the first voided; an entry queued after the last delete is
written, never counted. Real tier, real files, each backend; checked after a reopen too."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, fill, key_of, read_page
from loop_probes import until

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

BOUND_S = 10.0


@pytest.mark.asyncio
async def test_deletes_racing_taken_and_queued_write_behinds_count_each_discarded_one_once(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    directory = tmp_path / "disk"
    key = key_of(1)
    async with DiskTier(config(directory, backend, write_behind_workers=1), layout, pool) as tier:
        assert tier.write_behind_nowait(key, fill(pool, key, 1))  # A1
        await until(lambda: tier.statistics().write_behind_writing == 1)  # taken: its write in flight

        def again() -> None:
            ref = pool.table.acquire(key)
            assert ref is not None and tier.write_behind_nowait(key, ref)
        again()  # A2, queued
        await tier.delete(key)  # A1 discarded when it lands (not voided), A2 voided
        again()  # A3
        await tier.delete(key)  # voids A2 (again) and A3: two in all, not three
        again()  # A4: written
        assert tier.statistics().write_behind_queued == 3
        async with asyncio.timeout(BOUND_S):
            await tier.flush()
        stats = tier.statistics()
        assert (stats.write_behind_voided, stats.dropped) == (2, 0), stats
        assert tier.contains(key)
    pool.table.evict(pool.num_pages)
    async with DiskTier(config(directory, backend), layout, pool) as tier:
        assert await read_page(tier, pool, 1) is not None  # A4, written after the deletes
        assert tier.statistics().write_behind_voided == 0  # (a count of this tier's run only)
    assert_clean(pool)
