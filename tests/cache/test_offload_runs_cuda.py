"""A single-process cache on CUDA offloads pages whose slots are one run each by run copies (one
copy-engine memcpy a page, ``PageMover(slot_runs=True)``), as a TP rank does: on the H200 the
gather (an index upload and a kernel launch a staging chunk) held the loop about twice as long a
launch group of 8-16 pages (docs/measurements.md, twenty-third session's device call). Pages
whose slots are spread still gather. Bit-exact both ways."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, SLOTS, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")

T = LAYOUT.page_tokens
PAGES = 8


@pytest.mark.asyncio
async def test_run_slotted_offloads_go_by_run_copies_and_spread_ones_gather() -> None:
    kv = make_kv(131)
    async with KVCache(config(None, pool_pages=4 * PAGES), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.wait_warm()
        transfers = cache._transfers
        assert transfers is not None
        mover = transfers.mover
        n = PAGES * T
        runs = prompt(131, n)
        stored = await cache.offload(runs, torch.arange(n))
        assert stored.stored == PAGES
        assert mover.runs_offloaded == PAGES
        spread_slots = torch.arange(n) * 2 + n  # every other slot: no page's slots are a run
        spread = prompt(132, n)
        stored = await cache.offload(spread, spread_slots)
        assert stored.stored == PAGES
        assert mover.runs_offloaded == PAGES  # the spread pages gathered
        for tokens, source in ((runs, torch.arange(n)), (spread, spread_slots)):
            target = torch.arange(SLOTS - n, SLOTS)
            loaded = await cache.load(await cache.match(tokens), target)
            assert loaded.tokens == n
            assert torch.equal(kv[:, target.to(kv.device)], kv[:, source.to(kv.device)])
        await assert_quiescent(cache)
