"""Set-up shared by the read-group tests (tests/core/test_batch_load.py, tests/cache/test_adv_rev111_*):
a small MHA layout whose read groups hold 32 pages, random KV and prompts, and prompts put on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from aiokv import CacheConfig, DiskBackend, KVCache, KVLayout
from aiokv.loadpath import read_group_pages
from aiokv.pagetable import PageHandle, ReserveOutcome
from aiokv.storage import DiskConfig

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
GROUP = read_group_pages(LAYOUT.page_bytes)
"""Pages in one read group of LAYOUT's pages (the default read_group_bytes)."""


def group_config(root: Path, pages: int, pool_pages: int, backend: DiskBackend = DiskBackend.AUTO, *,
                 chunk_pages: int = 4, disk: dict[str, Any] | None = None, **cache: Any) -> CacheConfig:
    """A cache of ``pool_pages`` pool pages over a disk tier at ``root`` with room for ``4 * pages``
    page files; ``disk``: more DiskConfig settings, ``cache``: more CacheConfig settings."""
    tier = DiskConfig(directory=root, capacity_bytes=4 * pages * (LAYOUT.page_bytes + 4096), backend=backend,
                      **(disk or {}))
    return CacheConfig(cpu_bytes=pool_pages * LAYOUT.page_bytes, disk=tier, namespace="test-model",
                       pool_chunk_bytes=chunk_pages * LAYOUT.page_bytes, **cache)


def random_kv(seed: int, slots: int) -> torch.Tensor:
    """A KV buffer of ``slots`` slots of LAYOUT, random by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.num_layers, slots, LAYOUT.rows, LAYOUT.head_dim, generator=gen).to(LAYOUT.dtype)


def random_tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def put_on_disk(config: CacheConfig, tokens: list[int], kv: torch.Tensor) -> None:
    """Every page of ``tokens`` (slots ``[0, len(tokens))`` of ``kv``) on disk; the pool that held
    them closes."""
    async with KVCache(config, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(len(tokens)))
        await cache.flush()


def take_free_pages(cache: KVCache, most: int, tag: int, fill: int) -> list[PageHandle]:
    """Reserve up to ``most`` pages the pool will give (free, or evictable) and fill each with the
    byte ``fill``: a copy still running after a cancel into a page freed too early would show."""
    pool = cache.pool
    taken: list[PageHandle] = []
    for i in range(most):
        (res,) = pool.reserve([bytes([0xEE, tag]) + i.to_bytes(14, "little")])
        if res.outcome is not ReserveOutcome.RESERVED or res.handle is None:
            break
        pool.memory.page_view(pool.table.check(res.handle))[:] = bytes([fill]) * LAYOUT.page_bytes
        taken.append(res.handle)
    return taken


def pages_unchanged(cache: KVCache, taken: list[PageHandle], fill: int) -> None:
    """Each page :func:`take_free_pages` filled still holds ``fill`` only; then given back."""
    pool = cache.pool
    for handle in taken:
        assert bytes(pool.memory.page_view(pool.table.check(handle))) == bytes([fill]) * LAYOUT.page_bytes
        pool.table.abort(handle)
