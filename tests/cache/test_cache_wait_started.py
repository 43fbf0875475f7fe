"""``KVCache.wait_started()``: returns once the background start-up work is over — the pool's
chunks, the disk tier's io_uring registration of the pool, the kernel warm-up."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, config, make_kv

from aiokv import DiskBackend, KVCache
from aiokv.storage.backends import UringPageIO
from aiokv.storage.uring import Region, UringEngine


@pytest.mark.asyncio
async def test_wait_started_covers_the_disk_tiers_registration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The registration is held inside its first pinning call until the test lets it go: while it
    # is held, wait_started must still be waiting.
    real = UringEngine.update_buffers
    gate, entered = threading.Event(), threading.Event()
    pinned: list[float] = []

    def held(self: UringEngine, regions: Sequence[Region]) -> int:
        entered.set()
        assert gate.wait(30), "the test never released the registration"
        done = real(self, regions)
        pinned.append(time.monotonic())
        return done

    monkeypatch.setattr(UringEngine, "update_buffers", held)
    cache = KVCache(config(tmp_path / "disk", pool_pages=64, backend=DiskBackend.AUTO), LAYOUT, make_kv(0))
    with pytest.raises(RuntimeError, match="not started"):
        await cache.wait_started()
    async with cache:
        waiting = asyncio.ensure_future(cache.wait_started())
        try:
            if await asyncio.to_thread(entered.wait, 10):
                await asyncio.wait({waiting}, timeout=0.1)
                assert not waiting.done(), "wait_started returned while the pool was still being pinned"
        finally:
            gate.set()
        await asyncio.wait_for(waiting, 30)
        returned = time.monotonic()
        io = cache._manager.disk.backend if cache._manager.disk is not None else None
        if isinstance(io, UringPageIO) and io._registering is not None:
            assert pinned, "the background registration pinned nothing through update_buffers"
            assert pinned[-1] <= returned, "wait_started returned while the pool was still being pinned"
        assert cache.pool.ready
        disk = cache._manager.disk
        assert disk is not None
        io = disk.backend
        if isinstance(io, UringPageIO) and io._registering is not None:
            assert io._registering.done(), "wait_started returned before the pool's registration ended"
        else:
            pytest.skip(f"no background registration on this machine ({type(io).__name__})")
        await cache.wait_started()  # again: at once


@pytest.mark.asyncio
async def test_wait_started_without_a_disk_tier() -> None:
    async with KVCache(config(None), LAYOUT, make_kv(0)) as cache:
        await cache.wait_started()
        assert cache.pool.ready
        tokens = list(range(2 * LAYOUT.page_tokens))
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == 2
