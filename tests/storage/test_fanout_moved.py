"""A fan-out directory moved away whole, or removed with its files, under the writing tier.

The tier writes page files relative to a descriptor of each fan-out directory held since start.
3747302 retires a descriptor once a write or a read in it answers ENOENT. A directory *moved*
(``mv <layout>/3a /elsewhere/3a``, or renamed inside the layout directory) never answers ENOENT:
its descriptor still leads to a live directory, so the tier went on writing pages into it —
outside the cache directory. And ``rm -rf 3a`` followed only by writes of keys still indexed
failed no I/O: each write found its key stored and wrote nothing. Now the writer's periodic check
(every ``follow_interval_s``, with the lock's) ``fstat``s the layout directory and, when it
changed, checks each fan-out name against its descriptor: one that no longer leads to it is
retired as the ENOENT path does. Real renames and removals, every backend; the checks run when
the test asks (``LockChecks``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, key_of, no_spares_in_flight, page_files
from follow_helpers import follow_config, started
from test_fanout_removed import TAG, _fanout, _read, _write
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _no_faults(tier: DiskTier) -> None:
    errors = tier.statistics().errors
    assert not any(errors.values()), errors


@pytest.mark.asyncio
@pytest.mark.parametrize("to", ["outside", "inside", "replaced"])
async def test_writes_after_a_check_never_land_in_a_moved_fan_out_directory(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, to: str) -> None:
    """``mv 3a`` out of the cache, to another name inside the layout directory, or away with
    another directory of ours put in its place: after one check, writes of its keys land under the
    name ``3a`` in the layout directory; the moved directory gets nothing more."""
    disk_dir = tmp_path / "disk"
    async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as tier:
        checks = LockChecks(tier)
        for i in range(2):
            assert (await _write(tier, pool, i))[0]
        fan = _fanout(tier)
        moved = tmp_path / "elsewhere" if to == "outside" else tier.files.layout_dir / "3a.old"
        os.rename(fan, moved)
        if to == "replaced":
            os.mkdir(fan, 0o700)
        before = _names(moved)
        await checks.next()
        # Its pages moved with it: out of reach of the name, no longer served as present.
        assert not any(tier.contains(key_of(i, TAG)) for i in range(2))
        stored = {}
        for i in range(6):  # before: each landed in the moved directory, wherever it is now
            ok, stored[i] = await _write(tier, pool, i)
            assert ok, tier.statistics().errors
        await tier.flush()
        assert _names(moved) == before, "pages written into the moved fan-out directory"
        assert _names(fan) == sorted(bytes.hex(key_of(i, TAG)) for i in range(6))
        for i, data in stored.items():
            got = await _read(tier, pool, i)
            assert got is not None and torch.equal(got, data), i
        _no_faults(tier)
        assert tier._dir is not None and len(tier._dir.retired) == 1  # kept open until the close
    assert _names(moved) == before
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_removed_fan_out_directory_is_noticed_without_a_fault(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """``rm -rf 3a``, then only writes of keys still indexed (no I/O fails): after one check they
    are stored again (before: "stored", nothing written, for good)."""
    async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as tier:
        checks = LockChecks(tier)
        for i in range(4):
            assert (await _write(tier, pool, i))[0]
        shutil.rmtree(_fanout(tier))
        await checks.next()
        assert not any(tier.contains(key_of(i, TAG)) for i in range(4))
        stored = {}
        for i in range(4):
            ok, stored[i] = await _write(tier, pool, i)
            assert ok
        await tier.flush()
        assert _names(_fanout(tier)) == sorted(bytes.hex(key_of(i, TAG)) for i in range(4))
        for i, data in stored.items():
            got = await _read(tier, pool, i)
            assert got is not None and torch.equal(got, data), i
        assert tier.statistics().bytes_stored == 4 * tier._file_bytes
        _no_faults(tier)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_spares_in_a_moved_fan_out_directory_leave_the_stock(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """Spare files are made round robin over the fan-out directories: with 64, one lands in ``3a``.
    Moved away, it leaves the stock at the next check: no later write renames it back in (a page
    written through a file outside the cache) or counts on its room."""
    disk_dir = tmp_path / "disk"
    spares = 64
    async with started(DiskTier(follow_config(disk_dir, backend), layout, pool, spare_files=spares)) as tier:
        checks = LockChecks(tier)
        assert (await _write(tier, pool, 0, tag=0x00))[0]  # the first write starts the stock
        if tier._refill is not None:
            await asyncio.wait({tier._refill})
        fan, moved = _fanout(tier), tmp_path / "elsewhere"
        assert any(name.startswith(".spare-") for name in _names(fan)), _names(fan)
        os.rename(fan, moved)
        await checks.next()
        assert tier._dir is not None and len(tier._dir.retired) == 1
        retired = tier._dir.retired[0]
        assert all(spare.dir_fd != retired for spare in tier._spares._stock)
        for i in range(1, spares + 1):  # every spare in stock taken, and more
            assert (await _write(tier, pool, i, tag=0x00))[0]
        await tier.flush()
        await no_spares_in_flight(tier)
        inside = [p for p in page_files(tier.files.layout_dir) if p.name.startswith(".spare-")]
        assert len(inside) == tier.spare_statistics().stock, (inside, tier.spare_statistics())
        _no_faults(tier)
    assert_clean(pool)
