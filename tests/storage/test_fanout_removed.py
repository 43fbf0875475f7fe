"""A fan-out directory removed (or replaced) under the writing tier.

The tier writes page files relative to a descriptor of each fan-out directory held since start
(``layoutdir.Prepared.fanout``). An operator's ``find <cache> -empty -delete`` or a cleanup script
removing one left that descriptor naming a deleted directory (``st_nlink`` 0): every later write of
its keys failed (ENOENT on the create, counted ``OTHER``) until the process restarted, and a spare
taken for such a write was counted both taken and written. Now the tier notices on the ENOENT of a
write (or a read) in that fan-out, retires the descriptor (kept open until the close: an operation
in flight may still use it), opens the name again with the start's checks (made again, 0700, ours,
never a symlink) and the write that hit it goes to the new directory. Pages whose files went with
a removed directory (``rm -rf``) leave the index. A symlink or a file put in the directory's place
is refused as at start (``UNSAFE``), never followed. Real directories removed and replaced, every
backend.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from disk_helpers import (
    assert_clean,
    config,
    fill,
    key_of,
    page_files,
    payload,
    read_page,
    spares_landed,
    stored_page,
    write_page,
)

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage.pagefile import file_bytes

TAG = 0x3A
"""The fan-out directory the tests remove (``3a``): the first byte of ``key_of(i, TAG)``."""


async def _write(tier: DiskTier, pool: PagePool, i: int, tag: int = TAG) -> tuple[bool, torch.Tensor]:
    h = fill(pool, key_of(i, tag), i)
    data = payload(pool, h)
    try:
        ok = await tier.write(key_of(i, tag), h)
    finally:
        pool.table.release(h)
    pool.table.evict(pool.num_pages)
    return ok, data


async def _read(tier: DiskTier, pool: PagePool, i: int, tag: int = TAG) -> torch.Tensor | None:
    into_key = key_of(i, 0xEE)
    h = pool.reserve([into_key])[0].handle
    assert h is not None
    ok = await tier.read(key_of(i, tag), h)
    data = payload(pool, h) if ok else None
    pool.table.abort(h)
    return data


def _no_faults(tier: DiskTier) -> None:
    errors = tier.statistics().errors
    assert not any(errors.values()), errors


def _fanout(tier: DiskTier) -> Path:
    return tier.files.layout_dir / f"{TAG:02x}"


@pytest.mark.asyncio
async def test_an_empty_fan_out_directory_removed_is_made_again(disk_dir: Path, backend: DiskBackend,
                                                                layout: KVLayout, pool: PagePool) -> None:
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        await stored_page(tier, pool, 1)  # fan-out 00: untouched
        fan = _fanout(tier)
        os.rmdir(fan)  # empty: `find <cache> -empty -delete`
        for i in range(3):  # before: every one failed (ENOENT on the create, counted OTHER)
            ok, data = await _write(tier, pool, i)
            assert ok, f"write {i} into the removed fan-out directory failed: {tier.statistics().errors}"
            got = await _read(tier, pool, i)
            assert got is not None and torch.equal(got, data)
        _no_faults(tier)
        st = os.stat(fan, follow_symlinks=False)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert sorted(p.name for p in fan.iterdir()) == sorted(bytes.hex(key_of(i, TAG)) for i in range(3))
        assert tier._dir is not None and len(tier._dir.retired) == 1  # kept open until the close
        await tier.flush()
    assert_clean(pool)
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:  # a restart finds them
        assert all(tier.contains(key_of(i, TAG)) for i in range(3))


@pytest.mark.asyncio
async def test_a_spare_taken_for_a_removed_fan_out_directory(disk_dir: Path, backend: DiskBackend,
                                                             layout: KVLayout, pool: PagePool) -> None:
    async with DiskTier(config(disk_dir, backend), layout, pool, spare_files=4) as tier:
        await stored_page(tier, pool, 1)  # a first write starts the stock
        await spares_landed(tier)
        assert tier.spare_statistics().stock == 4
        spares_before = tier.spare_statistics()
        fan = _fanout(tier)
        assert not any(fan.iterdir())  # no spare landed in 3a (the page, in 00, took one)
        os.rmdir(fan)
        ok, data = await _write(tier, pool, 7)
        assert ok, tier.statistics().errors
        got = await _read(tier, pool, 7)
        assert got is not None and torch.equal(got, data)
        _no_faults(tier)
        spares = tier.spare_statistics()
        # Written through a spare (renamed into the directory made again), or into a new file with
        # the spare counted not taken: never both taken and failed.
        assert spares.taken + spares.not_taken == spares_before.taken + spares_before.not_taken + 1, spares
        await tier.flush()
        await spares_landed(tier)
        # Every spare left is still in stock (none overwritten and left behind under its name).
        names = [p.name for p in page_files(tier.files.layout_dir) if p.name.startswith(".spare-")]
        assert len(names) == tier.spare_statistics().stock, (names, tier.spare_statistics())
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_recycle_into_a_removed_fan_out_directory(disk_dir: Path, backend: DiskBackend,
                                                          layout: KVLayout, pool: PagePool) -> None:
    stored = 3
    async with DiskTier(config(disk_dir, backend, capacity=stored * file_bytes(layout)), layout, pool) as tier:
        for i in range(stored):
            await stored_page(tier, pool, i)  # fan-out 00, full: the next write recycles one
        os.rmdir(_fanout(tier))
        ok, data = await _write(tier, pool, 9)
        assert ok, tier.statistics().errors
        got = await _read(tier, pool, 9)
        assert got is not None and torch.equal(got, data)
        _no_faults(tier)
        await tier.flush()
        # What is on disk is what the index holds (the victim's overwritten file not left behind).
        files = page_files(tier.files.layout_dir)
        assert len(files) == len(tier._index) == stored, files
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_removed_non_empty_fan_out_directory_drops_its_pages(disk_dir: Path, backend: DiskBackend,
                                                                     layout: KVLayout, pool: PagePool) -> None:
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        kept = await stored_page(tier, pool, 1)  # fan-out 00
        for i in range(4):
            assert (await _write(tier, pool, i))[0]
        assert all(tier.contains(key_of(i, TAG)) for i in range(4))
        shutil.rmtree(_fanout(tier))  # `rm -rf 3a`: its pages are gone
        assert await _read(tier, pool, 0) is None  # a miss, as before
        # The rest of the directory's pages went with it: not served as present any more, and a
        # write of one stores it again (before: "already stored", nothing written).
        assert not any(tier.contains(key_of(i, TAG)) for i in range(4))
        ok, data = await _write(tier, pool, 2)
        assert ok
        got = await _read(tier, pool, 2)
        assert got is not None and torch.equal(got, data)
        got = await read_page(tier, pool, 1)
        assert got is not None and torch.equal(got, kept)
        _no_faults(tier)
        await tier.flush()
        assert len(page_files(tier.files.layout_dir)) == len(tier._index) == 2
        assert tier.statistics().bytes_stored == 2 * tier._file_bytes
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("planted", ["symlink", "file"])
async def test_a_fan_out_directory_replaced_is_refused(tmp_path: Path, backend: DiskBackend, layout: KVLayout,
                                                       pool: PagePool, planted: str) -> None:
    disk_dir = tmp_path / "disk"
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        fan = _fanout(tier)
        os.rmdir(fan)
        if planted == "symlink":
            os.symlink(outside, fan)
        else:
            fan.write_bytes(b"not a directory")
        for i in range(2):  # refused as at start, every time: never followed
            ok, _ = await _write(tier, pool, i)
            assert not ok
        errors = tier.statistics().errors
        assert errors[ErrorKind.UNSAFE] >= 2 and not errors[ErrorKind.OTHER], errors
        assert not any(tier.contains(key_of(i, TAG)) for i in range(2))
        await tier.flush()
        assert list(outside.iterdir()) == []
        assert fan.is_symlink() if planted == "symlink" else fan.is_file()
        # Gone again: the next write makes the directory and stores.
        os.unlink(fan)
        ok, data = await _write(tier, pool, 5)
        assert ok
        got = await _read(tier, pool, 5)
        assert got is not None and torch.equal(got, data)
        assert not fan.is_symlink() and fan.is_dir()
        (ok_other, _) = await write_page(tier, pool, 3)  # other fan-out directories unaffected
        assert ok_other
    assert list(outside.iterdir()) == []
    assert_clean(pool)
