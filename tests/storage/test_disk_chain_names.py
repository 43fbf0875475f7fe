"""The io_uring backend's page chains name their files from the I/O slot's own name buffers (#14):
no ctypes buffer is allocated per page for a new file's temporary and final names, a recycled
file's old and new names, or a read's open through the ring; a name too long for a slot's buffer
gets a buffer of its own (kept until the chain completed)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, read_page, write_page

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import PATH_BYTES, UringPageIO
from aiokv.storage.pagefile import file_bytes

URING = [DiskBackend.URING_FIXED, DiskBackend.URING]


def _io(tier: DiskTier) -> UringPageIO:
    io = tier.backend
    assert isinstance(io, UringPageIO)
    return io


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
async def test_page_chains_allocate_no_name_buffers(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                    pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    files = 4
    async with DiskTier(config(disk_dir, backend, capacity=files * file_bytes(layout)), layout, pool) as tier:
        io = _io(tier)
        # Every read opens through the ring (as after a cache drop), not on the loop.
        monkeypatch.setattr(io._cached, "open", lambda *_: None)
        allocated: list[bytes] = []
        real = ctypes.create_string_buffer

        def counting(init: bytes | int, size: int | None = None) -> ctypes.Array[ctypes.c_char]:
            allocated.append(init if isinstance(init, bytes) else b"")
            return real(init, size)

        monkeypatch.setattr(ctypes, "create_string_buffer", counting)
        written = [await write_page(tier, pool, i) for i in range(files)]  # new files
        assert all(ok for ok, _ in written)
        recycled = [await write_page(tier, pool, files + i) for i in range(files)]  # a full tier recycles
        assert all(ok for ok, _ in recycled)
        for i in range(files):
            got = await read_page(tier, pool, files + i)
            assert got is not None and bool((got == recycled[i][1]).all())
        stats = tier.statistics()
        assert stats.recycled == files and stats.hits == files
        assert allocated == []
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
async def test_names_share_a_slot_and_long_names_get_their_own_buffer(disk_dir: Path, backend: DiskBackend,
                                                                     layout: KVLayout, pool: PagePool) -> None:
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        io = _io(tier)
        first, second, keep = io._names(3, b"old-name", b"new-name")
        assert keep is None
        assert ctypes.string_at(first) == b"old-name" and ctypes.string_at(second) == b"new-name"
        other, _, _ = io._names(4, b"another", None)  # another slot leaves slot 3's names alone
        assert ctypes.string_at(other) == b"another" and ctypes.string_at(first) == b"old-name"
        long = b"x" * PATH_BYTES
        first, second, keep = io._names(3, long, b"short")
        assert keep is not None
        assert ctypes.string_at(first) == long and ctypes.string_at(second) == b"short"
        first, second, keep = io._names(3, b"short", long)
        assert keep is not None
        assert ctypes.string_at(first) == b"short" and ctypes.string_at(second) == long
    assert_clean(pool)
