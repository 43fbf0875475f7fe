"""Lifetime edges: cancelled flush, close timeout, restart after close, dropped matches, bad devices."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache

T = LAYOUT.page_tokens


@pytest.mark.asyncio
async def test_cancelled_flush_and_close_timeout_leave_background_jobs_consistent() -> None:
    # Regression: flush()/aclose() gathered the jobs' futures, so cancelling flush (or the close
    # timeout) cancelled them and the job's completion raised InvalidStateError in a callback.
    loop = asyncio.get_running_loop()
    cache = KVCache(config(None, close_timeout=0.05), LAYOUT, make_kv(50))
    await cache.start()
    job: asyncio.Future[None] = loop.create_future()
    finished: list[int] = []
    cache.manager.track(job, lambda: finished.append(1))  # a copy abandoned by a cancelled caller
    flush = asyncio.create_task(cache.flush())
    await asyncio.sleep(0)
    flush.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flush
    assert cache.stats().background_jobs == 1
    await cache.aclose()  # times out on the job (counted), does not hang
    assert cache.manager.faults["close_timeout"] == 1
    job.set_result(None)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert finished == [1]  # the job's completion ran; loop_hygiene fails on any callback error


@pytest.mark.asyncio
async def test_start_after_aclose_raises() -> None:
    cache = KVCache(config(None), LAYOUT, make_kv(51))
    await cache.start()
    await cache.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await cache.start()
    never_started = KVCache(config(None), LAYOUT, make_kv(51))
    await never_started.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await never_started.start()


@pytest.mark.asyncio
async def test_tokens_on_the_meta_device_are_a_value_error() -> None:
    async with KVCache(config(None), LAYOUT, make_kv(52)) as cache:
        meta = torch.zeros(2 * T, dtype=torch.long, device="meta")
        with pytest.raises(ValueError, match="meta"):
            await cache.match(meta)
        with pytest.raises(ValueError, match="meta"):
            await cache.offload(meta, torch.arange(2 * T))
        with pytest.raises(ValueError, match="meta"):
            await cache.prefetch(meta)
        assert cache.stats().pool_ready == 0


@pytest.mark.asyncio
async def test_a_dropped_match_gives_its_pages_back_with_a_resource_warning(tmp_path: Path) -> None:
    tokens = prompt(53, 3 * T)
    async with KVCache(config(None, pool_pages=4), LAYOUT, make_kv(53)) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(3 * T))
        match = await cache.match(tokens)
        assert cache.stats().pool_referenced == 3
        with pytest.warns(ResourceWarning, match="unreleased Match"):
            del match  # dropped without release() or load(): freed at once (refcount)
        gc.collect()
        await asyncio.sleep(0)  # the release runs on the loop that owns the page table
        assert cache.stats().pool_referenced == 0
        await assert_quiescent(cache)
