"""Adversarial: a frozen file system (``fsfreeze -f``: a snapshot, a stuck device) under a whole KVCache.

A freeze blocks page-file writes in the kernel, not reads. A load of pages that are on disk only must
not wait behind the blocked write-behind (#11: on the threads backend it waited in the one shared
worker queue until the thaw, 14 s; io_uring: 0.00 s). A watchdog thaws after THAW_S so nothing stays
stuck when the check fails. Root only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from disk_helpers import BIG, assert_clean, config, fill, key_of, ready_pool, write_page
from fs_helpers import freeze, loop_ext4, thaw
from test_adv_cache_fs import LAYOUT, SLOTS, cache_config, offload_all, oracle, prompts

from aiokv import DiskBackend, KVCache
from aiokv.storage import DiskTier
from aiokv.storage import disk as disk_module

THAW_S = 20.0
READ_BOUND_S = 2.0



@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.URING, DiskBackend.THREADS],
                         ids=lambda b: b.value)
async def test_loads_of_disk_pages_never_wait_behind_writes_a_freeze_blocks(tmp_path: Path,
                                                                           backend: DiskBackend) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = cache_config(mount / "kv")
        assert cfg.disk is not None
        cfg = dataclasses.replace(cfg, disk=dataclasses.replace(cfg.disk, backend=backend))
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        try:
            async with KVCache(cfg, LAYOUT, kv) as cache:
                old = prompts(1, 10)
                await offload_all(cache, kv, old)
                await cache.flush()
                await offload_all(cache, kv, prompts(3, 10))  # old's pages now on disk only
                await cache.flush()
                freeze(mount)
                watchdog.start()
                await offload_all(cache, kv, prompts(2, 8))  # write-behind blocks in the kernel
                await asyncio.sleep(0.5)
                stats = cache.stats().disk
                assert stats is not None and stats.in_flight > 0, "no write is blocked: the freeze did not bite"
                match = await cache.match(old[0])
                assert match.disk_pages > 0
                kv.zero_()
                began = time.perf_counter()
                result = await cache.load(match, torch.arange(match.tokens))
                took = time.perf_counter() - began
                assert took < READ_BOUND_S, f"a disk read waited {took:.1f} s behind writes blocked by the freeze"
                assert result.tokens == match.tokens
                assert torch.equal(kv[:, : result.tokens], oracle(old[0][: result.tokens]))
                thaw(mount)  # the close waits for the blocked writes (bounding it is another matter)
        finally:
            watchdog.cancel()
            thaw(mount)



# -- a bounded close of the tier ------------------------------------------------------------------

CLOSE_S = 1.0
MARGIN_S = 1.5


@pytest.mark.root
@pytest.mark.asyncio
async def test_healthy_tier_close_within_closes(tmp_path: Path, backend: DiskBackend) -> None:
    with ready_pool(BIG, 8) as pool:
        tier = DiskTier(config(tmp_path / "disk", backend), BIG, pool)
        await tier.start()
        ok, _ = await write_page(tier, pool, 0)
        assert ok
        assert await tier.close_within(CLOSE_S) is True
        assert tier.io_ended.done()
        with pytest.raises(ValueError, match="finite"):
            await tier.close_within(-1.0)
        assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_tier_close_within_returns_while_writes_hang_and_io_ended_waits_for_them(
        tmp_path: Path, backend: DiskBackend) -> None:
    """Write-behind stuck in the kernel (frozen): ``close_within`` returns False after its bound and
    drops the pages still queued (counted); ``io_ended`` stays pending until the thaw lets the stuck
    writes end, then resolves, and those writes landed."""
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    with ready_pool(BIG, 8) as pool, loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, min_free_bytes=0)  # 2 write-behind workers, 8 queued
        tier = DiskTier(cfg, BIG, pool)
        await tier.start()
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        try:
            freeze(mount)
            watchdog.start()
            for i in range(8):
                assert tier.write_behind_nowait(key_of(i), fill(pool, key_of(i), i))
            await asyncio.sleep(0.3)
            assert tier.statistics().in_flight > 0, "no write is blocked: the freeze did not bite"
            began = time.perf_counter()
            closed = await tier.close_within(CLOSE_S)
            took = time.perf_counter() - began
            assert closed is False
            assert took < CLOSE_S + MARGIN_S, f"close_within took {took:.1f} s"
            assert not tier.io_ended.done()
            assert tier in disk_module._STUCK  # kept from collection (unmapping) whatever else drops it
            await asyncio.sleep(0.3)
            stats = tier.statistics()
            assert stats.write_behind_queued == 0, stats  # dropped, not written behind the stuck ones
            assert stats.in_flight > 0
            thaw(mount)
            async with asyncio.timeout(THAW_S):
                await asyncio.shield(tier.io_ended)
            assert tier not in disk_module._STUCK
            await tier.aclose()  # already closed: returns at once
            stats = tier.statistics()
            assert stats.writes > 0 and stats.dropped > 0 and stats.writes + stats.dropped == 8, stats
        finally:
            watchdog.cancel()
            thaw(mount)
        assert_clean(pool)


# -- a bounded close of the whole cache -----------------------------------------------------------

CACHE_CLOSE_S = 2.0


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.URING, DiskBackend.THREADS],
                         ids=lambda b: b.value)
async def test_cache_aclose_keeps_close_timeout_on_a_frozen_disk_and_frees_the_pool_after_the_thaw(
        tmp_path: Path, backend: DiskBackend) -> None:
    """``aclose()`` returned only at the thaw (11-14 s with close_timeout=2, every backend). Now it
    returns after close_timeout, counted (``close_timeout``); the pool stays mapped while the stuck
    writes may still read it, and is freed once the thaw lets them end."""
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = cache_config(mount / "kv")
        assert cfg.disk is not None
        cfg = dataclasses.replace(cfg, close_timeout=CACHE_CLOSE_S, disk=dataclasses.replace(cfg.disk, backend=backend))
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        cache = KVCache(cfg, LAYOUT, kv)
        try:
            await cache.start()
            await offload_all(cache, kv, prompts(1, 10))
            await cache.flush()
            freeze(mount)
            watchdog.start()
            await offload_all(cache, kv, prompts(2, 8))  # write-behind blocks in the kernel
            await asyncio.sleep(0.5)
            stats = cache.stats().disk
            assert stats is not None and stats.in_flight > 0, "no write is blocked: the freeze did not bite"
            segment = cache.pool.memory.segment
            began = time.perf_counter()
            await cache.aclose()
            took = time.perf_counter() - began
            assert took < CACHE_CLOSE_S + MARGIN_S, f"aclose() took {took:.1f} s with close_timeout {CACHE_CLOSE_S} s"
            assert cache.stats().errors.get("close_timeout", 0) >= 1
            await asyncio.sleep(0.5)
            assert not segment.closed, "the pool was unmapped while writes stuck in the kernel may still read it"
            thaw(mount)
            async with asyncio.timeout(THAW_S):
                while not segment.closed:  # noqa: ASYNC110 (freed by the end of the stuck I/O)
                    await asyncio.sleep(0.05)
        finally:
            watchdog.cancel()
            thaw(mount)
            await cache.aclose()
