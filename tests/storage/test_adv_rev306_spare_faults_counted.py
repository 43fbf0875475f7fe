"""Review 306: a batch of spare files that failed (an ext4 shut down under the tier: EIO) was
logged ("cannot make spare files") and counted only in ``SpareStatistics.failed``, in no error
count the cache reports (``DiskStatistics.errors``, the cache's ``stats().errors``). Now its fault
is counted by kind once per batch. The close's removal of the stock on the shut-down file system
counts each spare's failed unlink once. Every backend; a real ``EXT4_IOC_SHUTDOWN``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from disk_helpers import BIG, assert_clean, config, ready_pool, spares_landed
from fs_helpers import loop_ext4, shut_down_ext4

from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind


@pytest.fixture
def big_pool() -> Iterator[PagePool]:
    with ready_pool(BIG, 4) as pool:
        yield pool


def _errors(tier: DiskTier) -> dict[ErrorKind, int]:
    return {kind: n for kind, n in tier.statistics().errors.items() if n}


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_spare_batch_failed_by_a_shut_down_file_system_is_counted_once(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool, caplog: pytest.LogCaptureFixture) -> None:
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, min_free_bytes=0)
        tier = DiskTier(cfg, BIG, big_pool, spare_files=4)
        await tier.start()
        try:
            await spares_landed(tier)
            assert tier.spare_statistics().stock == 4
            # The stock removed (healthy unlinks), so the next batch is wanted at once.
            tier._remove_spares(tier._spares.drain())
            while tier._jobs:
                await asyncio.wait(set(tier._jobs))
            assert tier.spare_statistics().removed == 4
            shut_down_ext4(mount)
            with caplog.at_level(logging.WARNING):
                tier._refill_spares()
                assert tier._refill is not None
                await spares_landed(tier)
            spares = tier.spare_statistics()
            assert (spares.failed, spares.stock, spares.making) == (1, 0, 0), spares
            assert any("cannot make spare files" in r.getMessage() for r in caplog.records)
            assert _errors(tier) == {ErrorKind.EIO: 1}  # before: {} (counted nowhere but `failed`)
        finally:
            await tier.aclose()
        # The close had no stock to remove; nothing counted twice.
        assert tier.spare_statistics().failed == 1
        assert _errors(tier) == {ErrorKind.EIO: 1}
    assert_clean(big_pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_the_close_counts_each_spare_it_cannot_remove_from_a_shut_down_file_system(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool) -> None:
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, min_free_bytes=0)
        tier = DiskTier(cfg, BIG, big_pool, spare_files=4)
        await tier.start()
        try:
            await spares_landed(tier)
            assert tier.spare_statistics().stock == 4
            shut_down_ext4(mount)
        finally:
            await tier.aclose()
        spares = tier.spare_statistics()
        assert (spares.stock, spares.removed, spares.failed) == (0, 0, 0), spares
        assert _errors(tier) == {ErrorKind.EIO: 4}  # each unlink once
        assert tier._index.spares == 0
    assert_clean(big_pool)
