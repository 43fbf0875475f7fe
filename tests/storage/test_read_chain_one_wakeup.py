"""A cold read's chain installs the opened file after the transfer (OPENAT, header and page,
FIXED_FD_INSTALL, CLOSE): its two CQEs (the install reports the fd, the CLOSE ends the chain) post
together, so the loop wakes once per page (twice where header and page are two transfers: the
first one posts its CQE, see ``uring.LOUD_TRANSFERS``); installed right after the open, the
install's CQE woke the loop once more while the page was still being read (#14). A chain that breaks before its
install looked at nothing: a short read goes the checked way (open, fstat, read), so a short file
that is not ours is refused as such (UNSAFE), never counted as a truncated page of ours."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from disk_helpers import assert_clean, config, fill, is_root, key_of, payload, reserve

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage.backends import UringPageIO

URING = [DiskBackend.URING_FIXED, DiskBackend.URING]


@pytest_asyncio.fixture(params=URING, ids=[b.value for b in URING])
async def cold_tier(request: pytest.FixtureRequest, disk_dir: Path, layout: KVLayout,
                    pool: PagePool) -> AsyncIterator[DiskTier]:
    tier = DiskTier(config(disk_dir, request.param, queue_depth=1), layout, pool)
    await tier.start()
    io = tier.backend
    assert isinstance(io, UringPageIO) and io.direct, "the read chain needs O_DIRECT"
    io._cached.available = False  # every name cold: each read is the chain from the open
    try:
        yield tier
    finally:
        await tier.aclose()


async def _store(tier: DiskTier, pool: PagePool, i: int) -> torch.Tensor:
    h = fill(pool, key_of(i), i)
    data = payload(pool, h)
    assert await tier.write(key_of(i), h)
    pool.table.release(h)
    return data


async def _load(tier: DiskTier, pool: PagePool, i: int) -> torch.Tensor | None:
    into = reserve(pool, key_of(1000 + i))
    try:
        return payload(pool, into).clone() if await tier.read(key_of(i), into) else None
    finally:
        pool.table.abort(into)


@pytest.mark.asyncio
async def test_a_cold_read_wakes_the_loop_once(cold_tier: DiskTier, pool: PagePool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tier = cold_tier
    io = tier.backend
    assert isinstance(io, UringPageIO)
    reads = 8
    data = [await _store(tier, pool, i) for i in range(reads)]
    wakeups = 0
    real = io.engine._on_eventfd

    def counting() -> None:
        nonlocal wakeups
        wakeups += 1
        real()

    # The loop's reader holds the bound method: watch the eventfd again with the counting one.
    loop = io.engine._loop
    loop.remove_reader(io.engine._efd)
    loop.add_reader(io.engine._efd, counting)
    try:
        for i in range(reads):  # one at a time: nothing else completes meanwhile
            got = await _load(tier, pool, i)
            assert got is not None and torch.equal(got, data[i])
    finally:
        loop.remove_reader(io.engine._efd)
        loop.add_reader(io.engine._efd, real)
    # Installed first: one wake-up more per read (the open in io-wq, then the page). Header and
    # page in two transfers (registered buffers): the first one's completion wakes the loop's
    # thread anyway (its task work starts the second) and posts its CQE (uring.LOUD_TRANSFERS).
    transfers = 2 if tier.config.backend is DiskBackend.URING_FIXED else 1
    assert wakeups <= transfers * reads + reads // 4, (wakeups, transfers)
    assert tier.statistics().hits == reads
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_short_file_of_another_owner_is_refused_not_deleted(cold_tier: DiskTier, pool: PagePool) -> None:
    if not is_root():
        pytest.skip("giving a file away needs root")
    tier = cold_tier
    await _store(tier, pool, 1)
    good = await _store(tier, pool, 2)
    path = tier.files.path(key_of(1))
    os.truncate(path, os.stat(path).st_size - 4096)  # the chain's page read comes back short
    os.chown(path, 12345, 12345)
    assert await _load(tier, pool, 1) is None
    stats = tier.statistics()
    assert (stats.misses, stats.corrupt, stats.errors[ErrorKind.UNSAFE]) == (1, 0, 1)
    assert not tier.contains(key_of(1))
    got = await _load(tier, pool, 2)  # the slot's entry was closed for the next chain
    assert got is not None and torch.equal(got, good)
    assert_clean(pool)
