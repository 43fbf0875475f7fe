"""Tensor parallelism in the one-process `KVCache`: a rank never serves another rank's bytes.

Each rank's pool page holds only that rank's rows, so its keys must name the head slice too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cache_helpers import config, prompt

from aiokv import KVCache, KVLayout
from aiokv.layout import TPSlice

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
SLOTS = 64


def _full_kv(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, generator=gen).to(LAYOUT.dtype)


def _rank_kv(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's rows of the full-head buffer: its K heads, then the same V heads."""
    tp = TPSlice.of(LAYOUT, rank, size)
    heads = LAYOUT.num_kv_heads
    k = full[:, :, tp.head_start : tp.head_start + tp.local_heads]
    v = full[:, :, heads + tp.head_start : heads + tp.head_start + tp.local_heads]
    return torch.cat([k, v], dim=2).contiguous()


@pytest.mark.asyncio
async def test_two_ranks_on_one_directory_never_serve_each_others_heads(tmp_path: Path) -> None:
    # Regression: both ranks got identical keys; rank 1 loaded rank 0's page (zeros in its rows).
    full = _full_kv(1)
    tokens = prompt(1, 16 * T)[: 16 * T]
    n = 16 * T
    rank0 = _rank_kv(full, 0, 2)
    async with KVCache(config(tmp_path, layout=LAYOUT, tp_rank=0, tp_size=2), LAYOUT, rank0) as cache:
        assert (await cache.offload(tokens, torch.arange(n))).stored == 16
        await cache.flush()
    rank1 = torch.zeros_like(rank0)
    async with KVCache(config(tmp_path, layout=LAYOUT, tp_rank=1, tp_size=2), LAYOUT, rank1) as cache:
        match = await cache.match(tokens)
        assert match.tokens == 0, "rank 1 matched pages that hold only rank 0's heads"
        loaded = await cache.load(match, torch.arange(0))
        assert loaded.tokens == 0
        assert not rank1.any()
    # Each rank stores and serves its own heads from the shared directory, bit-exact.
    rank1_full = _rank_kv(full, 1, 2)
    async with KVCache(config(tmp_path, layout=LAYOUT, tp_rank=1, tp_size=2), LAYOUT, rank1_full) as cache:
        assert (await cache.offload(tokens, torch.arange(n))).stored == 16
        await cache.flush()
    for rank, want in ((0, rank0), (1, rank1_full)):
        target = torch.zeros_like(want)
        async with KVCache(config(tmp_path, layout=LAYOUT, tp_rank=rank, tp_size=2), LAYOUT, target) as cache:
            match = await cache.match(tokens)
            assert (match.pool_pages, match.disk_pages) == (0, 16)
            loaded = await cache.load(match, torch.arange(n))
            assert loaded.tokens == n
            assert torch.equal(target[:, :n], want[:, :n]), f"rank {rank} loaded bytes that are not its heads"


@pytest.mark.asyncio
async def test_replicated_heads_share_pages_between_replicas(tmp_path: Path) -> None:
    # tp_size 8 over 4 KV heads: ranks 2k and 2k+1 hold the same head; the writer's page serves both.
    full = _full_kv(2)
    tokens = prompt(2, 4 * T)[: 4 * T]
    n = 4 * T
    writer = _rank_kv(full, 2, 8)
    async with KVCache(config(tmp_path, layout=LAYOUT, tp_rank=2, tp_size=8), LAYOUT, writer) as cache:
        assert (await cache.offload(tokens, torch.arange(n))).stored == 4
        await cache.flush()
    replica = torch.zeros_like(writer)
    async with KVCache(config(tmp_path, layout=LAYOUT, tp_rank=3, tp_size=8), LAYOUT, replica) as cache:
        loaded = await cache.load(await cache.match(tokens), torch.arange(n))
        assert loaded.tokens == n
        assert torch.equal(replica[:, :n], writer[:, :n])
    other = torch.zeros_like(writer)
    async with KVCache(config(tmp_path, layout=LAYOUT, tp_rank=4, tp_size=8), LAYOUT, other) as cache:
        assert (await cache.match(tokens)).tokens == 0  # another head: never the writer's page
