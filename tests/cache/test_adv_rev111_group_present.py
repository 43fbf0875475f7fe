"""A page already in the pool inside a load's read group is held from the group's start.

A load's disk range can hold pages that are in the pool (another call read them meanwhile: a
prefetch, a stream's promotion). A read group reserves its pages and reads them in one batch;
such a page was only looked at then and acquired after the batch: meanwhile the pool's pressure
(other requests' pages reserved) could evict it, and the load stopped there with a
``pool_exhausted`` fault although the page had been in the pool all along (per-page promotions
took their reference at once). Review 111; real page files, the group's batch held on an event
after its real read.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import assert_quiescent
from group_helpers import GROUP, LAYOUT, T, group_config, random_kv

from aiokv import CacheConfig, KVCache
from aiokv.pagetable import PageHandle, ReserveOutcome

PAGES = GROUP + 7
N = PAGES * T
POOL_PAGES = PAGES + 12
IN_POOL = 5  # this page of the prompt is in the pool, inside the first read group
BOUND_S = 30.0


def _config(root: Path) -> CacheConfig:
    return group_config(root, PAGES, POOL_PAGES)


def _kv(seed: int) -> torch.Tensor:
    return random_kv(seed, 2 * N)


@pytest.mark.asyncio
async def test_a_pool_page_inside_a_read_group_is_not_lost_to_eviction_while_the_group_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _kv(41)
    tokens = torch.randint(0, 50_000, (N,), generator=torch.Generator().manual_seed(41)).tolist()
    async with KVCache(_config(tmp_path), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(tokens, torch.arange(N))
        await writer.flush()
    kv = _kv(42)
    async with KVCache(_config(tmp_path), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        pool, disk = cache.pool, cache.disk
        assert disk is not None
        keys = cache.keys(tokens)
        await cache.prefetch(tokens[: (IN_POOL + 1) * T])  # pages 0..IN_POOL in the pool
        for key in keys[:IN_POOL]:
            assert pool.table.discard(key)  # only page IN_POOL stays, unreferenced
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, PAGES)

        real = disk.read_many
        read = asyncio.Event()
        go_on = asyncio.Event()

        async def held(*args: Any) -> list[bool]:  # the real reads, the first group's outcome held back
            oks = await real(*args)
            if len(oks) == GROUP - 1:  # the first group, less the page in the pool
                read.set()
                await go_on.wait()
            return oks

        monkeypatch.setattr(disk, "read_many", held)
        reads_before = disk.statistics().reads
        load = asyncio.create_task(cache.load(match, torch.arange(N, 2 * N)))
        async with asyncio.timeout(BOUND_S):
            await read.wait()
        # Another request's pages take every page the pool will give (evicting what nobody holds).
        others: list[PageHandle] = []
        for i in range(POOL_PAGES):
            (res,) = pool.reserve([bytes([0xEE, 0x41]) + i.to_bytes(14, "little")])
            if res.outcome is not ReserveOutcome.RESERVED or res.handle is None:
                break
            others.append(res.handle)
        go_on.set()
        async with asyncio.timeout(BOUND_S):
            result = await load
        for handle in others:
            pool.table.abort(handle)
        errors = {name: count for name, count in cache.stats().errors.items() if count}
        assert result.tokens == N, (result, errors)
        assert torch.equal(kv[:, N : 2 * N], source[:, :N])
        assert not errors, errors
        assert disk.statistics().reads - reads_before == PAGES - 1  # the page in the pool was not read again
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_page_another_call_brings_in_inside_a_read_group_is_held_once_it_lands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a page another call is reading when the group starts (PENDING): it was
    looked at again only after the group's batch, by when the other call (a prefetch) had
    committed and let go of it and the pool's pressure had evicted it."""
    source = _kv(43)
    tokens = torch.randint(0, 50_000, (N,), generator=torch.Generator().manual_seed(43)).tolist()
    async with KVCache(_config(tmp_path), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(tokens, torch.arange(N))
        await writer.flush()
    kv = _kv(44)
    async with KVCache(_config(tmp_path), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        pool, disk = cache.pool, cache.disk
        assert disk is not None
        await cache.prefetch(tokens[: IN_POOL * T])  # pages before IN_POOL in the pool
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (IN_POOL, PAGES - IN_POOL)

        real = disk.read_many
        held = {1: asyncio.Event(), GROUP - 1: asyncio.Event()}  # by batch size: the prefetch's, the group's
        go_on = {1: asyncio.Event(), GROUP - 1: asyncio.Event()}

        async def hold(keys: Any, handles: Any) -> list[bool]:  # the real reads, their outcome held back
            oks = await real(keys, handles)
            if len(oks) in held:
                held[len(oks)].set()
                await go_on[len(oks)].wait()
            return oks

        monkeypatch.setattr(disk, "read_many", hold)
        async with asyncio.timeout(BOUND_S):
            prefetch = asyncio.create_task(cache.prefetch(tokens[: (IN_POOL + 1) * T]))  # reads page IN_POOL
            await held[1].wait()
            load = asyncio.create_task(cache.load(match, torch.arange(N, 2 * N)))
            await held[GROUP - 1].wait()  # the load's first group read the rest of its pages
            go_on[1].set()
            assert (await prefetch).promoted == 1  # page IN_POOL committed, and let go by the prefetch
        others: list[PageHandle] = []
        for i in range(POOL_PAGES):  # another request takes every page the pool will give
            (res,) = pool.reserve([bytes([0xEE, 0x43]) + i.to_bytes(14, "little")])
            if res.outcome is not ReserveOutcome.RESERVED or res.handle is None:
                break
            others.append(res.handle)
        go_on[GROUP - 1].set()
        async with asyncio.timeout(BOUND_S):
            result = await load
        for handle in others:
            pool.table.abort(handle)
        errors = {name: count for name, count in cache.stats().errors.items() if count}
        assert result.tokens == N, (result, errors)
        assert torch.equal(kv[:, N : 2 * N], source[:, :N])
        assert not errors, errors
        await assert_quiescent(cache)
