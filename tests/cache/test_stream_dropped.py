"""A LoadStream dropped without finish()/aclose() gives its pool pages back and warns
(ResourceWarning), as a dropped Match does; its copies are waited for first (found by the
adversarial TP run: each dropped stream pinned its pages for good, silently)."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from aiokv import CacheConfig, KVCache, KVLayout

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True])
async def test_a_dropped_stream_releases_its_pages_and_warns(layered: bool) -> None:
    kv = torch.randn(LAYOUT.num_layers, 96, LAYOUT.rows, LAYOUT.head_dim).to(LAYOUT.dtype)
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="dropped-stream")
    async with KVCache(config, LAYOUT, kv) as cache:
        tokens = list(range(32))
        assert (await cache.offload(tokens, torch.arange(32))).stored == 8
        want = kv[:, :32].clone()
        stream = await cache.start_load(await cache.match(tokens), torch.arange(40, 72), layered=layered)
        async with asyncio.timeout(30):
            await stream.launched()
        assert cache.stats().pool_referenced > 0
        held = [stream]
        del stream
        with pytest.warns(ResourceWarning, match="LoadStream"):
            _drop(held)  # the engine's step raised before finish()
        async with asyncio.timeout(30):
            await asyncio.sleep(0)  # the finalizer hands the abandon to this loop
            await cache.flush()  # which waits for the abandon it tracks
        assert cache.stats().pool_referenced == 0
        # The pages are whole and served again.
        async with await cache.match(tokens) as match:
            assert match.tokens == 32
            await cache.load(match, torch.arange(0, 32) + 64)
        assert torch.equal(kv[:, 64:96], want)


def _drop(held: list[object]) -> None:
    """Drop the last reference (collected at once, or by the collection after)."""
    held.clear()
    gc.collect()
