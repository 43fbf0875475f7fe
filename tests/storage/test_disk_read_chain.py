"""A cold read of an io_uring tier is one linked chain from the open: OPENAT (``O_NOFOLLOW|
O_NONBLOCK|O_DIRECT`` into the slot's fixed-file entry), header and page, FIXED_FD_INSTALL, CLOSE;
then one ``fstat`` of the installed fd on the loop (no open or ``fcntl`` there, no second
submission). What it opens is as safe as the checked way: planted symlinks, FIFOs (read-opened or
with a writer), sockets and devices are prompt counted misses, never followed, never blocking; a
file of another owner is refused by the fstat of the file it opened (a rename race cannot swap
another file in); a fault (real files, errors injected into the ring by the backend's fault plan)
leaves the slot's fixed-file entry closed, so the next page's chain in that slot reads correctly.
Every read here is cold: the tier's open on the loop (``openat2`` RESOLVE_CACHED) is off."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import os
import stat
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
import torch
from disk_helpers import assert_clean, config, fill, is_root, key_of, payload, reserve

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind, uring
from aiokv.storage.backends import IOOp, UringPageIO

T = TypeVar("T")
URING = [DiskBackend.URING_FIXED, DiskBackend.URING]
OUTSIDE = b"bytes outside the cache\n" * 100


@pytest.fixture(params=URING, ids=[b.value for b in URING])
def uring_backend(request: pytest.FixtureRequest) -> DiskBackend:
    value = request.param
    assert isinstance(value, DiskBackend)
    return value


def _io(tier: DiskTier) -> UringPageIO:
    io = tier.backend
    assert isinstance(io, UringPageIO)
    assert io.direct, "the read chain needs O_DIRECT (this file system refused it)"
    return io


async def _store(tier: DiskTier, pool: PagePool, i: int) -> torch.Tensor:
    h = fill(pool, key_of(i), i)
    data = payload(pool, h)
    assert await tier.write(key_of(i), h)
    pool.table.release(h)
    return data


async def _load(tier: DiskTier, pool: PagePool, i: int, want: torch.Tensor | None = None) -> bool:
    into = reserve(pool, key_of(1000 + i))
    try:
        ok = await tier.read(key_of(i), into)
        if want is not None:
            assert ok
            assert torch.equal(payload(pool, into), want)
        return ok
    finally:
        pool.table.abort(into)


async def _unblocking(path: str, work: Awaitable[T]) -> T:
    """``work``, failing the test (instead of hanging it) when it blocks on the FIFO at ``path``."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=30)
    if not done:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a writer lets a blocked open go
        await asyncio.wait({task})
        os.close(fd)
        pytest.fail("the tier blocked on a FIFO")
    return task.result()


def _lexists(path: str) -> bool:
    return os.path.lexists(path)


class _Spy:
    """Counts the engine's submissions and the loop thread's fstat/fcntl calls."""

    def __init__(self, io: UringPageIO, monkeypatch: pytest.MonkeyPatch) -> None:
        self.submits: list[list[int]] = []
        self.checks = 0
        real_submit = io.engine.submit

        def submit(ops: list[Any], *args: Any, **kwargs: Any) -> None:
            self.submits.append([op[0] for op in ops])
            real_submit(ops, *args, **kwargs)

        monkeypatch.setattr(io.engine, "submit", submit)
        real_fstat = os.fstat

        def fstat(fd: int) -> os.stat_result:
            self.checks += 1
            return real_fstat(fd)

        monkeypatch.setattr(os, "fstat", fstat)


@pytest_asyncio.fixture
async def chain_tier(disk_dir: Path, uring_backend: DiskBackend, layout: KVLayout,
                     pool: PagePool) -> AsyncIterator[DiskTier]:
    # One I/O slot: every read uses the same fixed-file entry as the one before it.
    tier = DiskTier(config(disk_dir, uring_backend, queue_depth=1), layout, pool)
    await tier.start()
    io = _io(tier)
    assert io.chain_reads  # on by default
    io._cached.available = False  # every name cold: no open on the loop, the chain from the open
    try:
        yield tier
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_a_read_is_one_submission_with_one_check_on_the_loop(chain_tier: DiskTier, pool: PagePool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tier = chain_tier
    data = [await _store(tier, pool, i) for i in range(4)]
    spy = _Spy(_io(tier), monkeypatch)
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(4):
        await _load(tier, pool, i, data[i])
    assert spy.checks == 4  # the installed fd of each
    assert len(spy.submits) == 4, spy.submits
    for opcodes in spy.submits:
        assert opcodes[0] == uring.OP_OPENAT and opcodes[-2:] == [uring.OP_FIXED_FD_INSTALL, uring.OP_CLOSE]
    assert len(os.listdir("/proc/self/fd")) == fds  # every installed fd closed
    assert tier.statistics().hits == 4
    assert_clean(pool)


def _symlink(outside: Path) -> Callable[[str], None]:
    return lambda path: os.symlink(outside, path)


def _fifo(path: str) -> None:
    os.mkfifo(path, 0o600)


def _socket(path: str) -> None:
    os.mknod(path, 0o600 | stat.S_IFSOCK)


def _device(path: str) -> None:
    if not is_root():
        pytest.skip("creating a device node needs root")
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers: reads would succeed


@pytest.fixture
def writer_held_fifo() -> Iterator[Callable[[str], None]]:
    """Plants a FIFO and keeps it open for reading and writing (a non-blocking read of it would
    wait for data rather than see end-of-file), closed after the test."""
    fds: list[int] = []

    def plant(path: str) -> None:
        os.mkfifo(path, 0o600)
        fds.append(os.open(path, os.O_RDWR | os.O_NONBLOCK))

    yield plant
    for fd in fds:
        os.close(fd)


@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["symlink", "fifo", "fifo_with_writer", "socket", "device"])
async def test_planted_names_are_prompt_misses_and_the_slot_goes_on(chain_tier: DiskTier, pool: PagePool,
                                                                    tmp_path: Path, what: str,
                                                                    writer_held_fifo: Callable[[str], None]) -> None:
    tier = chain_tier
    _io(tier)
    outside = tmp_path / "outside.txt"
    outside.write_bytes(OUTSIDE)
    plant = {"symlink": _symlink(outside), "fifo": _fifo, "fifo_with_writer": writer_held_fifo,
             "socket": _socket, "device": _device}[what]
    await _store(tier, pool, 1)
    good = await _store(tier, pool, 2)
    path = tier.files.path(key_of(1))
    os.unlink(path)
    plant(path)
    into = reserve(pool, key_of(1001))
    before = payload(pool, into)
    assert not await _unblocking(path, tier.read(key_of(1), into))
    assert torch.equal(payload(pool, into), before)  # nothing was read into the page
    pool.table.abort(into)
    stats = tier.statistics()
    assert (stats.misses, stats.corrupt, stats.errors[ErrorKind.UNSAFE]) == (1, 0, 1)
    assert not tier.contains(key_of(1))
    await _unblocking(path, _load(tier, pool, 2, good))  # the same slot, the next chain: intact
    await _unblocking(path, tier.aclose())
    assert not _lexists(path)  # the planted name is removed, never followed
    assert outside.read_bytes() == OUTSIDE
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_valid_page_file_of_another_owner_is_refused_by_its_fstat(chain_tier: DiskTier,
                                                                          pool: PagePool) -> None:
    if not is_root():
        pytest.skip("giving a file away needs root")
    tier = chain_tier
    _io(tier)
    await _store(tier, pool, 1)
    good = await _store(tier, pool, 2)
    os.chown(tier.files.path(key_of(1)), 12345, 12345)  # its header and checksum are still right
    assert not await _load(tier, pool, 1)
    stats = tier.statistics()
    assert (stats.misses, stats.corrupt, stats.errors[ErrorKind.UNSAFE]) == (1, 0, 1)
    await _load(tier, pool, 2, good)
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("op", [IOOp.OPEN, IOOp.READ], ids=["open", "read"])
async def test_eio_in_the_chain_is_a_counted_miss_and_the_slot_is_closed(chain_tier: DiskTier, pool: PagePool,
                                                                         op: IOOp) -> None:
    tier = chain_tier
    io = _io(tier)
    good = [await _store(tier, pool, i) for i in range(3)]
    io.faults.inject(op, errno.EIO)
    assert not await _load(tier, pool, 0)
    stats = tier.statistics()
    assert (stats.misses, stats.corrupt, stats.errors[ErrorKind.EIO]) == (1, 0, 1)
    assert tier.contains(key_of(0))  # an I/O error is not corruption: the file stays
    for i in range(3):  # the slot's next chains (OPENAT into the same fixed-file entry) read right
        await _load(tier, pool, i, good[i])
    assert io.engine.in_flight == 0
    assert_clean(pool)


@pytest.mark.asyncio
async def test_eagain_reads_fall_back_to_the_checked_way(chain_tier: DiskTier, pool: PagePool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A file system without non-blocking direct reads answers the chain's READ with EAGAIN: that
    # read goes the checked way (open, fstat, then read), and every later read too. (The chain
    # broke before its install: nothing of it is checked.)
    tier = chain_tier
    io = _io(tier)
    good = [await _store(tier, pool, i) for i in range(2)]
    io.faults.inject(IOOp.READ, errno.EAGAIN)
    spy = _Spy(io, monkeypatch)
    await _load(tier, pool, 0, good[0])
    assert not io.chain_reads
    assert spy.checks == 1  # the checked way's
    await _load(tier, pool, 1, good[1])
    assert spy.checks == 2
    assert not any(uring.OP_FIXED_FD_INSTALL in ops for ops in spy.submits[2:])
    stats = tier.statistics()
    assert (stats.hits, stats.misses, sum(stats.errors.values())) == (2, 0, 0)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_truncated_file_is_refused(chain_tier: DiskTier, pool: PagePool) -> None:
    tier = chain_tier
    _io(tier)
    await _store(tier, pool, 1)
    good = await _store(tier, pool, 2)
    path = tier.files.path(key_of(1))
    os.truncate(path, os.stat(path).st_size - 4096)
    assert not await _load(tier, pool, 1)
    stats = tier.statistics()
    assert (stats.misses, stats.corrupt) == (1, 1)
    await _load(tier, pool, 2, good)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_warm_names_are_opened_on_the_loop_not_through_the_chain(disk_dir: Path, uring_backend: DiskBackend,
                                                                      layout: KVLayout, pool: PagePool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A name in the kernel's lookup caches opens on the loop without I/O: one submission (header,
    # page, CLOSE) and no install; only cold names take the chain.
    async with DiskTier(config(disk_dir, uring_backend, queue_depth=1), layout, pool) as tier:
        data = [await _store(tier, pool, i) for i in range(2)]
        spy = _Spy(_io(tier), monkeypatch)
        for i in range(2):
            await _load(tier, pool, i, data[i])
        assert spy.checks == 2
        assert not any(op in (uring.OP_FIXED_FD_INSTALL, uring.OP_OPENAT) for ops in spy.submits for op in ops)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_file_removed_behind_the_tiers_back_is_a_miss(chain_tier: DiskTier, pool: PagePool) -> None:
    tier = chain_tier
    await _store(tier, pool, 1)
    good = await _store(tier, pool, 2)
    os.unlink(tier.files.path(key_of(1)))  # ENOENT at the chain's OPENAT
    assert not await _load(tier, pool, 1)
    stats = tier.statistics()
    assert (stats.misses, stats.corrupt, sum(stats.errors.values())) == (1, 0, 0)
    assert not tier.contains(key_of(1))  # forgotten
    await _load(tier, pool, 2, good)
    assert _io(tier).engine.in_flight == 0
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_kernel_without_the_install_falls_back_to_the_checked_way(chain_tier: DiskTier, pool: PagePool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # An opcode this kernel does not know fails its SQE with EINVAL, as FIXED_FD_INSTALL does
    # before 6.8: the chain's reporting op fails after the OPENAT filled the slot's entry (the
    # kernel then posts the cancelled ops' CQEs). The page is read the checked way, every later
    # read too, and the slot's entry is closed for the next chain.
    tier = chain_tier
    io = _io(tier)
    good = [await _store(tier, pool, i) for i in range(3)]
    monkeypatch.setattr(uring, "OP_FIXED_FD_INSTALL", 250)
    fds = len(os.listdir("/proc/self/fd"))
    await _load(tier, pool, 0, good[0])
    assert not io.chain_reads
    monkeypatch.undo()
    for i in range(3):
        await _load(tier, pool, i, good[i])
    stats = tier.statistics()
    assert (stats.hits, stats.misses, sum(stats.errors.values())) == (4, 0, 0)
    assert io.engine.in_flight == 0
    assert len(os.listdir("/proc/self/fd")) == fds
    assert_clean(pool)


def _renameat2_exchange(dir_fd: int, a: str, b: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.renameat2(dir_fd, a.encode(), dir_fd, b.encode(), 2) != 0:  # RENAME_EXCHANGE
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_rename_race_never_passes_another_owners_file_off(tmp_path: Path, chain_tier: DiskTier,
                                                                   layout: KVLayout, pool: PagePool) -> None:
    # Review of the STATX chain: a thread swapping our page file with a forged one of another
    # owner (RENAME_EXCHANGE in a loop) made the check see one file while the read opened the
    # other: 7 of 220 reads served the forged page as a hit. The check is now the fstat of the
    # very file the chain opened and read.
    if not is_root():
        pytest.skip("giving a file away needs root")
    tier = chain_tier
    good = await _store(tier, pool, 1)
    # The forgery: a valid page file for the same key (right header and checksum), other bytes.
    pool.table.evict(pool.num_pages)  # key 1's page leaves the pool: the forgery fills it anew
    async with DiskTier(config(tmp_path / "other", DiskBackend.URING, queue_depth=1), layout, pool) as other:
        h = fill(pool, key_of(1), 77)
        forged_payload = payload(pool, h)
        assert await other.write(key_of(1), h)
        pool.table.release(h)
        forged_bytes = await asyncio.to_thread(Path(other.files.path(key_of(1))).read_bytes)
    assert not torch.equal(forged_payload, good)
    path = tier.files.path(key_of(1))
    directory, name = os.path.split(path)
    forged = os.path.join(directory, "forged")
    await asyncio.to_thread(Path(forged).write_bytes, forged_bytes)
    os.chown(forged, 12345, 12345)
    stop = threading.Event()
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)

    def swap() -> None:
        while not stop.is_set():
            try:
                _renameat2_exchange(dir_fd, name, "forged")
            except FileNotFoundError:
                return  # the tier refused the forged file and unlinked the name

    swapper = threading.Thread(target=swap)
    swapper.start()
    served = {"good": 0, "forged": 0, "miss": 0}
    try:
        for i in range(200):
            if not tier.contains(key_of(1)):
                break  # refused once (its owner): forgotten, as it should be
            into = reserve(pool, key_of(2000 + i))
            try:
                if await tier.read(key_of(1), into):
                    served["forged" if torch.equal(payload(pool, into), forged_payload) else "good"] += 1
                else:
                    served["miss"] += 1
            finally:
                pool.table.abort(into)
    finally:
        stop.set()
        swapper.join()
        os.close(dir_fd)
    assert served["forged"] == 0, served
    assert served["miss"] >= 1, served  # the race did hit the forged file at least once
    assert tier.statistics().errors[ErrorKind.UNSAFE] >= 1
    assert_clean(pool)
