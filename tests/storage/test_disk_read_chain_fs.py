"""Real faults under the cold-read chain (OPENAT, header and page, FIXED_FD_INSTALL, CLOSE) on a
real ext4: an EIO (the file system shut down: ``EXT4_IOC_SHUTDOWN``, no device mapper needed) and a
short read (a file truncated behind the tier's back) are counted misses, never wrong bytes, and the
slot's fixed-file entry is left empty for the next chain."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, payload, reserve
from fs_helpers import loop_ext4, shut_down_ext4

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage.backends import UringPageIO

URING = [DiskBackend.URING_FIXED, DiskBackend.URING]




def _cold(tier: DiskTier) -> UringPageIO:
    io = tier.backend
    assert isinstance(io, UringPageIO) and io.direct and io.chain_reads
    io._cached.available = False  # every read the chain from its open
    return io


async def _load(tier: DiskTier, pool: PagePool, i: int) -> tuple[bool, torch.Tensor]:
    into = reserve(pool, key_of(1000 + i))
    try:
        return await tier.read(key_of(i), into), payload(pool, into)
    finally:
        pool.table.abort(into)


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
async def test_a_real_eio_is_a_counted_miss(tmp_path: Path, backend: DiskBackend, layout: KVLayout,
                                            pool: PagePool) -> None:
    with loop_ext4(tmp_path, 32) as mount:
        async with DiskTier(config(mount / "d", backend, queue_depth=2, min_free_bytes=0), layout, pool) as tier:
            io = _cold(tier)
            for i in range(3):
                h = fill(pool, key_of(i), i)
                assert await tier.write(key_of(i), h)
                pool.table.release(h)
            shut_down_ext4(mount)
            for i in range(3):
                ok, _ = await _load(tier, pool, i)
                assert not ok
            stats = tier.statistics()
            assert (stats.hits, stats.misses, stats.corrupt) == (0, 3, 0)
            assert stats.errors[ErrorKind.EIO] == 3
            assert tier.contains(key_of(0))  # an I/O error is not corruption: the page stays indexed
            assert io.engine.in_flight == 0
        assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
@pytest.mark.parametrize("cut", [4096, 1], ids=["payload", "header"])
async def test_a_short_read_is_refused_and_the_next_chain_reads_right(tmp_path: Path, backend: DiskBackend,
                                                                      layout: KVLayout, pool: PagePool,
                                                                      cut: int) -> None:
    # Truncated in the payload (the page's READ comes back short) or inside the header (the
    # header's READ does): the chain breaks there, its CLOSE is cancelled and sent on its own.
    with loop_ext4(tmp_path, 32) as mount:
        async with DiskTier(config(mount / "d", backend, queue_depth=1, min_free_bytes=0), layout, pool) as tier:
            io = _cold(tier)
            want = []
            for i in range(2):
                h = fill(pool, key_of(i), i)
                want.append(payload(pool, h))
                assert await tier.write(key_of(i), h)
                pool.table.release(h)
            path = tier.files.path(key_of(0))
            size = os.stat(path).st_size
            os.truncate(path, size - cut if cut > 1 else 100)
            ok, _ = await _load(tier, pool, 0)
            assert not ok
            stats = tier.statistics()
            assert (stats.misses, stats.corrupt) == (1, 1)
            assert not tier.contains(key_of(0))
            ok, got = await _load(tier, pool, 1)  # the same slot's entry, the next chain
            assert ok and torch.equal(got, want[1])
            assert io.chain_reads
        assert_clean(pool)
