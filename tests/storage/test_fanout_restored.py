"""A fan-out directory of ours put back in place of a retired one.

f084194 and 3747302 retire a fan-out directory moved or removed under the writing tier and open
the name again at the next operation in it. A directory put back there (moved back, ``mv
/elsewhere/3a 3a``, or a backup restored) was opened but not listed: its page files were neither
indexed (never served) nor counted in the budget (never evicted: the tier's files could exceed it
for good) until the next start. Now a fan-out directory the writer opens late is listed on a
thread as a start lists it (files not ours refused and counted, leftover temporary and spare files
of other processes removed), its pages indexed as the least recently used and the index trimmed to
the budget; so is one unreadable at start (a real EIO: ``fuse_eio.py``). Real renames, copies and
removals, every backend; the checks run when the test asks (``LockChecks``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, key_of, page_files
from follow_helpers import follow_config, started
from fs_helpers import eio_directory
from test_fanout_removed import TAG, _fanout, _read, _write
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage.pagefile import file_bytes

OTHER = 0x10
"""A fan-out directory left alone."""


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _no_faults(tier: DiskTier) -> None:
    errors = tier.statistics().errors
    assert not any(errors.values()), errors


async def _settled(tier: DiskTier) -> None:
    """Until the tier's background tasks (listings of directories opened again, unlinks) ended."""
    async with asyncio.timeout(30):
        while pending := {task for task in tier._jobs if not task.done()}:
            await asyncio.wait(pending)


def _put_away(fan: Path, away: Path, how: str) -> None:
    if how == "moved":
        os.rename(fan, away)  # the same directory comes back
    else:
        shutil.copytree(fan, away)  # a backup, restored after the directory was removed
        shutil.rmtree(fan)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["moved", "restored"])
async def test_a_fan_out_directory_put_back_is_listed_and_served(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, how: str) -> None:
    """``mv 3a /elsewhere`` (or a backup taken, ``rm -rf 3a``), a check retires it, then the
    directory is put back: once the next write in it opened the name again, its pages are indexed,
    served bit for bit and counted (before: on disk, never served or counted until a restart)."""
    disk_dir = tmp_path / "disk"
    async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as tier:
        checks = LockChecks(tier)
        stored = {}
        for i in range(4):
            ok, stored[i] = await _write(tier, pool, i)
            assert ok
        fan, away = _fanout(tier), tmp_path / "elsewhere"
        _put_away(fan, away, how)
        await checks.next()
        assert not any(tier.contains(key_of(i, TAG)) for i in range(4))
        os.rename(away, fan)
        ok, stored[10] = await _write(tier, pool, 10)  # opens the name again
        assert ok
        await _settled(tier)
        assert all(tier.contains(key_of(i, TAG)) for i in stored), [tier.contains(key_of(i, TAG)) for i in stored]
        for i, data in stored.items():
            got = await _read(tier, pool, i)
            assert got is not None and torch.equal(got, data), i
        stats = tier.statistics()
        assert (stats.pages, stats.bytes_stored) == (5, 5 * file_bytes(layout)), stats
        _no_faults(tier)
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["moved", "restored"])
async def test_a_fan_out_directory_put_back_counts_in_the_budget(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, how: str) -> None:
    """A full tier (6 files) gets a directory of 4 pages back: its files are evicted as the budget
    requires (before: 10 page files on disk for a budget of 6, for good)."""
    disk_dir = tmp_path / "disk"
    budget = 6
    cfg = follow_config(disk_dir, backend, capacity=budget * file_bytes(layout))
    async with started(DiskTier(cfg, layout, pool)) as tier:
        checks = LockChecks(tier)
        for i in range(4):
            assert (await _write(tier, pool, i))[0]
        fan, away = _fanout(tier), tmp_path / "elsewhere"
        _put_away(fan, away, how)
        await checks.next()
        for i in range(budget):
            assert (await _write(tier, pool, i, tag=OTHER))[0]
        os.rename(away, fan)
        assert (await _write(tier, pool, 10))[0]  # opens the name again
        await _settled(tier)
        on_disk = page_files(tier.files.layout_dir)
        stats = tier.statistics()
        assert len(on_disk) <= budget, [p.name for p in on_disk]
        assert stats.pages == len(on_disk) and stats.bytes_stored <= budget * file_bytes(layout), stats
        assert tier.contains(key_of(10, TAG))
        _no_faults(tier)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_fan_out_directory_put_back_is_checked_as_a_start_checks_it(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """What a start refuses is refused in a directory put back: a symlink at a key's name (counted
    UNSAFE, never followed or indexed), a page of another fan-out's key, another process's leftover
    temporary and spare files (removed)."""
    disk_dir = tmp_path / "disk"
    async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as tier:
        checks = LockChecks(tier)
        ok, data = await _write(tier, pool, 0)
        assert ok
        fan, away = _fanout(tier), tmp_path / "elsewhere"
        os.rename(fan, away)
        await checks.next()
        outside = tmp_path / "outside"
        outside.write_bytes(b"x" * 4096)
        os.symlink(outside, away / bytes.hex(key_of(1, TAG)))
        shutil.copy(away / bytes.hex(key_of(0, TAG)), away / bytes.hex(key_of(2, OTHER)))
        temp = away / f".tmp-{bytes.hex(key_of(3, TAG))}-0123456789abcdef0"
        spare = away / ".spare-0123456789ab0"
        temp.write_bytes(b"")
        spare.write_bytes(b"")
        os.rename(away, fan)
        assert (await _write(tier, pool, 10))[0]
        await _settled(tier)
        assert tier.contains(key_of(0, TAG))
        assert not tier.contains(key_of(1, TAG)) and not tier.contains(key_of(2, OTHER))
        got = await _read(tier, pool, 0)
        assert got is not None and torch.equal(got, data)
        assert not temp.exists() and not spare.exists()
        assert (fan / bytes.hex(key_of(1, TAG))).is_symlink() and outside.read_bytes() == b"x" * 4096
        errors = tier.statistics().errors
        assert errors[ErrorKind.UNSAFE] == 1 and sum(errors.values()) == 1, errors
        assert tier.statistics().pages == 2
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_fan_out_directory_unreadable_at_start_is_listed_once_opened(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """A real EIO listing ``3a`` at start (``fuse_eio.py`` mounted over it): skipped, its pages not
    indexed. Once readable (unmounted) and opened by a write, its pages are indexed and served
    (before: not until the next start)."""
    stored = {}
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        for i in range(3):
            ok, stored[i] = await _write(tier, pool, i)
            assert ok
    with eio_directory(disk_dir / layout.fingerprint.hex() / f"{TAG:02x}"):
        again = DiskTier(config(disk_dir, backend), layout, pool)
        await again.start()
    try:
        assert again.statistics().skipped_at_scan == 1 and not again.contains(key_of(0, TAG))
        ok, stored[10] = await _write(again, pool, 10)  # the name opened now: the directory itself
        assert ok
        await _settled(again)
        assert all(again.contains(key_of(i, TAG)) for i in stored)
        for i, data in stored.items():
            got = await _read(again, pool, i)
            assert got is not None and torch.equal(got, data), i
        assert again.statistics().pages == 4
    finally:
        await again.aclose()
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["moved", "restored"])
async def test_a_fan_out_directory_put_back_is_listed_at_the_next_check(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, how: str) -> None:
    """Put back with no operation in it since: the writer's next check opens and lists it, so its
    pages are served and counted without waiting for a write of one of its keys."""
    disk_dir = tmp_path / "disk"
    async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as tier:
        checks = LockChecks(tier)
        stored = {}
        for i in range(3):
            ok, stored[i] = await _write(tier, pool, i)
            assert ok
        fan, away = _fanout(tier), tmp_path / "elsewhere"
        _put_away(fan, away, how)
        await checks.next()
        assert tier.statistics().pages == 0
        os.rename(away, fan)
        await checks.next()
        await _settled(tier)
        assert all(tier.contains(key_of(i, TAG)) for i in stored)
        for i, data in stored.items():
            got = await _read(tier, pool, i)
            assert got is not None and torch.equal(got, data), i
        assert tier.statistics().pages == 3
        _no_faults(tier)
    assert_clean(pool)
