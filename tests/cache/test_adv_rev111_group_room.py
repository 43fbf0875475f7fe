"""A read group's pages that found no room wait for it together, not one after another.

Right after start the pool may still be preparing chunks; a disk promotion that finds no room
waits (``offload_wait`` at most) for the next chunk. Single promotions waited concurrently, so a
load found its prefix's end after one ``offload_wait``. A read group handed its pages without room
to :meth:`LoadPath._promote` one after another after its batch: each waited ``offload_wait`` in
turn, and the load, which copies a group only once it ended, took that many times longer (31 pages
of a group: 31 x 5 s with the default). Review 111; real page files, the pool's later chunks held
in their preparation (``SharedSegment.prepare_chunk``) until the test ends.

Since helper-148 a load's disk pages pass through the pool in windows: the first chunk's pages are
the first window, given back once copied, and the rest follow through them. The load is whole and
waits for no chunk at all (it stopped after the first chunk's pages, after one ``offload_wait``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE
from group_helpers import GROUP, LAYOUT, T, group_config, random_kv

from aiokv import CacheConfig, KVCache
from aiokv.shm import ChunkResult, SharedSegment

PAGES = GROUP + 7
N = PAGES * T
CHUNK_PAGES = 8
WAIT_S = 0.4
BOUND_S = 30.0


def _config(root: Path, pool_pages: int) -> CacheConfig:
    return group_config(root, PAGES, pool_pages, chunk_pages=CHUNK_PAGES, offload_wait=WAIT_S)


def _kv(seed: int) -> torch.Tensor:
    return random_kv(seed, 2 * N)


@pytest.mark.timing
@pytest.mark.asyncio
async def test_pages_without_room_in_a_group_wait_for_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _kv(51)
    tokens = torch.randint(0, 50_000, (N,), generator=torch.Generator().manual_seed(51)).tolist()
    async with KVCache(_config(tmp_path, 2 * PAGES), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(tokens, torch.arange(N))
        await writer.flush()
    release = threading.Event()
    real = SharedSegment.prepare_chunk

    def held(self: SharedSegment, index: int, offset: int, length: int, register_cuda: bool) -> ChunkResult:
        if index > 0:
            release.wait(BOUND_S)
        return real(self, index, offset, length, register_cuda)

    monkeypatch.setattr(SharedSegment, "prepare_chunk", held)
    kv = _kv(52).to(DEVICE)
    cache = KVCache(_config(tmp_path, 6 * CHUNK_PAGES), LAYOUT, kv)
    try:
        await cache.start()
        # On CUDA a copy waits for the kernel warm-up: seconds when Triton's cache is cold (the H200
        # run's first test in its process took 8.3 s), which is not what this test times.
        await cache.wait_warm()
        assert not cache.pool.ready  # only the first chunk is usable
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, PAGES)
        began = time.perf_counter()
        async with asyncio.timeout(BOUND_S):
            result = await cache.load(match, torch.arange(N, 2 * N))
        took = time.perf_counter() - began
        assert result.tokens == N, result  # through the first chunk's pages, window by window
        assert torch.equal(kv[:, N : 2 * N].cpu(), source[:, :N])
        assert cache.stats().errors.get("pool_exhausted", 0) == 0, cache.stats().errors
        # No offload_wait (windows wait for their own copies); it took one per page without room in
        # the group, then one in all.
        assert took < 3 * WAIT_S, f"the load took {took:.1f} s for an offload_wait of {WAIT_S} s"
    finally:
        release.set()
        async with asyncio.timeout(BOUND_S):
            await cache.aclose()
