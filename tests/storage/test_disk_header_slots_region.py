"""Header slots are one fixed-buffer region whatever the queue depth.

The background registration cut every span at the pool's region size (8 MiB): with a queue depth
above 2048 (4 KiB a slot) the header slots became two regions, only the last was remembered, and
fixed-buffer ops on the first region's slots failed with EFAULT (counted, the page dropped or
missed) — real writes and reads below, through the real ring.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, payload, reserve, small_layout

from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, uring
from aiokv.storage.backends import UringPageIO
from aiokv.storage.pagefile import HEADER_BYTES

QUEUE_DEPTH = 2100
"""Slots past 8 MiB of headers (2048 of 4 KiB)."""
PAGES = 120


async def _tier(directory: Path, pool: PagePool) -> tuple[DiskTier, UringPageIO]:
    tier = DiskTier(config(directory, DiskBackend.AUTO, queue_depth=QUEUE_DEPTH), pool.layout, pool)
    await tier.start()
    io = tier.backend
    if not isinstance(io, UringPageIO):
        await tier.aclose()
        pytest.skip("io_uring refused here: nothing is registered")
    await tier.wait_registered()
    if io.kind is not DiskBackend.URING_FIXED:
        await tier.aclose()
        pytest.skip("fixed buffers cannot be registered here")
    return tier, io


def _one_slot_region(io: UringPageIO) -> None:
    """One region holds every slot, registered and known to the backend."""
    assert [r.length for r in io._plan[1]] == [QUEUE_DEPTH * HEADER_BYTES]
    assert QUEUE_DEPTH * HEADER_BYTES > 8 << 20
    assert io._slot_region == io._plan[1][0]


def _spy(io: UringPageIO) -> list[tuple[int, int]]:
    """Records each transfer's header slot and first op."""
    used: list[tuple[int, int]] = []
    transfer = io._transfer

    def spy(write: bool, fd: int, fixed_file: bool, slot: int, page: int) -> list[tuple[int, ...]]:
        ops = transfer(write, fd, fixed_file, slot, page)
        used.append((slot, ops[0][0]))
        return ops

    io._transfer = spy  # type: ignore[method-assign,assignment]
    return used


class _HoldAll:
    """Holds a backend's ``start_*`` calls until ``count`` are waiting, then starts them all: every
    I/O holds its header slot at once (slots are handed out from the top, so 120 of them reach
    below the 8 MiB mark), instead of early ones finishing and handing their slots on."""

    def __init__(self, io: UringPageIO, name: str, count: int) -> None:
        self.real = getattr(io, name)
        self.count = count
        self.waiting: list[tuple[object, ...]] = []
        self.all_in = asyncio.Event()
        setattr(io, name, self)

    def __call__(self, *args: object) -> None:
        self.waiting.append(args)
        if len(self.waiting) == self.count:
            self.all_in.set()

    async def release(self) -> None:
        await asyncio.wait_for(self.all_in.wait(), 30)
        for args in self.waiting:
            self.real(*args)


def _no_errors(tier: DiskTier) -> None:
    errors = {k: v for k, v in tier.statistics().errors.items() if v}
    assert not errors, errors


@pytest.mark.asyncio
async def test_every_header_slot_is_in_the_registered_region(tmp_path: Path) -> None:
    layout = small_layout()
    directory = tmp_path / "disk"
    written: dict[int, torch.Tensor] = {}
    pool = PagePool.create(layout, 2 * PAGES * layout.page_bytes, register_cuda=False, workers=1)
    pool.wait_ready_blocking()
    try:
        tier, io = await _tier(directory, pool)
        try:
            used = _spy(io)
            # All at once: the writes take header slots on both sides of the 8 MiB mark.
            handles = [fill(pool, key_of(i), i) for i in range(PAGES)]
            written = {i: payload(pool, h) for i, h in enumerate(handles)}
            hold = _HoldAll(io, "start_publish", PAGES)
            writes = asyncio.gather(*(tier.write(key_of(i), h) for i, h in enumerate(handles)))
            await hold.release()
            stored = await writes
            for h in handles:
                pool.table.release(h)
            assert all(stored), tier.statistics().errors
            assert min(slot for slot, _ in used) < 2048 <= max(slot for slot, _ in used)
            assert all(op == uring.OP_WRITE_FIXED for _, op in used)
            _no_errors(tier)
            _one_slot_region(io)
        finally:
            await tier.aclose()
        assert_clean(pool)
    finally:
        pool.close()

    # A restart reads every page back through the whole slot range, bit for bit.
    pool = PagePool.create(layout, 2 * PAGES * layout.page_bytes, register_cuda=False, workers=1)
    pool.wait_ready_blocking()
    try:
        tier, io = await _tier(directory, pool)
        try:
            used = _spy(io)
            handles = [reserve(pool, key_of(i)) for i in range(PAGES)]
            hold = _HoldAll(io, "start_load", PAGES)
            reads = asyncio.gather(*(tier.read(key_of(i), h) for i, h in enumerate(handles)))
            await hold.release()
            read = await reads
            assert all(read), tier.statistics().errors
            assert min(slot for slot, _ in used) < 2048 <= max(slot for slot, _ in used)
            for i, h in enumerate(handles):
                assert torch.equal(payload(pool, h), written[i]), i
                pool.table.abort(h)
            _no_errors(tier)
        finally:
            await tier.aclose()
        assert_clean(pool)
    finally:
        pool.close()
