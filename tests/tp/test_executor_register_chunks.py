"""A rank registers its mapping of the pool in at most ``MAX_CHUNKS`` chunks, as the pool itself is
prepared: a tiny ``TPConfig.register_chunk_bytes`` made one task per page (review of 3529333)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tp_helpers import full_kv, new_pool, rank_kv

from aiokv.cuda import CompletionBridge
from aiokv.layout import KVBuffer, KVLayout, TPSlice
from aiokv.pool import MAX_CHUNKS, PagePool
from aiokv.tp import RankExecutor, TPConfig

LAYOUT = KVLayout.mha(1, 2, 8, torch.float16, page_tokens=4)


@pytest.mark.asyncio
async def test_registration_chunks_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("aiokv.tp.executor.MAX_CHUNKS", 16)  # (the real cap needs 4,097+ pages to show)
    assert MAX_CHUNKS == 4096
    pages = 100
    pool = await new_pool(LAYOUT.for_tp(2), pages)
    bridge = CompletionBridge()
    kv = KVBuffer.wrap(LAYOUT, rank_kv(full_kv(LAYOUT, 0, slots=16), LAYOUT, 0, 2), TPSlice.of(LAYOUT, 0, 2))
    config = TPConfig(register_chunk_bytes=pool.layout.page_bytes)
    executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 0, bridge, config)
    try:
        assert executor._pages_per_chunk == 7  # ceil(100 / 16), not one page per chunk
    finally:
        await executor.aclose()
        await asyncio.to_thread(bridge.close)
        await pool.aclose()
