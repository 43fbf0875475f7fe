"""`KVCache` start racing with aclose at the pool's edge: start raises and no pool outlives the cache.

(``start()`` after ``aclose()`` raising is pinned in tests/cache.)
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from aiokv import CacheConfig, KVCache, KVLayout

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)


def _cache() -> KVCache:
    kv = torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    config = CacheConfig(cpu_bytes=8 * LAYOUT.page_bytes, disk_dir=None, pool_chunk_bytes=2 * LAYOUT.page_bytes)
    return KVCache(config, LAYOUT, kv)


def _segments() -> set[str]:
    prefix = f"aiokv-{os.getpid()}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


@pytest.mark.asyncio
async def test_aclose_during_start_makes_start_raise_and_leaks_no_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _segments()
    loop = asyncio.get_running_loop()
    release = threading.Event()
    entered = asyncio.Event()
    real = os.posix_fallocate

    def slow_fallocate(fd: int, offset: int, length: int) -> None:
        loop.call_soon_threadsafe(entered.set)
        release.wait(60)
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", slow_fallocate)
    cache = _cache()
    starting = asyncio.ensure_future(cache.start())
    await entered.wait()  # start() waits for the pool's first chunk
    closing = asyncio.ensure_future(cache.aclose())
    loop.call_soon(release.set)  # after aclose() began
    await closing
    try:
        await starting
    except RuntimeError:
        raised = True
    else:
        raised = False
        await cache.pool.aclose()  # the pool that outlived its cache: free it, then fail
    assert raised, "start() went on after aclose()"
    assert _segments() == before
