"""A cold read's chain (OPENAT into the I/O slot's entry, header and page, FIXED_FD_INSTALL,
CLOSE) whose install finds no free descriptor: the process at its RLIMIT_NOFILE for a moment
(for real: the limit lowered to the descriptors open, the rest taken by /dev/null). That read
is a counted miss that keeps the file; cold reads go on as chains afterwards.

Found by helper-142 (review of bff17ed's chain accounting): the install's EMFILE was taken for
"io_uring cannot install opened files here" and turned chain reads off for the tier's life, so
every later cold read paid an OPENAT round trip and a look on the loop, and the log said the
kernel could not install files."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from disk_helpers import assert_clean, config, key_of, payload, reserve, stored_page

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, uring
from aiokv.storage.backends import UringPageIO
from aiokv.storage.uring import OP_CLOSE, Op

URING = [DiskBackend.URING_FIXED, DiskBackend.URING]
DEPTH = 4


@pytest_asyncio.fixture(params=URING, ids=[b.value for b in URING])
async def cold_tier(request: pytest.FixtureRequest, disk_dir: Path, layout: KVLayout,
                    pool: PagePool) -> AsyncIterator[DiskTier]:
    tier = DiskTier(config(disk_dir, request.param, queue_depth=DEPTH), layout, pool)
    await tier.start()
    try:
        await tier.wait_registered()  # URING_FIXED: header and page as two transfers
        io = tier.backend
        assert isinstance(io, UringPageIO) and io.direct and io.chain_reads
        io._cached.available = False  # every read is the chain from its open
        yield tier
    finally:
        await tier.aclose()


@contextlib.contextmanager
def no_free_descriptor() -> Iterator[None]:
    """The process at its descriptor limit while in the block: the soft limit lowered to the
    descriptors open now, and the ones still free below it taken."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
        while True:
            try:
                held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            except OSError as exc:
                if exc.errno != errno.EMFILE:
                    raise
                break
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _entries(io: UringPageIO) -> list[int]:
    """CLOSE of each I/O slot's fixed-file entry: EBADF where it is empty, 0 where a file was left."""
    out = []
    for slot in range(DEPTH):
        async with asyncio.timeout(5):
            out += await io.engine.chain([Op(OP_CLOSE, 0, file_index=slot + 1)], None)
    return out


def opcodes(io: UringPageIO) -> list[int]:
    """The opcodes the tier's ring is handed from now on, in order."""
    seen: list[int] = []
    submit = io.engine.submit

    def recording(ops: list[uring.SqeFields], *args: object, **kwargs: object) -> None:
        seen.extend(op[0] for op in ops)
        submit(ops, *args, **kwargs)  # type: ignore[arg-type]

    io.engine.submit = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.asyncio
async def test_an_install_without_a_free_descriptor_leaves_chain_reads_on(
        cold_tier: DiskTier, pool: PagePool) -> None:
    io = cold_tier.backend
    assert isinstance(io, UringPageIO)
    expect = await stored_page(cold_tier, pool, 1)
    before = cold_tier.statistics()
    seen = opcodes(io)
    into = reserve(pool, key_of(1))
    with no_free_descriptor():
        async with asyncio.timeout(10):
            assert not await cold_tier.read(key_of(1), into)  # the install's EMFILE (then the open's)
    pool.table.abort(into)
    assert uring.OP_FIXED_FD_INSTALL in seen
    after = cold_tier.statistics()
    assert after.misses == before.misses + 1 and after.corrupt == before.corrupt
    assert sum(after.errors.values()) == sum(before.errors.values()) + 1
    assert io.chain_reads  # before the fix: False, for good
    assert cold_tier.contains(key_of(1))  # a fault of the read, not of the file
    # The install failed after a transfer that posted its CQE (registered buffers): the chain
    # waited for its CLOSE's -ECANCELED and closed the entry (bff17ed's accounting; before it,
    # the CLOSE read as a success and the entry was left holding the file).
    assert await _entries(io) == [-errno.EBADF] * DEPTH
    seen.clear()
    into = reserve(pool, key_of(1))
    async with asyncio.timeout(10):
        assert await cold_tier.read(key_of(1), into)
    assert torch.equal(payload(pool, into), expect)
    pool.table.abort(into)
    assert seen[0] == uring.OP_OPENAT and uring.OP_FIXED_FD_INSTALL in seen  # the chain from its open
    assert io.engine.in_flight == 0 and cold_tier.statistics().in_flight == 0
    assert await _entries(io) == [-errno.EBADF] * DEPTH
    assert_clean(pool)
