"""`register_memory` of a large region stops between pieces when its caller is cancelled or the
tier closes: neither waits for the whole region to be pinned."""

from __future__ import annotations

import asyncio
import mmap
import threading
from pathlib import Path

import pytest
from disk_helpers import config

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, backends, memory
from aiokv.storage.backends import UringPageIO

REGION_BYTES = 4 << 20
"""The caller's region: ~70 pieces of 64 KiB here (under an 8 MiB memlock limit)."""


class SlowPieces:
    """``populate`` of the caller's region held at its first piece until ``go``; counts pieces."""

    def __init__(self, start: int, loop: asyncio.AbstractEventLoop) -> None:
        self.start, self.loop = start, loop
        self.entered = asyncio.Event()
        self.go = threading.Event()
        self.pieces = 0

    def __call__(self, address: int, length: int) -> None:
        if not self.start <= address < self.start + REGION_BYTES:
            return
        self.pieces += 1
        if self.pieces == 1:
            self.loop.call_soon_threadsafe(self.entered.set)
            assert self.go.wait(30)


async def _until_stopped(io: UringPageIO) -> None:
    for _ in range(1000):  # loop iterations, not time: the stop flag is set on the loop
        if io._ext_jobs and all(stop.is_set() for stop in io._ext_jobs.values()):
            return
        await asyncio.sleep(0)
    raise AssertionError("registration never asked to stop")


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["cancel", "aclose"])
async def test_register_memory_stops_between_pieces(disk_dir: Path, layout: KVLayout, pool: PagePool,
                                                    monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setattr(memory, "REGISTER_REGION_BYTES", 64 << 10)
    region = mmap.mmap(-1, REGION_BYTES)
    whole = memoryview(region)
    tier = DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool)
    await tier.start()
    io = tier.backend
    if not isinstance(io, UringPageIO):
        await tier.aclose()
        whole.release()
        region.close()
        pytest.skip("io_uring refused here: no registration to stop")
    await io.wait_registered()
    slow = SlowPieces(memory.buffer_address(whole), asyncio.get_running_loop())
    monkeypatch.setattr(backends, "populate", slow)
    task = asyncio.create_task(tier.register_memory(whole))
    async with asyncio.timeout(30):
        await slow.entered.wait()
    closing = None
    if how == "cancel":
        task.cancel()
    else:
        closing = asyncio.create_task(tier.aclose())
    await _until_stopped(io)
    slow.go.set()
    async with asyncio.timeout(30):
        results = await asyncio.gather(task, return_exceptions=True)
        if closing is not None:
            await closing
    assert slow.pieces == 1  # the piece in progress, none after it
    if how == "cancel":
        assert isinstance(results[0], asyncio.CancelledError)
        await tier.aclose()
    else:
        assert results[0] is None
        assert tier.statistics().memory_unregistered == 1  # the rest goes through plain buffers
    whole.release()
    region.close()
