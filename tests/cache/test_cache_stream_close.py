"""A streaming load (``start_load``) in flight when the cache's close begins: it launches nothing
more, and what it did not copy is counted withdrawn, not as a fault (as ``load`` does: see
``test_cache_close_counts``)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, config, make_kv, prompt

from aiokv import KVCache
from aiokv.transfers import Copy

T = LAYOUT.page_tokens
cpu_only = pytest.mark.skipif(DEVICE.type != "cpu", reason="counts launches of CPU copies")


@cpu_only
@pytest.mark.asyncio
async def test_a_stream_in_flight_launches_nothing_once_the_close_began() -> None:
    # Regression: the stream's loader kept launching pool copies while the cache closed, and a
    # stream cut by the close was not told apart from a fault (copy_failed, load_shortened).
    kv = make_kv(74)
    n = 8
    tokens = prompt(74, n * T)
    cache = KVCache(config(None, pool_pages=16, launch_pages=1), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    await cache.offload(tokens, torch.arange(n * T))
    transfers = cache._transfers
    assert transfers is not None
    launched: list[bool] = []  # per launch: had the close begun?
    closing: list[asyncio.Future[None]] = []
    original = transfers.load

    def load(page_ids: list[int], slots: torch.Tensor, skip: int) -> Copy:
        launched.append(cache._manager._closed)
        if len(launched) == 3:
            closing.append(asyncio.ensure_future(cache.aclose()))
        return original(page_ids, slots, skip)

    transfers.load = load  # type: ignore[method-assign]
    target = torch.arange(100, 100 + n * T)
    stream = await cache.start_load(await cache.match(tokens), target)
    result = await stream.finish()
    await closing[0]
    assert not any(launched), "a copy was launched after the close began"
    done = len(launched)
    assert 3 <= done < n
    # Loaded from the back: the top `done` pages, contiguous up to the match's end.
    assert (result.loaded_from, result.tokens, result.pool_pages) == ((n - done) * T, n * T, done)
    assert torch.equal(kv[:, target[(n - done) * T :]], kv[:, (n - done) * T : n * T])
    stats = cache.stats()
    assert stats.pages_withdrawn == n - done, stats.pages_withdrawn
    assert not stats.errors, stats.errors
    cache.pool.table.check_invariants()
    assert stats.pool_referenced == 0 and stats.pool_reserved == 0
