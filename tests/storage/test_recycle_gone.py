"""A write into a full tier recycles the least recently used page file (opened and checked,
overwritten under its own name, then renamed). When that file was unlinked behind the tier (an
operator, a cleanup script, another process), the recycle is not a fault of the write: the page goes
into a new file instead, is stored and reads back, and no I/O error is counted.

Unlinked before the recycle opened it, the open finds no file (this already worked). Unlinked after
the open, while the overwrite is in flight, the rename of the victim's name answered ENOENT: counted
as ``OTHER`` and the page was not stored (the caller's store reported failure). The test unlinks the
name for real at that moment: right after the backend's check of the file it opened. A spare file
(``spare_files``) is taken the same way and was lost the same way."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, key_of, page_files, read_page, stored_page, write_page

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, backends, safefiles
from aiokv.storage.pagefile import file_bytes

STORED = 4


def _next_victim(tier: DiskTier) -> Path:
    """The file the next write recycles: the index's least recently used entry (none is being read)."""
    victim = next(iter(tier._index._entries))
    return Path(tier.files.path(victim))


def _unlink_once_opened(name: str, unlink: Callable[[], None]) -> tuple[Callable[[int, str, bool], os.stat_result],
                                                                      threading.Event]:
    """``check_page_fd`` that, once it passed the file ``name`` opened for writing, calls ``unlink``
    (which removes that name for real)."""
    real, target = safefiles.check_page_fd, name
    unlinked = threading.Event()  # (the threads backend checks on a worker)

    def check(fd: int, name: str, write: bool) -> os.stat_result:
        st = real(fd, name, write)
        if write and name == target and not unlinked.is_set():
            unlink()
            unlinked.set()
        return st

    return check, unlinked


async def _assert_writes_on(tier: DiskTier, pool: PagePool, first: int) -> None:
    """The tier stores and recycles as before, and its files are what it indexes."""
    recycled = tier.statistics().recycled
    for i in range(first, first + STORED):
        await stored_page(tier, pool, i)
    stats = tier.statistics()
    assert not any(stats.errors.values()) and stats.recycled == recycled + STORED, stats
    await tier.flush()
    assert len(page_files(tier.files.layout_dir)) == len(tier._index) == STORED


@pytest.mark.asyncio
async def test_a_recycle_whose_file_was_unlinked_writes_a_new_file(disk_dir: Path, backend: DiskBackend,
                                                                   layout: KVLayout, pool: PagePool) -> None:
    async with DiskTier(config(disk_dir, backend, capacity=STORED * file_bytes(layout)), layout, pool) as tier:
        for i in range(STORED):
            await stored_page(tier, pool, i)
        victim = _next_victim(tier)
        assert victim.name == bytes.hex(key_of(0))
        os.unlink(victim)
        ok, data = await write_page(tier, pool, 100)
        stats = tier.statistics()
        assert ok and not any(stats.errors.values()), stats.errors
        assert tier.contains(key_of(100)) and not tier.contains(key_of(0))
        got = await read_page(tier, pool, 100)
        assert got is not None and torch.equal(got, data)
        await _assert_writes_on(tier, pool, 101)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_recycle_whose_file_is_unlinked_under_the_overwrite_writes_a_new_file(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with DiskTier(config(disk_dir, backend, capacity=STORED * file_bytes(layout)), layout, pool) as tier:
        for i in range(STORED):
            await stored_page(tier, pool, i)
        victim = _next_victim(tier)
        check, unlinked = _unlink_once_opened(victim.name, functools.partial(os.unlink, victim))
        monkeypatch.setattr(backends, "check_page_fd", check)  # io_uring: the victim opened on the loop or ring
        monkeypatch.setattr(safefiles, "check_page_fd", check)  # threads: open_page_file on a worker
        ok, data = await write_page(tier, pool, 100)
        assert unlinked.is_set(), "the recycle never opened its victim"
        monkeypatch.undo()
        stats = tier.statistics()
        assert ok, f"the page was not stored: {stats.errors}"
        assert not any(stats.errors.values()), stats.errors
        assert tier.contains(key_of(100)) and not tier.contains(key_of(0)) and not victim.exists()
        got = await read_page(tier, pool, 100)
        assert got is not None and torch.equal(got, data)
        await _assert_writes_on(tier, pool, 101)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_spare_unlinked_under_the_overwrite_means_a_new_file(disk_dir: Path, backend: DiskBackend,
                                                                     layout: KVLayout, pool: PagePool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    async with DiskTier(config(disk_dir, backend), layout, pool, spare_files=2) as tier:
        refill = tier._refill
        if refill is not None:
            await asyncio.wait({refill})
        first = tier._spares._stock[0]  # the one the write takes (oldest first)
        check, unlinked = _unlink_once_opened(first.name, functools.partial(os.unlink, first.name,
                                                                            dir_fd=first.dir_fd))
        monkeypatch.setattr(backends, "check_page_fd", check)
        monkeypatch.setattr(safefiles, "check_page_fd", check)
        ok, data = await write_page(tier, pool, 1)
        assert unlinked.is_set(), "the write never opened the spare"
        monkeypatch.undo()
        stats, spares = tier.statistics(), tier.spare_statistics()
        assert ok, f"the page was not stored: {stats.errors}"
        assert not any(stats.errors.values()), stats.errors  # gone is no fault
        assert (spares.taken, spares.not_taken) == (0, 1)
        got = await read_page(tier, pool, 1)
        assert got is not None and torch.equal(got, data)
    assert_clean(pool)
