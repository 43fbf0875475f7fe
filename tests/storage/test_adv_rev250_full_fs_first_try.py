"""Review 250: a write's first try did not wait for the unlinks of the pages its claim evicted (only
a retry after ENOSPC did). On a file system the tier knew nearly full (one shared with other data,
or smaller than the budget), an unlink landing after the new file took its blocks cost the write an
ENOSPC, a second eviction (a page lost for nothing) and a retry, and the room the late unlink freed
stayed unused until the next free-space check. Now a first try waits for them where the tier's
estimate of the free space (the last ``statvfs``, bytes and inodes, less what its files took since
and the evicted files whose unlink has not landed, its own and other writes') would not keep one
more file's bytes; elsewhere it still goes at once, which the roomy test pins (a budget-bounded
tier on a roomy file system: the fast path).

The faults are real: a small ext4 on a loop device, filled by another file, or its inodes used up
(root only). Each unlink of a first try's eviction is held until the write ended or met ENOSPC
unless the write waits for it (:func:`test_disk_fs.late_eviction_unlinks`): the late order is
certain where the write does not wait. All but the roomy test fail before the fix."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from disk_helpers import BIG, PER_FILE, assert_clean, config, key_of, read_page, ready_pool, write_page
from fs_helpers import fill_up, loop_ext4, use_up_inodes
from loop_probes import until_thread
from test_disk_fs import late_eviction_unlinks, waits_for_unlinks

from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind


@pytest.fixture
def big_pool() -> Iterator[PagePool]:
    with ready_pool(BIG, 8) as pool:
        yield pool


@pytest.mark.root
@pytest.mark.asyncio
async def test_nearly_full_file_system_first_try_waits_for_its_unlinks(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    with loop_ext4(tmp_path, 24) as mount:
        # No recycling: a claim at capacity evicts (and unlinks) rather than overwrites.
        cfg = config(mount / "disk", backend, min_free_bytes=0, free_space_recheck_s=3600.0,
                     recycle_files=False)
        stored: dict[int, torch.Tensor] = {}
        async with DiskTier(cfg, BIG, big_pool) as tier:
            for i in range(10):
                ok, stored[i] = await write_page(tier, big_pool, i)
                assert ok
        # Another program fills the disk, leaving less than one page file; the tier started over it
        # knows (its start's statvfs): a new page fits only in an evicted page's blocks.
        fill_up(mount / "ballast", leave=PER_FILE // 2)
        async with DiskTier(cfg, BIG, big_pool) as again:
            start = again.statistics()
            assert (start.pages, start.evictions) == (10, 0)
            assert start.effective_capacity_bytes < start.bytes_stored + PER_FILE
            waited = late_eviction_unlinks(again, monkeypatch)
            for i in range(10, 15):
                ok, stored[i] = await write_page(again, big_pool, i)
                assert ok, f"page {i} was not stored"
            stats = again.statistics()
            # Before: a first try met ENOSPC (its eviction's unlink landing late), evicted a second
            # page and retried: 1-2 ENOSPC, 6-7 evictions, 8-9 pages left, the freed room unused.
            assert (stats.errors[ErrorKind.ENOSPC], stats.evictions, stats.pages) == (0, 5, 10), stats.errors
            assert sum(stats.errors.values()) == 0, stats.errors
            assert stats.effective_capacity_bytes == start.effective_capacity_bytes
            assert waited == [True] * 5
            for i in (13, 14):
                got = await read_page(again, big_pool, i)
                assert got is not None
                assert torch.equal(got, stored[i])
            assert not again.contains(key_of(4)) and again.contains(key_of(5))
    assert_clean(big_pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_no_free_inode_first_try_waits_for_its_unlinks(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same where inodes run out, bytes plenty: the new file's create needs the inode the
    # evicted file's unlink frees (before, counting bytes only, the write went at once: ENOSPC).
    with loop_ext4(tmp_path, 32, inodes=300) as mount:  # 288 inodes; 259 go to the directories
        cfg = config(mount / "disk", backend, min_free_bytes=0, free_space_recheck_s=3600.0,
                     recycle_files=False)
        async with DiskTier(cfg, BIG, big_pool) as tier:
            for i in range(10):
                ok, _ = await write_page(tier, big_pool, i)
                assert ok
        use_up_inodes(mount)
        st = os.statvfs(mount)
        assert st.f_favail == 0 and st.f_bavail * st.f_frsize > 4 * PER_FILE
        async with DiskTier(cfg, BIG, big_pool) as again:
            waited = late_eviction_unlinks(again, monkeypatch)
            for i in range(10, 15):
                ok, _ = await write_page(again, big_pool, i)
                assert ok, f"page {i} was not stored"
            stats = again.statistics()
            assert (stats.errors[ErrorKind.ENOSPC], stats.evictions, stats.pages) == (0, 5, 10), stats.errors
            assert sum(stats.errors.values()) == 0, stats.errors
            assert waited == [True] * 5
    assert_clean(big_pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_roomy_file_system_first_try_does_not_wait_for_its_unlinks(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fast path kept: a tier bounded by its budget, far under the file system's free space,
    # evicts a page for each new one and writes without waiting for the unlink (which lands only
    # after the write ended here: a write that waited for it would be recorded as waiting).
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, capacity=4 * PER_FILE, min_free_bytes=0, recycle_files=False)
        async with DiskTier(cfg, BIG, big_pool) as tier:
            for i in range(4):
                ok, _ = await write_page(tier, big_pool, i)
                assert ok
            waited = late_eviction_unlinks(tier, monkeypatch)
            for i in range(4, 10):
                ok, _ = await write_page(tier, big_pool, i)
                assert ok
            stats = tier.statistics()
            assert waited == [False] * 6
            assert (stats.evictions, stats.pages, sum(stats.errors.values())) == (6, 4, 0)
    assert_clean(big_pool)


def _held_unlinks_of_concurrent_writes(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every unlink the tier starts lands once each write in flight ended or an ENOSPC was counted
    (after the new files took their blocks), or as soon as some write in flight waits for unlinks
    (parked for those its claim started: then none is held)."""
    io = tier._io
    assert io is not None
    really_unlink = io.unlink

    def enospc() -> int:
        return tier.statistics().errors[ErrorKind.ENOSPC]

    def released(failed: int) -> bool:
        jobs = list(tier._writing.values())
        return (enospc() > failed or not jobs
                or any(waits_for_unlinks(job) for job in jobs))

    async def late_unlink(dir_fd: int, name: str) -> None:
        failed = enospc()
        await until_thread(lambda: released(failed), "the writes' ends, an ENOSPC or a write waiting")
        await really_unlink(dir_fd, name)

    monkeypatch.setattr(io, "unlink", late_unlink)


@pytest.mark.root
@pytest.mark.asyncio
async def test_concurrent_first_tries_count_each_others_unlinks(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The estimate also takes off the evicted files whose unlink is in flight for other writes:
    # with 2.5 files' bytes free (no root reserve: the tier's ENOSPC comes where statvfs' available
    # bytes end) and min_free_bytes of 2 files, each claim evicts one page; three writes at once
    # would take 3 files' blocks before their unlinks land. The first goes at once (1.5 files left
    # by the estimate), the others wait for their unlinks. Counting only its own evictions, each
    # would see 1.5 files left and go: one ENOSPC, a page lost.
    with loop_ext4(tmp_path, 24, reserved_percent=0) as mount:
        cfg = config(mount / "disk", backend, min_free_bytes=2 * PER_FILE, free_space_recheck_s=3600.0,
                     recycle_files=False)
        async with DiskTier(cfg, BIG, big_pool) as tier:
            for i in range(10):
                ok, _ = await write_page(tier, big_pool, i)
                assert ok
        fill_up(mount / "ballast", leave=2 * PER_FILE + PER_FILE // 2)
        st = os.statvfs(mount)
        assert 2 * PER_FILE < st.f_bavail * st.f_frsize < 3 * PER_FILE
        async with DiskTier(cfg, BIG, big_pool) as again:
            start = again.statistics()
            assert start.effective_capacity_bytes < start.bytes_stored + PER_FILE
            _held_unlinks_of_concurrent_writes(again, monkeypatch)
            done = await asyncio.gather(*(write_page(again, big_pool, i) for i in range(10, 13)))
            stats = again.statistics()
            assert [ok for ok, _ in done] == [True] * 3
            assert (stats.errors[ErrorKind.ENOSPC], stats.evictions, stats.pages) == (0, 3, 10), stats.errors
            assert sum(stats.errors.values()) == 0, stats.errors
            for i, (_, data) in zip(range(10, 13), done, strict=True):
                got = await read_page(again, big_pool, i)
                assert got is not None
                assert torch.equal(got, data)
    assert_clean(big_pool)
