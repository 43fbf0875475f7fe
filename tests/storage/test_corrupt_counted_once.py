"""A damaged page file read by several reads at once counts as one corrupt file.

``corrupt`` counts files refused by their checks. Before, every concurrent read of one damaged
file counted (review 167: three loads of one key through vLLM said three), the ones that found the
file already out of the index too; a follower counted each refused read as well. The damage is
real: a payload byte flipped on disk."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of, reserve
from follow_helpers import WRITER_TAG, follow_config, started, store_page
from test_turns_wake import flip_payload_byte

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

READS = 3


async def _read_at_once(tier: DiskTier, pool: PagePool, i: int) -> list[bool]:
    """``READS`` reads of seed ``i``'s page started together, each into its own pool page."""
    into = [reserve(pool, key_of(800 + n, 99)) for n in range(READS)]
    try:
        return list(await asyncio.gather(*(tier.read(key_of(i, WRITER_TAG), h) for h in into)))
    finally:
        for handle in into:
            pool.table.abort(handle)


def _damage(tier: DiskTier, layout: KVLayout, i: int) -> None:
    flip_payload_byte(str(tier.files.path(key_of(i, WRITER_TAG))), layout.page_bytes)


@pytest.mark.asyncio
async def test_concurrent_reads_of_one_damaged_file_count_one_corrupt_file(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    cfg = follow_config(disk_dir, backend, 1 << 30)
    async with started(DiskTier(cfg, layout, pool)) as tier:
        assert await store_page(tier, pool, 1)
        _damage(tier, layout, 1)
        assert await _read_at_once(tier, pool, 1) == [False] * READS
        assert tier.statistics().corrupt == 1
        assert await _read_at_once(tier, pool, 1) == [False] * READS  # out of the index: misses
        assert tier.statistics().corrupt == 1
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_follower_counts_one_corrupt_file_for_concurrent_refused_reads(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    cfg = follow_config(disk_dir, backend, 1 << 30)
    async with started(DiskTier(cfg, layout, pool)) as writer:
        assert await store_page(writer, pool, 2)
        async with started(DiskTier(cfg, layout, pool)) as follower:
            assert follower.read_only is ReadOnly.LOCKED and follower.contains(key_of(2, WRITER_TAG))
            _damage(writer, layout, 2)
            assert await _read_at_once(follower, pool, 2) == [False] * READS
        # Closed before a look told why: the refusals count corrupt at the close, once for the file.
        assert follower.statistics().corrupt == 1, follower.statistics()
    assert_clean(pool)
