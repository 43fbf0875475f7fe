"""A TP load stream the engine drops without finish()/aclose() gives its pool pages back and
warns (ResourceWarning), as a dropped Match does: else each one pins its pages for good."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch
from tp_helpers import CONFIG, full_kv, rank_kv, threads_off_loop

from aiokv import CacheConfig, KVLayout
from aiokv.tp import RankWorkerThread, TPCache

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True])
async def test_a_dropped_stream_releases_its_pages_and_warns(layered: bool) -> None:
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="tp-adv-dropped",
                         pool_chunk_bytes=8 * LAYOUT.page_bytes)
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=96, tp_config=CONFIG) as cache:
        kv = [rank_kv(full_kv(LAYOUT, 1, 96), LAYOUT, r, 2) for r in range(2)]
        async with threads_off_loop(RankWorkerThread(cache.address, 0, 2, LAYOUT, kv[0], CONFIG),
                                    RankWorkerThread(cache.address, 1, 2, LAYOUT, kv[1], CONFIG)):
            async with asyncio.timeout(30):
                await cache.wait_ranks()
            tokens = list(range(32))
            assert (await cache.offload(tokens, torch.arange(32))).stored == 8
            stream = cache.start_load(await cache.match(tokens), torch.arange(40, 72), layered=layered)
            async with asyncio.timeout(30):
                await stream.launched()
            held = [stream]
            del stream
            with pytest.warns(ResourceWarning, match="LoadStream"):
                _drop(held)  # the engine's step raised before finish()
            async with asyncio.timeout(30):
                await asyncio.sleep(0)  # the finalizer hands the abandon to this loop
                await cache.flush()  # which waits for the abandon it tracks
            assert cache.stats().pool_referenced == 0


def _drop(held: list[object]) -> None:
    """Drop the last reference (collected at once, or by the collection after)."""
    held.clear()
    gc.collect()
