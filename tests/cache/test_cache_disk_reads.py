"""Only pages a call read from disk count for the learned disk rate (and as promoted).

A disk page of a match may be in the pool by the time it is loaded (a request sharing the prefix
loaded it, a prefetch brought it, another call's read is landing): its "promotion" takes no disk
time. Counted as a read it folded N pages in microseconds into the disk rate, which is saved
across restarts (the review saw 0.70 -> 17.55 GB/s), and the cost model then planned disk loads
that lose to recomputing. Real caches over real page files throughout.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache
from aiokv.costs import RateMeter
from aiokv.rates_file import decode_rates, read_rates_file

T = LAYOUT.page_tokens
PAGES = 8
N = PAGES * T
PAGE = LAYOUT.page_bytes
FINGERPRINT = LAYOUT.fingerprint.hex()


async def _on_disk_only(root: Path, tokens: list[int]) -> None:
    """Every page of ``tokens`` on disk; the cache that wrote them closes (a fresh pool holds none)."""
    async with KVCache(config(root, pool_pages=32), LAYOUT, make_kv(1)) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(len(tokens)))
        await cache.flush()


def _record_folds(meter: RateMeter) -> list[float]:
    """The amounts ``meter`` is asked to fold (the real update still runs)."""
    amounts: list[float] = []
    update = meter.update

    def recorded(amount: float, seconds: float) -> None:
        amounts.append(amount)
        update(amount, seconds)

    meter.update = recorded  # type: ignore[method-assign]
    return amounts


async def _started(root: Path, seed: int, kv: torch.Tensor | None = None) -> KVCache:
    cache = KVCache(config(root, pool_pages=32), LAYOUT, make_kv(seed) if kv is None else kv)
    await cache.start()
    await cache.pool.wait_ready()
    assert cache.manager.costs.disk.samples == 0  # nothing saved: only this test's reads count
    return cache


@pytest.mark.asyncio
async def test_a_second_load_of_a_shared_prefix_folds_no_disk_read(tmp_path: Path) -> None:
    tokens = prompt(1, N)
    await _on_disk_only(tmp_path, tokens)
    kv = make_kv(2)
    cache = await _started(tmp_path, 2, kv)
    try:
        disk = cache.manager.costs.disk
        folds = _record_folds(disk)
        first, second = await cache.match(tokens), await cache.match(tokens)
        assert first.disk_pages == second.disk_pages == PAGES  # both planned as disk hits
        result = await cache.load(first, torch.arange(N))
        assert result.disk_pages == PAGES and folds == [PAGES * PAGE]
        learned = disk.rate
        # The second request's pages are all in the pool now: no read, nothing to fold.
        result = await cache.load(second, torch.arange(N, 2 * N))
        assert result.disk_pages == PAGES  # still loaded, as matched
        assert folds == [PAGES * PAGE] and disk.samples == 1 and disk.rate == learned
        assert cache.stats().pages_promoted == PAGES
        assert torch.equal(kv[:, N : 2 * N].cpu(), make_kv(1)[:, :N].cpu())  # the bytes written at first
        await assert_quiescent(cache)
    finally:
        await cache.aclose()
    # What was saved is the one real measurement.
    data = read_rates_file(tmp_path / FINGERPRINT)
    assert data is not None
    assert decode_rates(data, FINGERPRINT, DEVICE.type).rates["disk"] == (learned, 1)


@pytest.mark.asyncio
async def test_a_load_folds_only_the_pages_it_read(tmp_path: Path) -> None:
    tokens = prompt(2, N)
    await _on_disk_only(tmp_path, tokens)
    cache = await _started(tmp_path, 3)
    try:
        folds = _record_folds(cache.manager.costs.disk)
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES
        # Half the pages reach the pool after the match (a prefetch of the first half).
        prefetched = await cache.prefetch(tokens[: N // 2])
        assert prefetched.promoted == PAGES // 2
        result = await cache.load(match, torch.arange(N))
        assert result.disk_pages == PAGES
        assert folds == [PAGES // 2 * PAGE]  # the other half took no disk time
        assert cache.stats().pages_promoted == PAGES
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
async def test_a_stream_over_pages_already_in_the_pool_folds_no_disk_read(tmp_path: Path) -> None:
    tokens = prompt(3, N)
    await _on_disk_only(tmp_path, tokens)
    cache = await _started(tmp_path, 4)
    try:
        disk = cache.manager.costs.disk
        folds = _record_folds(disk)
        first, second = await cache.match(tokens), await cache.match(tokens)
        async with await cache.start_load(first, torch.arange(N)) as stream:
            done = await stream.finish()
        assert done.disk_pages == PAGES and folds == [PAGES * PAGE]
        learned = disk.rate
        async with await cache.start_load(second, torch.arange(N, 2 * N)) as stream:
            done = await stream.finish()
        assert done.disk_pages == PAGES and done.loaded_from == 0
        assert folds == [PAGES * PAGE] and disk.samples == 1 and disk.rate == learned
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
async def test_a_stream_folds_only_the_pages_it_read(tmp_path: Path) -> None:
    tokens = prompt(4, N)
    await _on_disk_only(tmp_path, tokens)
    cache = await _started(tmp_path, 5)
    try:
        folds = _record_folds(cache.manager.costs.disk)
        match = await cache.match(tokens)
        assert (await cache.prefetch(tokens[: N // 2])).promoted == PAGES // 2
        async with await cache.start_load(match, torch.arange(N)) as stream:
            done = await stream.finish()
        assert done.disk_pages == PAGES and done.loaded_from == 0
        assert folds == [PAGES // 2 * PAGE]
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
async def test_concurrent_prefetches_report_each_page_read_once(tmp_path: Path) -> None:
    tokens = prompt(5, N)
    await _on_disk_only(tmp_path, tokens)
    cache = await _started(tmp_path, 6)
    try:
        # The second call finds every page being read by the first (PENDING): it read nothing.
        first, second = await asyncio.gather(cache.prefetch(tokens), cache.prefetch(tokens))
        assert (first.pool_pages, first.promoted) == (0, PAGES)
        assert (second.pool_pages, second.promoted) == (0, 0)
        assert cache.stats().pages_promoted == PAGES
        assert cache.stats().bytes_moved["disk_to_pool"] == PAGES * PAGE
        await assert_quiescent(cache)
    finally:
        await cache.aclose()
