"""What others may have put in the cache directory: symlinks, FIFOs and other special files, foreign
or hard-linked files under page-file names, directories others can write. Never followed, never
blocked on, never written through; each is a counted miss or a refused start."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, page_files, payload, reserve, temp_files

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage.pagefile import HEADER_BYTES

T = TypeVar("T")
OUTSIDE = b"precious bytes outside the cache\n" * 100


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside the cache that a planted symlink points at."""
    path = tmp_path / "outside.txt"
    path.write_bytes(OUTSIDE)
    return path


def _lexists(path: str) -> bool:
    return os.path.lexists(path)


def _contents(path: Path) -> bytes:
    return path.read_bytes()


async def _store(tier: DiskTier, pool: PagePool, i: int) -> torch.Tensor:
    h = fill(pool, key_of(i), i)
    data = payload(pool, h)
    assert await tier.write(key_of(i), h)
    pool.table.release(h)
    return data


async def _load(tier: DiskTier, pool: PagePool, i: int) -> bool:
    into = reserve(pool, key_of(1000 + i))
    try:
        return await tier.read(key_of(i), into)
    finally:
        pool.table.abort(into)


def _replace(path: str, plant: Callable[[str], None]) -> None:
    os.unlink(path)
    plant(path)


def _symlink_to(target: Path) -> Callable[[str], None]:
    return lambda path: os.symlink(target, path)


def _fifo(path: str) -> None:
    os.mkfifo(path, 0o600)


def _socket(path: str) -> None:
    os.mknod(path, 0o600 | stat.S_IFSOCK)  # a socket file nobody listens on (bind() limits path length)


def _device(path: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("creating a device node needs root")
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers


SPECIAL = [_fifo, _socket, _device]


async def _unblocking(path: str, work: Awaitable[T]) -> T:
    """``work``, failing the test (instead of hanging it) when it blocks on the FIFO at ``path``."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=30)
    if not done:
        # A thread (or io_uring worker) is stuck opening the FIFO: a writer lets it go.
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        await asyncio.wait({task})
        os.close(fd)
        pytest.fail("the tier blocked on a FIFO")
    return task.result()


# -- symlinks ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_symlink_at_a_final_name_is_never_followed(tier: DiskTier, pool: PagePool, outside: Path) -> None:
    await _store(tier, pool, 1)
    _replace(tier.files.path(key_of(1)), _symlink_to(outside))
    assert not await _load(tier, pool, 1)
    stats = tier.statistics()
    assert (stats.misses, stats.corrupt, stats.errors[ErrorKind.UNSAFE]) == (1, 0, 1)
    assert not tier.contains(key_of(1))
    await tier.aclose()
    assert _contents(outside) == OUTSIDE
    assert not _lexists(tier.files.path(key_of(1)))  # the planted link is gone, its target kept
    assert_clean(pool)


@pytest.mark.asyncio
async def test_recycling_never_writes_through_a_planted_symlink(disk_dir: Path, backend: DiskBackend,
                                                                layout: KVLayout, pool: PagePool,
                                                                outside: Path) -> None:
    # Regression: a full tier renamed its LRU file (here a planted symlink) to a temporary name and
    # opened that name for writing: the page bytes landed in the file outside the cache.
    per_file = HEADER_BYTES + layout.page_bytes
    async with DiskTier(config(disk_dir, backend, capacity=2 * per_file), layout, pool) as tier:
        await _store(tier, pool, 1)
        await _store(tier, pool, 2)
        _replace(tier.files.path(key_of(1)), _symlink_to(outside))
        data = await _store(tier, pool, 3)  # key 1 is the LRU file: its name is refused, a new file made
        stats = tier.statistics()
        assert (stats.errors[ErrorKind.UNSAFE], stats.recycled, stats.pages) == (1, 0, 2)
        into = reserve(pool, key_of(103))
        assert await tier.read(key_of(3), into)
        assert torch.equal(payload(pool, into), data)
        pool.table.abort(into)
    assert _contents(outside) == OUTSIDE
    assert not _lexists(tier.files.path(key_of(1)))
    assert temp_files(disk_dir) == []
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("recycle", [False, True], ids=["create", "recycle"])
async def test_symlink_at_a_temporary_name_is_never_followed(disk_dir: Path, backend: DiskBackend,
                                                             layout: KVLayout, pool: PagePool, outside: Path,
                                                             recycle: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    per_file = HEADER_BYTES + layout.page_bytes
    capacity = 2 * per_file if recycle else 1 << 30
    async with DiskTier(config(disk_dir, backend, capacity=capacity), layout, pool) as tier:
        await _store(tier, pool, 1)
        await _store(tier, pool, 2)
        temp = ".tmp-planted"  # in key 3's fan-out directory, where its temporary file goes
        os.symlink(outside, tier.files.layout_dir / key_of(3).hex()[:2] / temp)
        monkeypatch.setattr(tier.files, "temp_name", lambda _key: temp)  # the name the write will use
        h = fill(pool, key_of(3), 3)
        stored = await tier.write(key_of(3), h)
        pool.table.release(h)
        stats = tier.statistics()
        if recycle:
            # The recycled file was checked, written under its own name and renamed to key 3's:
            # no temporary name is involved, the planted link is left alone (removed at restart).
            assert stored
            assert (stats.recycled, stats.errors[ErrorKind.UNSAFE]) == (1, 0)
            assert (tier.files.layout_dir / key_of(3).hex()[:2] / temp).is_symlink()
        else:
            # Creating a temporary file is exclusive: the planted name is refused, counted.
            assert not stored
            assert stats.errors[ErrorKind.UNSAFE] == 1
        assert _contents(outside) == OUTSIDE
        assert await _load(tier, pool, 2)
    assert _contents(outside) == OUTSIDE
    assert_clean(pool)


# -- special files ----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("plant", SPECIAL, ids=lambda f: f.__name__.strip("_"))
async def test_special_file_at_a_final_name_is_a_prompt_miss(disk_dir: Path, backend: DiskBackend,
                                                             layout: KVLayout, pool: PagePool,
                                                             plant: Callable[[str], None]) -> None:
    # Regression: a FIFO in place of a page file blocked `read` (and then `aclose`) forever on the
    # threads backend and on buffered io_uring.
    tier = DiskTier(config(disk_dir, backend, direct_io=False), layout, pool)
    await tier.start()
    await _store(tier, pool, 1)
    path = tier.files.path(key_of(1))
    _replace(path, plant)
    assert not await _unblocking(path, _load(tier, pool, 1))
    stats = tier.statistics()
    assert (stats.misses, stats.corrupt, stats.errors[ErrorKind.UNSAFE]) == (1, 0, 1)
    await _unblocking(path, tier.aclose())
    assert not _lexists(path)
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
async def test_fifo_at_the_recycled_name_is_never_opened_blocking(disk_dir: Path, backend: DiskBackend,
                                                                  layout: KVLayout, pool: PagePool,
                                                                  direct: bool) -> None:
    per_file = HEADER_BYTES + layout.page_bytes
    tier = DiskTier(config(disk_dir, backend, capacity=2 * per_file, direct_io=direct), layout, pool)
    await tier.start()
    await _store(tier, pool, 1)
    await _store(tier, pool, 2)
    path = tier.files.path(key_of(1))
    _replace(path, _fifo)
    await _unblocking(path, _store(tier, pool, 3))  # a new file instead; the FIFO is removed
    assert tier.statistics().errors[ErrorKind.UNSAFE] == 1
    assert await _unblocking(path, _load(tier, pool, 3))
    await _unblocking(path, tier.aclose())
    assert not _lexists(path)
    assert_clean(pool)


# -- files that are not ours ------------------------------------------------------------------


@pytest.mark.root
@pytest.mark.asyncio
async def test_file_of_another_owner_is_refused(tier: DiskTier, pool: PagePool) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file away needs root")
    await _store(tier, pool, 1)
    os.chown(tier.files.path(key_of(1)), 12345, 12345)
    assert not await _load(tier, pool, 1)
    assert tier.statistics().errors[ErrorKind.UNSAFE] == 1
    assert_clean(pool)


@pytest.mark.asyncio
async def test_hard_linked_file_is_never_overwritten(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                     pool: PagePool, tmp_path: Path) -> None:
    per_file = HEADER_BYTES + layout.page_bytes
    async with DiskTier(config(disk_dir, backend, capacity=2 * per_file), layout, pool) as tier:
        await _store(tier, pool, 1)
        await _store(tier, pool, 2)
        other = tmp_path / "other-name"
        os.link(tier.files.path(key_of(1)), other)  # the same inode, also known elsewhere
        before = _contents(other)
        await _store(tier, pool, 3)  # key 1 is the LRU file: not recycled, as it has another link
        stats = tier.statistics()
        assert (stats.recycled, stats.errors[ErrorKind.UNSAFE]) == (0, 1)
    assert _contents(other) == before
    assert_clean(pool)


@pytest.mark.asyncio
async def test_scan_indexes_only_our_regular_files(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                   pool: PagePool, outside: Path) -> None:
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        for i in (1, 2, 3):
            await _store(tier, pool, i)
    _replace(tier.files.path(key_of(1)), _symlink_to(outside))
    _replace(tier.files.path(key_of(2)), _fifo)
    async with DiskTier(config(disk_dir, backend), layout, pool) as again:
        stats = again.statistics()
        assert (stats.pages, stats.skipped_at_scan, stats.errors[ErrorKind.UNSAFE]) == (1, 2, 2)
        assert again.contains(key_of(3))
    assert_clean(pool)


# -- directories ------------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.asyncio
async def test_directories_others_can_write_are_made_0700(disk_dir: Path, layout: KVLayout,
                                                          pool: PagePool) -> None:
    cfg = config(disk_dir, DiskBackend.THREADS)
    async with DiskTier(cfg, layout, pool) as tier:
        layout_dir = tier.files.layout_dir
    fanout = layout_dir / "7f"
    for path in (disk_dir, layout_dir, fanout):
        os.chmod(path, 0o777)
    async with DiskTier(cfg, layout, pool) as again:
        await _store(again, pool, 1)
    assert [_mode(p) for p in (disk_dir, layout_dir, fanout)] == [0o700] * 3
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_directory_of_another_owner_is_refused(disk_dir: Path, layout: KVLayout, pool: PagePool,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory away needs root")
    cfg = config(disk_dir, DiskBackend.THREADS)
    async with DiskTier(cfg, layout, pool):
        pass
    os.chown(disk_dir, 12345, 12345)
    with pytest.raises(PermissionError, match="belongs to uid 12345"):
        await DiskTier(cfg, layout, pool).start()
    assert any("belongs to uid 12345" in r.getMessage() for r in caplog.records)
    assert _mode(disk_dir) == 0o700  # left as it is
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["layout", "fanout"])
async def test_symlinked_directory_is_refused(disk_dir: Path, layout: KVLayout, pool: PagePool, tmp_path: Path,
                                              where: str) -> None:
    cfg = config(disk_dir, DiskBackend.THREADS)
    async with DiskTier(cfg, layout, pool) as tier:
        layout_dir = tier.files.layout_dir
    victim = layout_dir if where == "layout" else layout_dir / "00"
    elsewhere = tmp_path / "elsewhere"
    os.rename(victim, elsewhere)
    os.symlink(elsewhere, victim)
    with pytest.raises(PermissionError, match="not a directory"):
        await DiskTier(cfg, layout, pool).start()
    assert page_files(elsewhere) == []
    assert_clean(pool)
