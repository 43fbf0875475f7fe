"""A pool that is small against an offload: wait for write-behind instead of dropping, and never
evict the prefix a call is using to store its suffix."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache
from aiokv.pagetable import PageHandle

T = LAYOUT.page_tokens


@pytest.mark.asyncio
async def test_offload_larger_than_the_pool_waits_for_write_behind_and_drops_nothing(tmp_path: Path) -> None:
    # Regression: a 3-page pool dropped 7 of a 10-page offload as pool_exhausted although the disk
    # had room: the pages it had just stored were held by the write-behind queue.
    kv = make_kv(60)
    original = kv.clone()
    tokens = prompt(60, 10 * T)
    async with KVCache(config(tmp_path, pool_pages=3, disk_pages=40), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        result = await cache.offload(tokens, torch.arange(10 * T))
        assert (result.stored, result.dropped) == (10, 0), result
        assert cache.stats().errors.get("pool_exhausted", 0) == 0
        await cache.flush()
        disk = cache.disk
        assert disk is not None
        assert all(disk.contains(key) for key in cache.keys(tokens))
        await assert_quiescent(cache)
    # Every page reached disk intact: a cache with a larger pool loads the whole prompt back.
    async with KVCache(config(tmp_path, pool_pages=16, disk_pages=40), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        match = await cache.match(tokens)
        assert match.disk_pages == 10
        loaded = await cache.load(match, torch.arange(100, 100 + 10 * T))
        assert loaded.tokens == 10 * T
        assert torch.equal(kv[:, 100 : 100 + 10 * T], original[:, : 10 * T])
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_without_a_disk_a_full_pool_still_drops_at_once() -> None:
    # Nothing will free a page (no write-behind holds any): waiting cannot help, so no wait.
    async with KVCache(config(None, pool_pages=3), LAYOUT, make_kv(61)) as cache:
        await cache.pool.wait_ready()
        match = await cache.match(prompt(62, 0))
        held = await cache.offload(prompt(63, 3 * T), torch.arange(3 * T))
        assert held.stored == 3
        pinned = await cache.match(prompt(63, 3 * T))  # references: nothing evictable
        result = await cache.offload(prompt(64, 2 * T), torch.arange(2 * T))
        assert (result.stored, result.dropped) == (0, 2)
        pinned.release()
        match.release()
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_an_offload_never_evicts_its_own_prefix_for_its_suffix() -> None:
    # Regression: with the prefix already in a full pool, offloading a longer prompt evicted the
    # prefix's own pages to store the suffix; right after, match found a shorter prefix.
    kv = make_kv(65)
    tokens = prompt(65, 5 * T)
    async with KVCache(config(None, pool_pages=3), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens[: 2 * T], torch.arange(2 * T))
        await cache.offload(prompt(66, T), torch.arange(50, 50 + T))  # the pool is full now
        result = await cache.offload(tokens, torch.arange(5 * T))
        assert result.skipped == 2
        async with await cache.match(tokens) as match:
            assert match.pool_pages >= 2, "the offload evicted the prefix it was extending"
            assert match.pool_pages == result.skipped + result.stored
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_pages_a_call_skipped_become_recently_used() -> None:
    kv = make_kv(67)
    hot = prompt(67, 2 * T)
    async with KVCache(config(None, pool_pages=4), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(hot, torch.arange(2 * T))
        await cache.offload(prompt(68, 2 * T), torch.arange(2 * T, 4 * T))  # `hot` is the oldest
        assert (await cache.offload(hot, torch.arange(2 * T))).skipped == 2  # used again: refreshed
        await cache.offload(prompt(69, 2 * T), torch.arange(4 * T, 6 * T))  # evicts the two coldest
        async with await cache.match(hot) as match:
            assert match.pool_pages == 2
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_stuck_disk_makes_offload_give_up_after_offload_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fault: the disk never completes a write, so the write-behind keeps its pool pages forever.
    # The offload waits offload_wait, drops the rest (counted) and returns: it never hangs.
    kv = make_kv(62)
    tokens = prompt(62, 10 * T)
    async with KVCache(config(tmp_path, pool_pages=3, disk_pages=40, offload_wait=0.05), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        real = disk._write_owned
        stuck = asyncio.Event()

        async def never_done(key: bytes, ref: PageHandle) -> bool:
            await stuck.wait()
            return await real(key, ref)

        monkeypatch.setattr(disk, "_write_owned", never_done)
        try:
            async with asyncio.timeout(30):
                result = await cache.offload(tokens, torch.arange(10 * T))
            assert (result.stored, result.dropped) == (3, 7), result
            assert cache.stats().errors["pool_exhausted"] >= 1
        finally:
            stuck.set()  # the disk recovers: the queued pages are written
        await assert_quiescent(cache)
