"""``match`` waits for pages another call is still writing into the pool, but for at most
``commit_wait`` in all: then it stops at them (a shorter hit, never wrong KV), counted as
``commit_wait_expired``. Before, a writer that never finished (a stopped TP rank: review 114's
``tests/tp/test_adv_rev114_match_stopped_writer.py``) held every lookup sharing its pages.

CPU only: the offload's copy is held on the copy thread (on CUDA the mover runs on the loop).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, mover_of, prompt
from held_call import Hold

from aiokv import KVCache, OffloadResult

T = LAYOUT.page_tokens
PAGES = 3
BOUND_S = 10.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")


async def _offload_held(
    cache: KVCache, monkeypatch: pytest.MonkeyPatch, tokens: list[int]
) -> tuple[Hold, asyncio.Task[OffloadResult]]:
    """An offload of ``tokens`` whose copy is held: its pages stay RESERVED until released."""
    hold = Hold()
    mover = mover_of(cache)
    monkeypatch.setattr(mover, "offload", hold.wrap(mover.offload))
    task = asyncio.create_task(cache.offload(tokens, torch.arange(len(tokens))))
    assert await asyncio.to_thread(hold.entered.wait, BOUND_S)
    assert cache.stats().pool_reserved == PAGES
    return hold, task


@pytest.mark.asyncio
async def test_a_match_stops_at_pages_still_written_after_commit_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompt(61, PAGES * T)
    kv = make_kv(62)
    async with KVCache(config(None, pool_pages=8, commit_wait=0.3), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        hold, offload = await _offload_held(cache, monkeypatch, tokens)
        try:
            started = time.perf_counter()
            async with asyncio.timeout(BOUND_S):
                match = await cache.match(tokens)
            waited = time.perf_counter() - started
            assert match.tokens == 0  # the first page is not committed: nothing served from it
            assert 0.25 <= waited < 5.0, waited
            assert cache.stats().errors["commit_wait_expired"] == 1
            match.release()
            # A second lookup waits its own bound, counted again.
            async with asyncio.timeout(BOUND_S):
                (await cache.match(tokens)).release()
            assert cache.stats().errors["commit_wait_expired"] == 2
        finally:
            hold.release()
        async with asyncio.timeout(BOUND_S):
            result = await offload
        assert result.stored == PAGES
        match = await cache.match(tokens)
        assert match.tokens == PAGES * T
        target = torch.arange(100, 100 + PAGES * T)
        loaded = await cache.load(match, target)
        assert loaded.tokens == PAGES * T
        assert torch.equal(kv[:, target], kv[:, : PAGES * T])
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_match_still_waits_for_a_commit_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompt(63, PAGES * T)
    kv = make_kv(64)
    async with KVCache(config(None, pool_pages=8, commit_wait=5.0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        hold, offload = await _offload_held(cache, monkeypatch, tokens)
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, hold.release)
        async with asyncio.timeout(BOUND_S):
            match = await cache.match(tokens)
        assert match.tokens == PAGES * T  # waited for the commit: the whole hit
        assert cache.stats().errors.get("commit_wait_expired", 0) == 0
        match.release()
        await offload
        await assert_quiescent(cache)
