"""Fixtures of the disk-tier tests: a small layout, a pool closed after each test, a tier per backend."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from disk_helpers import BACKENDS, config, small_layout

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import UringPageIO


@pytest.fixture
def buffer() -> Iterator[tuple[mmap.mmap, int]]:
    """1 MiB of anonymous memory and its address, for raw ring ops."""
    m = mmap.mmap(-1, 1 << 20)
    probe = ctypes.c_char.from_buffer(m)
    address = ctypes.addressof(probe)
    del probe
    try:
        yield m, address
    finally:
        m.close()


@pytest.fixture
def layout() -> KVLayout:
    return small_layout()


@pytest.fixture
def pool(layout: KVLayout) -> Iterator[PagePool]:
    p = PagePool.create(layout, 64 * layout.page_bytes, register_cuda=False, workers=1)
    p.wait_ready_blocking()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(params=BACKENDS, ids=[b.value for b in BACKENDS])
def backend(request: pytest.FixtureRequest) -> DiskBackend:
    value = request.param
    assert isinstance(value, DiskBackend)
    return value


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    return tmp_path / "disk"


@pytest_asyncio.fixture
async def tier(disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> AsyncIterator[DiskTier]:
    t = DiskTier(config(disk_dir, backend), layout, pool)
    await t.start()
    try:
        yield t
    finally:
        await t.aclose()


URING = [DiskBackend.URING_FIXED, DiskBackend.URING]


@pytest_asyncio.fixture(params=URING, ids=[b.value for b in URING])
async def warm_tier(request: pytest.FixtureRequest, disk_dir: Path, layout: KVLayout,
                    pool: PagePool) -> AsyncIterator[DiskTier]:
    """A started io_uring tier whose reads of cached names open on the loop (the warm path)."""
    tier = DiskTier(config(disk_dir, request.param), layout, pool)
    await tier.start()
    io = tier.backend
    assert isinstance(io, UringPageIO) and io.direct and io.chain_reads and io._cached.available
    try:
        yield tier
    finally:
        await tier.aclose()
