"""Spare files under real faults: a full ext4 (the batch's fallocate meets ENOSPC), a read-only
remount, and a writer SIGKILLed with spares on disk (the restart removes them, never indexes them)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import (
    BACKENDS,
    BIG,
    PER_FILE,
    assert_clean,
    config,
    fill,
    page_files,
    payload,
    read_page,
    ready_pool,
    reserve,
    seed_of,
    sigkilled_child,
    small_layout,
    spares_landed,
    temp_files,
    write_acked,
    write_page,
)
from fs_helpers import fill_up, loop_ext4, remount

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind, ReadOnly
from aiokv.storage.spares import SPARE_PREFIX


def spare_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.name.startswith(SPARE_PREFIX)]


async def stock_landed(tier: DiskTier) -> None:
    await spares_landed(tier)


@pytest.fixture
def big_pool() -> Iterator[PagePool]:
    with ready_pool(BIG, 8) as pool:
        yield pool


@pytest.mark.root
@pytest.mark.asyncio
async def test_full_file_system_stops_the_spares_and_writes_go_on(tmp_path: Path, backend: DiskBackend,
                                                                   big_pool: PagePool) -> None:
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, min_free_bytes=0, free_space_recheck_s=3600.0)
        stored: dict[int, torch.Tensor] = {}
        async with DiskTier(cfg, BIG, big_pool, spare_files=4) as tier:
            await stock_landed(tier)
            assert tier.spare_statistics().stock == 4
            # Another program fills the disk, leaving half a page file: the spares' blocks are
            # allocated already, the next batch's fallocate fails.
            fill_up(mount / "ballast", leave=PER_FILE // 2)
            for i in range(12):
                ok, stored[i] = await write_page(tier, big_pool, i)
                assert ok, f"page {i} did not reach the full disk"
            await stock_landed(tier)
            spares, stats = tier.spare_statistics(), tier.statistics()
            assert spares.taken == 4  # the four allocated before the disk filled
            assert spares.failed == 1  # then one batch failed; none started since (back-off)
            assert spares.batches == 2
            assert spares.stock == 0
            assert stats.errors[ErrorKind.ENOSPC] >= 1  # the writes after them made room as before
            assert tier._index.spares == 0
            assert stats.bytes_stored == stats.pages * PER_FILE == tier._index.used
            assert spare_files(mount / "disk") == []  # the failed spare did not stay
            for i in (10, 11):
                got = await read_page(tier, big_pool, i)
                assert got is not None
                assert torch.equal(got, stored[i])
            pages = stats.pages
        assert temp_files(mount / "disk") == []
        assert len(page_files(mount / "disk")) == pages
    assert_clean(big_pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_read_only_file_system_leaves_spares_to_the_next_writable_start(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool) -> None:
    with loop_ext4(tmp_path, 48) as mount:
        cfg = config(mount / "disk", backend, min_free_bytes=0)
        stored: dict[int, torch.Tensor] = {}
        async with DiskTier(cfg, BIG, big_pool, spare_files=4) as tier:
            await stock_landed(tier)
            for i in range(2):
                ok, stored[i] = await write_page(tier, big_pool, i)
                assert ok
            await stock_landed(tier)
            assert tier.spare_statistics().stock == 4
            remount(mount, "ro")
            ok, _ = await write_page(tier, big_pool, 2)  # takes a spare: its open for writing says EROFS
            assert not ok
            assert tier.read_only is ReadOnly.FILE_SYSTEM
            assert tier.spare_statistics().not_taken == 1
            assert tier.statistics().errors[ErrorKind.EPERM] == 1  # EROFS
            got = await read_page(tier, big_pool, 1)  # still serves
            assert got is not None
            assert torch.equal(got, stored[1])
        assert len(spare_files(mount / "disk")) == 4  # nothing can be removed there
        async with DiskTier(cfg, BIG, big_pool, spare_files=4) as again:  # read-only: makes none, removes none
            assert again.read_only is ReadOnly.FILE_SYSTEM
            assert again.spare_statistics().batches == 0
            assert again.statistics().pages == 2
        assert len(spare_files(mount / "disk")) == 4
        remount(mount, "rw")
        async with DiskTier(cfg, BIG, big_pool) as writable:
            assert writable.statistics().temp_files_removed == 4
            assert writable.statistics().pages == 2  # never indexed as pages
            assert spare_files(mount / "disk") == []
            for i in (0, 1):
                got = await read_page(writable, big_pool, i)
                assert got is not None
                assert torch.equal(got, stored[i])
    assert_clean(big_pool)


def spare_child(directory: str, backend: str, idle: bool, conn: Any) -> None:
    """Write pages with spares on (4 in flight), acknowledging each; with ``idle`` stop after 8
    pages once the stock is full and say so. Killed by the parent either way."""

    async def main() -> None:
        layout = small_layout()
        pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
        pool.wait_ready_blocking()
        async with DiskTier(config(Path(directory), DiskBackend(backend)), layout, pool, spare_files=8) as tier:
            for n in range(1 << 30):
                await asyncio.gather(*(write_acked(tier, pool, os.urandom(16), conn) for _ in range(4)))
                if idle and n == 1:
                    await stock_landed(tier)
                    conn.send(("idle", tier.spare_statistics().stock))
                    await asyncio.Event().wait()

    asyncio.run(main())


def _round(directory: Path, backend: str, idle: bool, acks: int) -> tuple[set[PageKey], int]:
    acked: set[PageKey] = set()
    stock = -1
    with sigkilled_child(spare_child, str(directory), backend, idle) as conn:
        while True:
            kind, value = conn.recv()
            if kind == "idle":
                stock = value
                break
            acked.add(value)
            if not idle and len(acked) >= acks:
                break
    return acked, stock


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("idle", [True, False], ids=["killed-idle", "killed-writing"])
async def test_sigkill_leaves_spares_that_the_restart_removes_and_never_indexes(
        disk_dir: Path, layout: KVLayout, pool: PagePool, idle: bool) -> None:
    for backend in BACKENDS:
        directory = disk_dir / backend.value
        acked, stock = await asyncio.to_thread(_round, directory, backend.value, idle, 10)
        left = len(spare_files(directory))
        if idle:
            # The stock refills in batches once at most half is left: after 8 pages it may stand at
            # anything up to 8 depending on when the last batch ran (it failed here under load as 6 == 8).
            assert 0 < stock <= 8
            assert left == stock  # a kill leaves the stock on disk
        async with DiskTier(config(directory, BACKENDS[0]), layout, pool) as tier:
            stats = tier.statistics()
            assert spare_files(directory) == []
            assert temp_files(directory) == []
            assert stats.temp_files_removed >= left
            keys = set(tier._index)
            assert acked <= keys
            assert len(page_files(directory)) == len(keys) == stats.pages  # no spare became a page
            for key in keys:
                into = reserve(pool, key)
                ok = await tier.read(key, into)
                got = payload(pool, into)
                pool.table.abort(into)
                if not ok:  # a kill mid-write into a spare leaves it under its spare name: removed above
                    pytest.fail(f"a served page failed verification ({backend.value})")
                expected = fill(pool, key, seed_of(key))
                assert torch.equal(got, payload(pool, expected))
                pool.table.release(expected)
                pool.table.discard(key)
    assert_clean(pool)
