"""The pool's background registration pins small regions (another thread's munmap waits for the pin
of a whole region) and faults in only memory that is not mapped yet, without asking for a pool
prepared for CUDA (mapped by its chunk preparation; asking takes the mmap lock too)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import resource
import threading
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, key_of, uring_tier

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.shm import populate
from aiokv.storage import DiskBackend, DiskTier, backends, uring
from aiokv.storage.backends import ADOPT_BYTES, BACKGROUND_REGION_BYTES, UringPageIO
from aiokv.storage.memory import REGIONS_PER_UPDATE

POOL_BYTES = (REGIONS_PER_UPDATE + 1) * BACKGROUND_REGION_BYTES + (1 << 20)
"""Ten regions: a full update batch (handed to the loop at once), then a batch of two whole ones and
a tail."""


def _memlock_allows(size: int) -> bool:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= 2 * size


def _pool(layout: KVLayout, prepared: str) -> PagePool:
    # "cuda": chunks prepared for CUDA, each faulted in before cudaHostRegister (which fails here
    # without a device, after the faulting in: the memory is mapped, the chunks unusable).
    p = PagePool.create(layout, POOL_BYTES, register_cuda=prepared == "cuda", workers=1)
    p.wait_ready_blocking()
    if prepared == "mapped":  # faulted in by use (or by the caller)
        populate(p.memory.segment.address, p.num_pages * layout.page_bytes)
    return p


class Spy:
    """Records the real update syscalls (each call's regions, (address, length)) and populates in
    the pool's range, then makes them."""

    def __init__(self, pool: PagePool) -> None:
        self.start = pool.memory.segment.address
        self.end = self.start + pool.num_pages * pool.layout.page_bytes
        self.calls: list[list[tuple[int, int]]] = []
        self.populated: list[tuple[int, int]] = []
        self.asked: list[tuple[int, int]] = []

    @property
    def updates(self) -> list[tuple[int, int]]:
        return [region for call in self.calls for region in call]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        register = uring.io_uring_register
        real_populate = backends.populate

        def recording_register(fd: int, opcode: int, arg: ctypes.c_void_p | None, nr: int) -> int:
            if opcode == uring.IORING_REGISTER_BUFFERS_UPDATE and arg is not None:
                update = ctypes.cast(arg, ctypes.POINTER(uring._RsrcUpdate2)).contents
                iovs = (uring.IoVec * update.nr).from_address(update.data)
                call = [(int(iov.base or 0), int(iov.len)) for iov in iovs]
                if any(self.start <= a < self.end for a, _ in call):
                    self.calls.append(call)
            return register(fd, opcode, arg, nr)

        def recording_populate(address: int, length: int) -> None:
            if self.start <= address < self.end:
                self.populated.append((address, length))
            real_populate(address, length)

        faulted_in = backends._faulted_in

        def recording_faulted_in(pagemap: int, address: int, length: int) -> bool:
            if self.start <= address < self.end:
                self.asked.append((address, length))
            return faulted_in(pagemap, address, length)

        monkeypatch.setattr(backends, "_faulted_in", recording_faulted_in)
        monkeypatch.setattr(uring, "io_uring_register", recording_register)
        monkeypatch.setattr(backends, "populate", recording_populate)


async def _registered(disk_dir: Path, layout: KVLayout, pool: PagePool) -> tuple[DiskTier, UringPageIO]:
    tier, io = await uring_tier(disk_dir, layout, pool)
    if io.kind is not DiskBackend.URING_FIXED:
        await tier.aclose()
        pytest.skip("fixed buffers cannot be registered here")
    return tier, io


@pytest.mark.asyncio
@pytest.mark.parametrize("prepared", ["cuda", "mapped", "untouched"])
async def test_background_registration_pins_small_regions(disk_dir: Path, layout: KVLayout,
                                                          monkeypatch: pytest.MonkeyPatch, prepared: str) -> None:
    if not _memlock_allows(POOL_BYTES):
        pytest.skip("memlock limit below the pool")
    pool = _pool(layout, prepared)
    spy = Spy(pool)
    spy.install(monkeypatch)
    try:
        await _check_registration(disk_dir, layout, pool, spy, prepared)
    finally:
        pool.close()


async def _check_registration(disk_dir: Path, layout: KVLayout, pool: PagePool, spy: Spy, prepared: str) -> None:
    # Wake-ups of the loop from the registering thread (each takes the GIL from the engine's).
    loop = asyncio.get_running_loop()
    wakeups: list[str] = []
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counting(callback: Any, *args: Any, context: Any = None) -> asyncio.Handle:
        if threading.current_thread().name.startswith("aiokv-pool"):
            wakeups.append(repr(callback))
        return call_soon_threadsafe(callback, *args, context=context)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        tier, io = await _registered(disk_dir, layout, pool)
    finally:
        del loop.call_soon_threadsafe
    try:
        # The header slots, the pool's regions ADOPT_BYTES at a time, the job's end.
        assert len(wakeups) <= 2 + -(-POOL_BYTES // ADOPT_BYTES), wakeups
        # Every region is small, and together they cover the pool in order, REGIONS_PER_UPDATE to
        # an update syscall (one GIL round trip each).
        assert len(spy.updates) >= 4
        assert all(length <= BACKGROUND_REGION_BYTES for _, length in spy.updates), spy.updates
        assert len(spy.calls) == -(-len(spy.updates) // REGIONS_PER_UPDATE), spy.calls
        assert all(len(call) <= REGIONS_PER_UPDATE for call in spy.calls), spy.calls
        assert spy.updates[0][0] == spy.start
        for (a, n), (b, _) in zip(spy.updates, spy.updates[1:], strict=False):
            assert a + n == b
        assert spy.updates[-1][0] + spy.updates[-1][1] == spy.end
        assert [(r.address, r.length) for r in io._pool_regions] == spy.updates  # all handed over
        # A pool prepared for CUDA is pinned as it is, without asking; mapped memory is pinned once
        # the page map says so; untouched memory is faulted in first, region by region.
        assert spy.asked == ([] if prepared == "cuda" else spy.updates)
        assert spy.populated == (spy.updates if prepared == "untouched" else [])
        # Fixed-buffer I/O in the last region: a page written from it reads back into it.
        pb = layout.page_bytes
        memory = pool.memory.segment.buffer
        last, before = (pool.num_pages - 1) * pb, (pool.num_pages - 2) * pb
        region = io._page_region(spy.start + last)
        assert region is not None and region.address == spy.updates[-1][0]
        seen: list[tuple[int, int]] = []
        submit = io.engine.submit

        def recording(ops: list[uring.SqeFields], keep: object, callback: Any, future: Any = None,
                      expect: Any = None) -> None:
            seen.extend((op[0], op[9]) for op in ops)
            submit(ops, keep, callback, future, expect)

        io.engine.submit = recording  # type: ignore[method-assign]
        sent = os.urandom(pb)
        memory[last : last + pb] = sent
        assert await tier.write_from(key_of(0), memory[last : last + pb])
        assert await tier.read_into(key_of(0), memory[before : before + pb])
        assert bytes(memory[before : before + pb]) == sent
        assert (uring.OP_WRITE_FIXED, region.index) in seen
        assert (uring.OP_READ_FIXED, region.index) in seen
    finally:
        await tier.aclose()
    if prepared != "cuda":
        assert_clean(pool)
