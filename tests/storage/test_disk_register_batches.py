"""Registration pins several regions per io_uring update call (fewer GIL round trips); a region the
kernel refuses in the middle of a call leaves the table known (the regions before it registered and
used, it and the rest through plain buffers); callers' regions are pinned in small pieces, batched
the same way."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import resource
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config, key_of

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.shm import populate
from aiokv.storage import DiskBackend, DiskTier, memory, uring
from aiokv.storage.backends import BACKGROUND_REGION_BYTES, UringPageIO
from aiokv.storage.memory import REGIONS_PER_UPDATE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

REFUSED = 3
"""The pool region made read-only before registration: inside the first update batch."""

POOL_BYTES = (REGIONS_PER_UPDATE + 2) * BACKGROUND_REGION_BYTES


def _memlock_allows(size: int) -> bool:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= 2 * size


def _protect(address: int, length: int, prot: int) -> None:
    if _libc.mprotect(address, length, prot) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Updates:
    """The real BUFFERS_UPDATE syscalls: each call's (first slot, region count, result or errno)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int, int]] = []
        register = uring.io_uring_register

        def recording(fd: int, opcode: int, arg: ctypes.c_void_p | None, nr: int) -> int:
            if opcode != uring.IORING_REGISTER_BUFFERS_UPDATE or arg is None:
                return register(fd, opcode, arg, nr)
            update = ctypes.cast(arg, ctypes.POINTER(uring._RsrcUpdate2)).contents
            try:
                result = register(fd, opcode, arg, nr)
            except OSError as exc:
                self.calls.append((update.offset, update.nr, -(exc.errno or 0)))
                raise
            self.calls.append((update.offset, update.nr, result))
            return result

        monkeypatch.setattr(uring, "io_uring_register", recording)


async def _page_io(tier: DiskTier, io: UringPageIO, buffer: memoryview, at: int, pb: int, key: int) -> list[int]:
    """Write the page at ``at`` out and read it back into the page after; the opcodes used."""
    seen: list[int] = []
    submit = io.engine.submit

    def recording(ops: list[uring.SqeFields], keep: object, callback: Any, future: Any = None,
                  expect: Any = None) -> None:
        seen.extend(op[0] for op in ops)
        submit(ops, keep, callback, future, expect)

    io.engine.submit = recording  # type: ignore[method-assign]
    try:
        sent = os.urandom(pb)
        buffer[at : at + pb] = sent
        assert await tier.write_from(key_of(key), buffer[at : at + pb])
        assert await tier.read_into(key_of(key), buffer[at + pb : at + 2 * pb])
        assert bytes(buffer[at + pb : at + 2 * pb]) == sent
    finally:
        del io.engine.submit
    return seen


@pytest.mark.asyncio
async def test_a_region_refused_inside_a_batch_leaves_the_table_known(disk_dir: Path, layout: KVLayout,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if not _memlock_allows(POOL_BYTES):
        pytest.skip("memlock limit below the pool")
    pool = PagePool.create(layout, POOL_BYTES, register_cuda=False, workers=1)
    pool.wait_ready_blocking()
    base = pool.memory.segment.address
    pb = layout.page_bytes
    populate(base, pool.num_pages * pb)  # mapped: registered without populating (read-only can't be)
    # A real refusal: the kernel pins for writing, and one page of this region is read-only (EFAULT).
    refused = base + REFUSED * BACKGROUND_REGION_BYTES
    _protect(refused + mmap.PAGESIZE, mmap.PAGESIZE, mmap.PROT_READ)
    updates = Updates(monkeypatch)
    try:
        tier = DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool)
        await tier.start()
        io = tier.backend
        if not isinstance(io, UringPageIO):
            await tier.aclose()
            pytest.skip("io_uring refused here: nothing is registered")
        try:
            await io.wait_registered()
            _protect(refused + mmap.PAGESIZE, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE)
            pool_calls = [c for c in updates.calls if c[0] < len(io._plan[0])]
            if not pool_calls:
                pytest.skip("no sparse buffer table here (kernel before 5.19)")
            # One call for the first batch: the kernel pinned the regions before the refused one
            # and said how many; the next call starts at the refused one and gets its error.
            rest = min(REGIONS_PER_UPDATE, len(io._plan[0]) - REFUSED)
            assert pool_calls == [(0, REGIONS_PER_UPDATE, REFUSED), (REFUSED, rest, -errno.EFAULT)], updates.calls
            assert io.kind is DiskBackend.URING
            assert [(r.index, r.address) for r in io._pool_regions] == [
                (i, base + i * BACKGROUND_REGION_BYTES) for i in range(REFUSED)]
            assert io._page_region(refused) is None
            assert io._page_region(base + POOL_BYTES - pb) is None
            buffer = pool.memory.segment.buffer
            # Registered regions use fixed buffers, the refused one and those after it plain ones.
            first = await _page_io(tier, io, buffer, BACKGROUND_REGION_BYTES, pb, 0)
            assert uring.OP_WRITE_FIXED in first and uring.OP_READ_FIXED in first, first
            for key, at in enumerate([REFUSED * BACKGROUND_REGION_BYTES + 4 * pb, POOL_BYTES - 2 * pb], 1):
                seen = await _page_io(tier, io, buffer, at, pb, key)
                assert uring.OP_WRITEV in seen and uring.OP_READV in seen, seen
                assert uring.OP_WRITE_FIXED not in seen and uring.OP_READ_FIXED not in seen, seen
        finally:
            await tier.aclose()
        assert_clean(pool)
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_register_memory_pins_small_pieces_in_batches(disk_dir: Path, layout: KVLayout, pool: PagePool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    size = 40 << 20
    if not _memlock_allows(size + POOL_BYTES):
        pytest.skip("memlock limit below the region")
    region = mmap.mmap(-1, size)
    whole = memoryview(region)
    try:
        async with DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool) as tier:
            io = tier.backend
            if not isinstance(io, UringPageIO):
                pytest.skip("io_uring refused here: nothing is registered")
            await io.wait_registered()
            updates = Updates(monkeypatch)
            await tier.register_memory(whole)
            pieces = io._ext_regions
            if not pieces:
                pytest.skip("fixed buffers cannot be registered here")
            assert all(r.length <= 8 << 20 for r in pieces), pieces  # as the pool's regions
            assert len(updates.calls) == -(-len(pieces) // REGIONS_PER_UPDATE), updates.calls
            assert sum(n for _, n, _ in updates.calls) == len(pieces)
            # Every 4 KiB-aligned page of the region lies whole in one piece.
            address = memory.buffer_address(whole)
            for offset in range(0, size - layout.page_bytes + 1, 1 << 20):
                assert io._external_region(address + offset) is not None, offset
            whole[: layout.page_bytes] = os.urandom(layout.page_bytes)
            assert await tier.write_from(key_of(0), whole[: layout.page_bytes])
            assert await tier.read_into(key_of(0), whole[layout.page_bytes : 2 * layout.page_bytes])
            assert whole[: layout.page_bytes] == whole[layout.page_bytes : 2 * layout.page_bytes]
    finally:
        whole.release()
        region.close()
    assert_clean(pool)
