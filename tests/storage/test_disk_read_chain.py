"""A read of an io_uring tier is one linked chain from the open: OPENAT (``O_NOFOLLOW|O_NONBLOCK|
O_DIRECT`` into the slot's fixed-file entry), STATX, header and page, CLOSE. No open, ``fstat`` or
``fcntl`` on the loop, no second submission. What it opens is as safe as the checked way: planted
symlinks, FIFOs (read-opened or with a writer), sockets and devices are prompt counted misses,
never followed, never blocking; a file of another owner is refused by its STATX; a fault (real
files, errors injected into the ring by the backend's fault plan) leaves the slot's fixed-file
entry closed, so the next page's chain in that slot reads correctly."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
import torch
from disk_helpers import assert_clean, config, fill, is_root, key_of, payload, reserve

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
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
    _io(tier).chain_reads = True  # off by default (its STATX checks the name, not the opened file)
    try:
        yield tier
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_a_read_is_one_submission_without_checks_on_the_loop(chain_tier: DiskTier, pool: PagePool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv.storage import uring

    tier = chain_tier
    data = [await _store(tier, pool, i) for i in range(4)]
    spy = _Spy(_io(tier), monkeypatch)
    for i in range(4):
        await _load(tier, pool, i, data[i])
    assert spy.checks == 0
    assert len(spy.submits) == 4, spy.submits
    for opcodes in spy.submits:
        assert opcodes[:2] == [uring.OP_OPENAT, uring.OP_STATX] and opcodes[-1] == uring.OP_CLOSE
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
async def test_a_valid_page_file_of_another_owner_is_refused_by_its_statx(chain_tier: DiskTier,
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
    # read goes the checked way (open, fstat, then read), and every later read too.
    tier = chain_tier
    io = _io(tier)
    good = [await _store(tier, pool, i) for i in range(2)]
    io.faults.inject(IOOp.READ, errno.EAGAIN)
    spy = _Spy(io, monkeypatch)
    await _load(tier, pool, 0, good[0])
    assert not io.chain_reads
    assert spy.checks == 1
    await _load(tier, pool, 1, good[1])
    assert spy.checks == 2
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
async def test_reads_check_the_opened_file_by_default(disk_dir: Path, uring_backend: DiskBackend,
                                                      layout: KVLayout, pool: PagePool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The chain's STATX looks at the name: a rename race could make it approve another file than
    # the one it opened. By default a read checks the descriptor it opened (fstat), never a name.
    async with DiskTier(config(disk_dir, uring_backend, queue_depth=1), layout, pool) as tier:
        assert not _io(tier).chain_reads
        data = [await _store(tier, pool, i) for i in range(2)]
        spy = _Spy(_io(tier), monkeypatch)
        for i in range(2):
            await _load(tier, pool, i, data[i])
        assert spy.checks >= 2
        from aiokv.storage import uring

        assert not any(op == uring.OP_STATX for ops in spy.submits for op in ops)
    assert_clean(pool)
