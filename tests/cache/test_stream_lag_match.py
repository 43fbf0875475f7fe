"""A long match gives the loop a turn between hashing the prompt and taking its pages (issue #10).

Hashing a 16K-token prompt and taking its 64 pages' references ran in one loop step, in the
engine's step that also settled the last stream and started the next load: the longest loop
callbacks while streaming. A cancel at that turn must change nothing.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache
from aiokv.loadpath import TURN_PAGES
from aiokv.results import Tier

T = LAYOUT.page_tokens
PAGES = TURN_PAGES + 4


async def _cached(cache: KVCache, seed: int) -> list[int]:
    tokens = prompt(seed, PAGES * T)
    await cache.pool.wait_ready()
    await cache.offload(tokens, torch.arange(PAGES * T))
    return tokens


@pytest.mark.asyncio
@pytest.mark.parametrize(("pages", "turns"), [(TURN_PAGES, 0), (TURN_PAGES + 1, 1), (PAGES, 1)])
async def test_only_a_long_match_gives_the_loop_a_turn(pages: int, turns: int) -> None:
    async with KVCache(config(None, pool_pages=PAGES + 4), LAYOUT, make_kv(94)) as cache:
        tokens = await _cached(cache, 94)
        ran: list[int] = []
        asyncio.get_running_loop().call_soon(ran.append, 1)
        async with await cache.match(tokens[: pages * T]) as match:
            assert match.pool_pages == pages
            assert len(ran) == turns  # the callback queued before the call ran during it
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_match_cancelled_at_its_turn_takes_and_counts_nothing() -> None:
    async with KVCache(config(None, pool_pages=PAGES + 4), LAYOUT, make_kv(95)) as cache:
        tokens = await _cached(cache, 95)
        before = cache.stats()
        task = asyncio.ensure_future(cache.match(tokens))
        await asyncio.sleep(0)  # the match hashed the prompt and gave the loop its turn
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = cache.stats()
        assert (after.lookups, after.hit_tokens[Tier.POOL]) == (before.lookups, before.hit_tokens[Tier.POOL])
        assert after.pool_referenced == 0
        async with await cache.match(tokens) as again:  # and the next match finds every page
            assert again.pool_pages == PAGES
        await assert_quiescent(cache)
