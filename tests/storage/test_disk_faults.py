"""Corrupt files, injected I/O faults, backend fallbacks: each a counted miss (real faults: test_disk_fs.py)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, page_files, payload, reserve, temp_files

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage import backends as backends_mod
from aiokv.storage import uring as uring_mod
from aiokv.storage.backends import IOOp, UringPageIO
from aiokv.storage.pagefile import HEADER_BYTES


async def _store(tier: DiskTier, pool: PagePool, i: int) -> torch.Tensor:
    h = fill(pool, key_of(i), i)
    data = payload(pool, h)
    assert await tier.write(key_of(i), h)
    pool.table.release(h)
    return data


async def _read_ok(tier: DiskTier, pool: PagePool, i: int, expect: torch.Tensor) -> None:
    into = reserve(pool, key_of(1000 + i))
    assert await tier.read(key_of(i), into)
    assert torch.equal(payload(pool, into), expect)
    pool.table.abort(into)


def _exists(path: Path | str) -> bool:
    return os.path.exists(path)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _truncate(path: Path, _layout: KVLayout) -> None:
    os.truncate(path, path.stat().st_size - 4096)


def _flip_payload(path: Path, layout: KVLayout) -> None:
    _flip(path, HEADER_BYTES + layout.payload_bytes - 1)


def _flip_header(path: Path, _layout: KVLayout) -> None:
    _flip(path, 2000)  # inside the zero padding: only the header checksum can notice


def _flip_header_field(path: Path, _layout: KVLayout) -> None:
    _flip(path, 60)  # inside the payload-length field


CORRUPTIONS = [_truncate, _flip_payload, _flip_header, _flip_header_field]


@pytest.mark.asyncio
@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
async def test_corrupt_file_is_a_counted_miss_and_deleted(tier: DiskTier, pool: PagePool, layout: KVLayout,
                                                          corrupt: object) -> None:
    good = await _store(tier, pool, 1)
    await _store(tier, pool, 2)
    path = Path(tier.files.path(key_of(2)))
    corrupt(path, layout)  # type: ignore[operator]
    into = reserve(pool, key_of(50))
    assert not await tier.read(key_of(2), into)
    pool.table.abort(into)
    await tier.delete(key_of(999))  # a no-op; lets the background unlink land first
    assert not tier.contains(key_of(2))
    stats = tier.statistics()
    assert (stats.corrupt, stats.misses, stats.pages) == (1, 1, 1)
    await tier.aclose()  # waits for the unlink
    assert not _exists(path)
    assert sum(stats.errors.values()) == 0
    tier2 = DiskTier(tier.config, layout, pool)
    async with tier2:
        await _read_ok(tier2, pool, 1, good)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_foreign_key_and_foreign_layout_are_refused(tier: DiskTier, pool: PagePool, layout: KVLayout,
                                                          disk_dir: Path, backend: DiskBackend) -> None:
    await _store(tier, pool, 1)
    await _store(tier, pool, 2)
    # Key 2's file moved under key 3's name: the header names key 2.
    os.rename(tier.files.path(key_of(2)), tier.files.path(key_of(3)))
    # A page of another layout with the same byte size, placed under key 4's name.
    other = KVLayout.mha(2, 2, 64, torch.bfloat16, page_tokens=16)
    assert other.page_bytes == layout.page_bytes
    other_pool = PagePool.create(other, 4 * other.page_bytes, register_cuda=False, workers=1)
    try:
        other_pool.wait_ready_blocking()
        async with DiskTier(config(disk_dir, backend), other, other_pool) as foreign:
            assert foreign.statistics().pages == 0  # layout 1's files are not served to layout 2
            h = fill(other_pool, key_of(4), 4)
            assert await foreign.write(key_of(4), h)
            other_pool.table.release(h)
            shutil.copy(foreign.files.path(key_of(4)), tier.files.path(key_of(4)))
    finally:
        other_pool.close()
    await tier.aclose()
    async with DiskTier(tier.config, layout, pool) as again:
        assert again.keys_present_prefix([key_of(1), key_of(3), key_of(4)]) == 3
        for i in (3, 4):
            into = reserve(pool, key_of(100 + i))
            assert not await again.read(key_of(i), into)
            pool.table.abort(into)
        assert again.statistics().corrupt == 2
    assert not _exists(tier.files.path(key_of(3)))
    assert not _exists(tier.files.path(key_of(4)))
    assert_clean(pool)


# ENOSPC is a capacity signal (evict, retry): see test_injected_enospc_* and the real one on ext4.
WRITE_FAULTS = [(IOOp.OPEN, errno.EACCES, ErrorKind.EPERM),
                (IOOp.RENAME, errno.EIO, ErrorKind.EIO), (IOOp.WRITE, errno.EINVAL, ErrorKind.OTHER)]


@pytest.mark.asyncio
@pytest.mark.parametrize(("op", "err", "kind"), WRITE_FAULTS, ids=lambda v: getattr(v, "name", str(v)))
async def test_injected_write_fault(tier: DiskTier, pool: PagePool, disk_dir: Path, op: IOOp, err: int,
                                    kind: ErrorKind, caplog: pytest.LogCaptureFixture) -> None:
    good = await _store(tier, pool, 1)
    for i in (2, 3):
        tier.backend.faults.inject(op, err)
        h = fill(pool, key_of(i), i)
        assert not await tier.write(key_of(i), h)
        pool.table.release(h)
        assert not tier.contains(key_of(i))
    stats = tier.statistics()
    assert stats.errors[kind] == 2
    assert stats.writes == 1
    assert stats.bytes_stored == stats.pages * (HEADER_BYTES + tier.layout.page_bytes)
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1  # logged once per kind
    await _read_ok(tier, pool, 1, good)  # keeps serving what it has
    await _store(tier, pool, 4)  # and writes again once the fault is gone
    await tier.aclose()
    assert temp_files(disk_dir) == []
    assert_clean(pool)


@pytest.mark.asyncio
async def test_injected_enospc_evicts_the_lru_file_and_retries(disk_dir: Path, backend: DiskBackend,
                                                               layout: KVLayout, pool: PagePool) -> None:
    per_file = HEADER_BYTES + layout.page_bytes
    async with DiskTier(config(disk_dir, backend, free_space_recheck_s=3600.0), layout, pool) as tier:
        await _store(tier, pool, 1)
        await _store(tier, pool, 2)
        tier.backend.faults.inject(IOOp.WRITE, errno.ENOSPC)
        data = await _store(tier, pool, 3)  # the file system said full: key 1 (LRU) made room
        stats = tier.statistics()
        assert [tier.contains(key_of(i)) for i in (1, 2, 3)] == [False, True, True]
        assert (stats.errors[ErrorKind.ENOSPC], stats.evictions, stats.pages) == (1, 1, 2)
        assert stats.effective_capacity_bytes == 2 * per_file  # what the file system holds, for now
        await _store(tier, pool, 4)  # stays within it
        assert [tier.contains(key_of(i)) for i in (2, 3, 4)] == [False, True, True]
        await _read_ok(tier, pool, 3, data)
    async with DiskTier(config(disk_dir, backend), layout, pool) as again:  # a restart looks again
        assert again.statistics().effective_capacity_bytes == again.config.capacity_bytes
        assert again.statistics().pages == 2
    assert_clean(pool)


@pytest.mark.asyncio
async def test_injected_enospc_retries_are_bounded(tier: DiskTier, pool: PagePool) -> None:
    for i in range(4):
        await _store(tier, pool, i)
    attempts = 1 + tier.config.enospc_retries
    tier.backend.faults.inject(IOOp.WRITE, errno.ENOSPC, attempts)
    h = fill(pool, key_of(9), 9)
    assert not await tier.write(key_of(9), h)
    pool.table.release(h)
    stats = tier.statistics()
    assert stats.errors[ErrorKind.ENOSPC] == attempts
    assert stats.evictions == attempts - 1  # one file evicted for each retry, no more
    assert stats.pages == 4 - stats.evictions
    assert stats.bytes_stored == stats.pages * (HEADER_BYTES + tier.layout.page_bytes)
    assert temp_files(tier.config.directory) == []
    assert_clean(pool)


@pytest.mark.asyncio
async def test_fault_while_overwriting_a_recycled_file(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                       pool: PagePool) -> None:
    per_file = HEADER_BYTES + layout.page_bytes
    async with DiskTier(config(disk_dir, backend, capacity=2 * per_file), layout, pool) as tier:
        await _store(tier, pool, 1)
        good = await _store(tier, pool, 2)
        tier.backend.faults.inject(IOOp.WRITE, errno.EIO)
        h = fill(pool, key_of(3), 3)
        assert not await tier.write(key_of(3), h)  # key 1's file was recycled, then the write failed
        pool.table.release(h)
        stats = tier.statistics()
        assert (stats.pages, stats.recycled, stats.errors[ErrorKind.EIO]) == (1, 1, 1)
        assert stats.bytes_stored == per_file
        await _read_ok(tier, pool, 2, good)
    assert temp_files(disk_dir) == []
    assert len(page_files(disk_dir)) == 1
    assert_clean(pool)


@pytest.mark.asyncio
async def test_injected_read_fault(tier: DiskTier, pool: PagePool) -> None:
    good = await _store(tier, pool, 1)
    tier.backend.faults.inject(IOOp.READ, errno.EIO)
    into = reserve(pool, key_of(9))
    assert not await tier.read(key_of(1), into)
    pool.table.abort(into)
    stats = tier.statistics()
    assert stats.errors[ErrorKind.EIO] == 1
    assert stats.corrupt == 0
    await _read_ok(tier, pool, 1, good)  # an I/O error is not corruption: the file stays
    assert_clean(pool)


@pytest.mark.asyncio
async def test_file_removed_behind_our_back_is_a_plain_miss(tier: DiskTier, pool: PagePool) -> None:
    await _store(tier, pool, 1)
    os.unlink(tier.files.path(key_of(1)))
    into = reserve(pool, key_of(9))
    assert not await tier.read(key_of(1), into)
    pool.table.abort(into)
    stats = tier.statistics()
    assert (stats.misses, stats.corrupt, sum(stats.errors.values()), stats.pages) == (1, 0, 0, 0)


# -- fallbacks --------------------------------------------------------------------------------


def _refuse_setup(_entries: int, _params: object) -> int:
    raise OSError(errno.EPERM, "io_uring refused (injected)")


@pytest.mark.asyncio
async def test_auto_falls_back_to_threads_when_io_uring_is_refused(
        disk_dir: Path, layout: KVLayout, pool: PagePool, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(uring_mod, "io_uring_setup", _refuse_setup)
    with caplog.at_level(logging.WARNING):
        async with DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool) as tier:
            assert tier.statistics().backend is DiskBackend.THREADS
            data = await _store(tier, pool, 1)
            await _read_ok(tier, pool, 1, data)
    assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] != []
    for forced in (DiskBackend.URING, DiskBackend.URING_FIXED):
        with pytest.raises(OSError, match="refused"):
            await DiskTier(config(disk_dir, forced), layout, pool).start()
    assert_clean(pool)


_BUFFER_REGISTRATION = (uring_mod.IORING_REGISTER_BUFFERS, uring_mod.IORING_REGISTER_BUFFERS2,
                        uring_mod.IORING_REGISTER_BUFFERS_UPDATE)


@pytest.mark.asyncio
async def test_auto_falls_back_to_unregistered_buffers(disk_dir: Path, layout: KVLayout, pool: PagePool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real = uring_mod.io_uring_register

    def no_memlock(fd: int, opcode: int, arg: object, nr: int) -> int:
        if opcode in _BUFFER_REGISTRATION:
            raise OSError(errno.ENOMEM, "memlock (injected)")
        return real(fd, opcode, arg, nr)  # type: ignore[arg-type]

    monkeypatch.setattr(uring_mod, "io_uring_register", no_memlock)
    async with DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool) as tier:
        assert tier.statistics().backend is DiskBackend.URING
        data = await _store(tier, pool, 1)
        await _read_ok(tier, pool, 1, data)
    with pytest.raises(OSError, match="memlock"):
        await DiskTier(config(disk_dir, DiskBackend.URING_FIXED), layout, pool).start()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_auto_serves_before_the_pool_is_registered(disk_dir: Path, layout: KVLayout, pool: PagePool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression (#11 start-up): the tier waited for the whole pool to be registered as fixed
    # buffers (pinning faults in every page: ~1 s/GiB, a minute for a large pool) before it started.
    real = uring_mod.io_uring_register
    gate = threading.Event()

    def slow_register(fd: int, opcode: int, arg: object, nr: int) -> int:
        if opcode in _BUFFER_REGISTRATION:
            gate.wait()  # registration still pinning the pool
        return real(fd, opcode, arg, nr)  # type: ignore[arg-type]

    monkeypatch.setattr(uring_mod, "io_uring_register", slow_register)
    async with DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool) as tier:
        try:
            assert tier.statistics().backend is DiskBackend.URING  # started while registering
            data = await _store(tier, pool, 1)
            await _read_ok(tier, pool, 1, data)
        finally:
            gate.set()  # never leave the registration blocked: closing waits for it
        io = tier._io
        assert isinstance(io, UringPageIO)
        await io.wait_registered()
        assert tier.statistics().backend is DiskBackend.URING_FIXED
        data = await _store(tier, pool, 2)  # now through fixed buffers
        await _read_ok(tier, pool, 2, data)
    assert_clean(pool)


@pytest.fixture
def tmpfs_dir() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = Path("/dev/shm") / f"aiokv-disk-test-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.asyncio
async def test_buffered_io_where_o_direct_is_refused(tmpfs_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                     pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # tmpfs refused O_DIRECT before Linux 6.6; newer kernels accept it, so the refusal is injected
    # where an old tmpfs gives it, EINVAL: at an open asking for it and at an F_SETFL adding it
    # (the start's probe opens an existing file without it, then sets it once the file is known
    # regular: 0058ff5; an open-only injection no longer reached it).
    real_open, real_fcntl = os.open, fcntl.fcntl

    def refuse_direct(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused (injected)")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def refuse_setfl(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused (injected)")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(backends_mod.os, "open", refuse_direct)
    monkeypatch.setattr(fcntl, "fcntl", refuse_setfl)
    async with DiskTier(config(tmpfs_dir, backend), layout, pool) as tier:
        stats = tier.statistics()
        assert not stats.direct_io
        assert stats.backend is backend
        data = await _store(tier, pool, 1)
        await _read_ok(tier, pool, 1, data)
    with pytest.raises(OSError, match="O_DIRECT"):
        await DiskTier(config(tmpfs_dir, backend, direct_io=True), layout, pool).start()
    monkeypatch.undo()
    async with DiskTier(config(tmpfs_dir, backend), layout, pool) as tier:  # the real tmpfs, either way
        await _read_ok(tier, pool, 1, data)
    assert_clean(pool)
