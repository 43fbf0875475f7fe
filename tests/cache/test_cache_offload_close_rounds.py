"""An offload whose close lands between two rounds counts only what still needed a copy.

Regression: when the pool was full and the close began while ``offload`` waited for room, every key
not yet reserved was counted dropped and withdrawn, pages already in the pool (which the next
round would have skipped) included. Now those count as skipped.

The pool is real and full of referenced pages; the wait for room is held on an ``asyncio.Event``
(without a disk tier nothing in flight could free a page, so the real wait would give up at once)
and lets the next round start once the close began.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from cache_helpers import LAYOUT, config, make_kv, prompt

from aiokv import KVCache, OffloadResult, TransferPath
from aiokv.pagetable import PageState

T = LAYOUT.page_tokens


@pytest.mark.asyncio
async def test_a_close_between_rounds_counts_pages_in_the_pool_as_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = KVCache(config(None, pool_pages=8, transfer_path=TransferPath.REFERENCE), LAYOUT, make_kv())
    await cache.start()
    manager, table = cache._manager, cache.pool.table
    await cache.pool.wait_ready()
    s, t_, u = prompt(1, 3 * T), prompt(2, 5 * T), prompt(3, 2 * T)
    keys = manager.keys(s)
    assert (await cache.offload(s, torch.arange(len(s)))).stored == 3
    last = table.acquire(keys[2])  # the third page of s stays (referenced, as a load would)
    assert last is not None
    assert (await cache.offload(t_, torch.arange(len(t_)))).stored == 5
    held_t = await cache.match(t_)
    assert (await cache.offload(u, torch.arange(len(u)))).stored == 2  # evicts s's first two pages
    held_u = await cache.match(u)
    assert [table.state_of(k) for k in keys] == [PageState.FREE, PageState.FREE, PageState.READY]
    assert cache.stats().pool_referenced == 8  # full: nothing evictable

    entered, gate = asyncio.Event(), asyncio.Event()

    async def wait_for_room(*, disk_io: bool = True) -> bool:
        entered.set()
        await gate.wait()
        return True  # room came: the next round starts

    monkeypatch.setattr(manager, "_wait_for_room", wait_for_room)
    before = (manager._stored, manager._skipped, manager._dropped, manager._withdrawn)
    assert before[2:] == (0, 0)
    offload = asyncio.ensure_future(cache.offload(s, torch.arange(len(s))))
    closing: asyncio.Future[None] | None = None
    try:
        await asyncio.wait_for(entered.wait(), 10)
        closing = asyncio.ensure_future(cache.aclose())
        for _ in range(1000):
            if manager._closed:
                break
            await asyncio.sleep(0)
        assert manager._closed
    finally:
        gate.set()
    result = await offload
    # Two pages needed a copy (withdrawn by the close); the third is in the pool: skipped.
    assert result == OffloadResult(0, 1, 2)
    assert manager._dropped == 2 and manager._withdrawn == 2
    assert manager._skipped == before[1] + 1
    held_t.release()
    held_u.release()
    table.release(last)
    assert closing is not None
    await closing
    assert not cache.stats().errors
