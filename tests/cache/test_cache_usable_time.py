"""#11: a cache is usable within 1 s of its start at any pool size, with the disk tier on — even
while the disk tier's io_uring registration of the pool has not finished (or never does)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from aiokv import CacheConfig, DiskBackend, KVCache, KVLayout
from aiokv.storage import DiskConfig
from aiokv.storage.uring import Region, UringEngine

USABLE_BOUND_S = 1.0
"""The issue's bound. 2-vCPU VM at load ~2: 70-95 ms for 1-8 GiB pools of 32 MiB pages and for
262,144-1,048,576 pages of 4 KiB (`tools/bench_cache_start.py`)."""

# 262,144 pages of 4 KiB in 1 GiB: per-page start-up work (page table, free lists) shows here. The
# pool's memory is never touched beyond the pages this test uses.
SMALL_PAGES = KVLayout.mha(1, 1, 16, torch.bfloat16, page_tokens=64)


# A wall-clock bound: under 16 test processes on the H200 host it took 1.09 s (it passed alone).
@pytest.mark.timing
@pytest.mark.asyncio
async def test_a_large_pool_serves_its_first_round_trip_within_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The registration (where io_uring is usable) is held until the round trip is over: the start
    # must not wait for it, and the first copies must not either.
    gate, entered = threading.Event(), threading.Event()
    real = UringEngine.update_buffers

    def held(self: UringEngine, regions: Sequence[Region]) -> int:
        entered.set()
        gate.wait(60)
        return real(self, regions)

    monkeypatch.setattr(UringEngine, "update_buffers", held)
    assert SMALL_PAGES.page_bytes == 4096
    tokens = 4 * SMALL_PAGES.page_tokens
    kv = torch.arange(SMALL_PAGES.num_layers * tokens * SMALL_PAGES.rows * SMALL_PAGES.head_dim,
                      dtype=torch.float32).to(SMALL_PAGES.dtype).reshape(SMALL_PAGES.num_layers, tokens,
                                                                        SMALL_PAGES.rows, SMALL_PAGES.head_dim)
    disk = DiskConfig(directory=tmp_path / "disk", capacity_bytes=64 << 20, backend=DiskBackend.AUTO)
    config = CacheConfig(cpu_bytes=1 << 30, namespace="usable", disk=disk)
    prompt = list(range(1000, 1000 + tokens))
    slots = torch.arange(tokens)
    began = time.perf_counter()
    try:
        async with KVCache(config, SMALL_PAGES, kv) as cache:
            assert cache.pool.num_pages == (1 << 30) // 4096
            stored = await cache.offload(prompt, slots)
            assert stored.stored == 4
            expected = kv.clone()
            kv.zero_()
            match = await cache.match(prompt)
            assert match.tokens == tokens
            async with match:
                loaded = await cache.load(match, slots)
            assert loaded.tokens == tokens
            usable = time.perf_counter() - began
            assert torch.equal(kv, expected)
            gate.set()
    finally:
        gate.set()
    assert usable < USABLE_BOUND_S, f"first round trip {usable * 1e3:.0f} ms after the start"
