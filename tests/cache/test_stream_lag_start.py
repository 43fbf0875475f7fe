"""A long load or stream gives the loop a turn between checking its slots and starting (issue #10).

Taking a 16K-token match's 64 pages, checking its 16K slots and starting the load ran in one loop
step (the engine's step that awaited the match and called ``start_load``): the longest loop
callback of a streaming hit. A cancel at that turn consumes the match and changes nothing else.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt

import aiokv.slots as slots_module
from aiokv import KVCache
from aiokv.loadpath import TURN_PAGES
from aiokv.results import Tier

T = LAYOUT.page_tokens
PAGES = TURN_PAGES + 4


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["start_load", "load"])
@pytest.mark.parametrize(("pages", "turns"), [(TURN_PAGES, 0), (TURN_PAGES + 1, 1), (PAGES, 1)])
async def test_only_a_long_call_gives_the_loop_a_turn_after_its_slot_check(
    monkeypatch: pytest.MonkeyPatch, call: str, pages: int, turns: int
) -> None:
    kv = make_kv(96)
    original = kv.clone()
    tokens = prompt(96, PAGES * T)
    async with KVCache(config(None, pool_pages=PAGES + 4), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(PAGES * T))
        match = await cache.match(tokens[: pages * T])
        assert match.pool_pages == pages
        ran: list[int] = []
        at_check: list[int] = []
        real = slots_module.check_values

        def check_values(*args: Any, **kwargs: Any) -> None:
            at_check.append(len(ran))
            real(*args, **kwargs)

        monkeypatch.setattr(slots_module, "check_values", check_values)
        target = torch.arange(PAGES * T, PAGES * T + pages * T)
        asyncio.get_running_loop().call_soon(ran.append, 1)
        if call == "start_load":
            stream = await cache.start_load(match, target)
            assert at_check == [0] and len(ran) == turns  # the turn comes after the check
            result = await stream.finish()
            assert result.loaded_from == 0
        else:
            assert at_check == []
            loaded = await cache.load(match, target)
            assert at_check == [0] and loaded.tokens == pages * T
        assert torch.equal(kv[:, target], original[:, : pages * T])
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_start_cancelled_at_its_turn_consumes_the_match_and_loads_nothing() -> None:
    kv = make_kv(97)
    tokens = prompt(97, PAGES * T)
    async with KVCache(config(None, pool_pages=PAGES + 4), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(PAGES * T))
        match = await cache.match(tokens)
        target = torch.arange(PAGES * T, 2 * PAGES * T)
        before = kv[:, target].clone()
        task = asyncio.ensure_future(cache.start_load(match, target))
        await asyncio.sleep(0)  # the call checked the slots and gave the loop its turn
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert match.released  # consumed, as by a cancelled load: its references went back
        stats = cache.stats()
        assert stats.pool_referenced == 0 and stats.loaded_tokens[Tier.POOL] == 0
        assert torch.equal(kv[:, target], before)  # nothing was launched
        await assert_quiescent(cache)
