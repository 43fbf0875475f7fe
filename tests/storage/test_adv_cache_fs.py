"""Adversarial: a whole KVCache over a real small ext4 that fills up while write-behind runs, then is
remounted read-only while offloads and loads go on, then read-write again; finally a restart.

Contract checked through the public API only: offload/load/prefetch never raise, never hang
(bounded waits), every byte served matches a prefix oracle (each token's KV is a function of its
whole prefix), faults are counted, and once room is back new pages reach the disk again. Root only.
"""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest
import torch
import xxhash
from fs_helpers import fill_up, loop_ext4, remount

from aiokv import CacheConfig, KVCache, KVLayout
from aiokv.storage import DiskConfig

LAYOUT = KVLayout.mha(2, 2, 64, torch.float16, page_tokens=16)  # 16 KiB pages
T = LAYOUT.page_tokens
SLOTS = 64 * T


def oracle(tokens: list[int]) -> torch.Tensor:
    rows = [torch.empty(LAYOUT.num_layers, 0, LAYOUT.rows, LAYOUT.head_dim)]
    state = xxhash.xxh64(b"adv-fs")
    for token in tokens:
        state.update(token.to_bytes(8, "little"))
        gen = torch.Generator().manual_seed(state.intdigest() & (2**63 - 1))
        rows.append(torch.randn(LAYOUT.num_layers, 1, LAYOUT.rows, LAYOUT.head_dim, generator=gen))
    return torch.cat(rows, dim=1).to(LAYOUT.dtype)


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    trunk = [rng.randrange(50_000) for _ in range(4 * T)]
    return [trunk[: rng.randrange(0, 5) * T] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 4) * T)]
            for _ in range(count)]


def cache_config(directory: Path) -> CacheConfig:
    disk = DiskConfig(directory=directory, capacity_bytes=64 << 20, min_free_bytes=0, free_space_recheck_s=0.2,
                      queue_depth=8, write_behind_workers=4)
    return CacheConfig(cpu_bytes=24 * LAYOUT.page_bytes, disk=disk, namespace="adv-fs",
                       pool_chunk_bytes=8 * LAYOUT.page_bytes, offload_wait=2.0)


async def offload_all(cache: KVCache, kv: torch.Tensor, batch: list[list[int]]) -> None:
    for tokens in batch:
        slots = torch.arange(len(tokens))
        kv[:, slots] = oracle(tokens)
        await asyncio.wait_for(cache.offload(tokens, slots), 20)


async def check_all(cache: KVCache, kv: torch.Tensor, batch: list[list[int]]) -> int:
    """Load every prompt (half through prefetch first): served bytes must be the oracle's."""
    served = 0
    for i, tokens in enumerate(batch):
        if i % 2:
            await asyncio.wait_for(cache.prefetch(tokens), 20)
        match = await asyncio.wait_for(cache.match(tokens), 20)
        kv.zero_()
        result = await asyncio.wait_for(cache.load(match, torch.arange(match.tokens)), 20)
        assert torch.equal(kv[:, : result.tokens], oracle(tokens[: result.tokens])), f"wrong KV for prompt {i}"
        served += result.tokens
    return served


async def remount_read_only(mount: Path) -> int:
    """``remount,ro`` as an operator would, retried while write-behind holds files open (EBUSY);
    returns the tries it took."""
    for tries in range(1, 2000):
        try:
            await asyncio.to_thread(remount, mount, "ro")
            return tries
        except AssertionError as exc:
            if "busy" not in str(exc):
                raise
        await asyncio.sleep(0.002)
    raise AssertionError("the file system stayed busy")


def disk_pages(cache: KVCache) -> int:
    stats = cache.stats().disk
    assert stats is not None
    return stats.pages


@pytest.mark.root
@pytest.mark.asyncio
async def test_cache_over_a_filling_then_read_only_file_system(tmp_path: Path) -> None:
    kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    first, second, third, fourth = (prompts(s, 40) for s in (1, 2, 3, 4))
    with loop_ext4(tmp_path, 24) as mount:
        async with KVCache(cache_config(mount / "kv"), LAYOUT, kv) as cache:
            # The disk fills up (another program) while write-behind of `first` runs.
            filler = threading.Thread(target=fill_up, args=(mount / "ballast", 0))
            filler.start()
            await offload_all(cache, kv, first)
            await asyncio.to_thread(filler.join)
            await offload_all(cache, kv, second)
            await asyncio.wait_for(cache.flush(), 30)
            errors = cache.stats().errors
            assert errors.get("disk_enospc", 0) > 0, errors
            assert errors.get("disk_eio", 0) == 0, errors  # a full disk is not an I/O error
            assert await check_all(cache, kv, first + second) > 0

            # Room is back: new pages reach the disk again.
            (mount / "ballast").unlink()
            await asyncio.sleep(0.5)  # past free_space_recheck_s
            before = disk_pages(cache)
            await offload_all(cache, kv, third)
            await asyncio.wait_for(cache.flush(), 30)
            assert disk_pages(cache) > before, "no new page reached the disk once room was back"

            # Read-only under running write-behind: offloads go on (pool only), loads stay right.
            offloading = asyncio.ensure_future(offload_all(cache, kv, fourth))
            await remount_read_only(mount)
            await offloading
            await asyncio.wait_for(cache.flush(), 30)
            assert await check_all(cache, kv, first + second + third + fourth) > 0
            await asyncio.to_thread(remount, mount, "rw")
            await asyncio.wait_for(cache.flush(), 30)
            pool = cache.pool.table.statistics()
            assert pool.reserved == 0 and pool.referenced == 0, pool

        # A restart over what the faults left: every page served is right.
        async with KVCache(cache_config(mount / "kv"), LAYOUT, kv) as cache:
            assert disk_pages(cache) > 0
            assert await check_all(cache, kv, first + second + third + fourth) > 0
            errors = cache.stats().errors
            assert errors.get("disk_eio", 0) == 0, errors
