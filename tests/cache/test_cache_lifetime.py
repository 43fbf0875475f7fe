"""Lifetime edges: cancelled flush, close timeout, restart after close, dropped matches, bad devices."""

from __future__ import annotations

import asyncio
import gc
import threading
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt

import aiokv.manager as manager_module
from aiokv import KVCache
from aiokv.rates_file import RATES_FILE, write_rates_file
from aiokv.storage import DiskTier

T = LAYOUT.page_tokens


@pytest.mark.asyncio
async def test_cancelled_flush_and_close_timeout_leave_background_jobs_consistent() -> None:
    # Regression: flush()/aclose() gathered the jobs' futures, so cancelling flush (or the close
    # timeout) cancelled them and the job's completion raised InvalidStateError in a callback.
    loop = asyncio.get_running_loop()
    cache = KVCache(config(None, close_timeout=0.05), LAYOUT, make_kv(50))
    await cache.start()
    job: asyncio.Future[None] = loop.create_future()
    finished: list[int] = []
    cache.manager.track(job, lambda: finished.append(1))  # a copy abandoned by a cancelled caller
    flush = asyncio.create_task(cache.flush())
    await asyncio.sleep(0)
    flush.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flush
    assert cache.stats().background_jobs == 1
    await cache.aclose()  # times out on the job (counted), does not hang
    assert cache.manager.faults["close_timeout"] == 1
    job.set_result(None)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert finished == [1]  # the job's completion ran; loop_hygiene fails on any callback error


@pytest.mark.asyncio
async def test_start_after_aclose_raises() -> None:
    cache = KVCache(config(None), LAYOUT, make_kv(51))
    await cache.start()
    await cache.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await cache.start()
    never_started = KVCache(config(None), LAYOUT, make_kv(51))
    await never_started.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await never_started.start()


@pytest.mark.asyncio
async def test_tokens_on_the_meta_device_are_a_value_error() -> None:
    async with KVCache(config(None), LAYOUT, make_kv(52)) as cache:
        meta = torch.zeros(2 * T, dtype=torch.long, device="meta")
        with pytest.raises(ValueError, match="meta"):
            await cache.match(meta)
        with pytest.raises(ValueError, match="meta"):
            await cache.offload(meta, torch.arange(2 * T))
        with pytest.raises(ValueError, match="meta"):
            await cache.prefetch(meta)
        assert cache.stats().pool_ready == 0


@pytest.mark.asyncio
async def test_a_dropped_match_gives_its_pages_back_with_a_resource_warning(tmp_path: Path) -> None:
    tokens = prompt(53, 3 * T)
    async with KVCache(config(None, pool_pages=4), LAYOUT, make_kv(53)) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(3 * T))
        match = await cache.match(tokens)
        assert cache.stats().pool_referenced == 3
        with pytest.warns(ResourceWarning, match="unreleased Match"):
            del match  # dropped without release() or load(): freed at once (refcount)
        gc.collect()
        await asyncio.sleep(0)  # the release runs on the loop that owns the page table
        assert cache.stats().pool_referenced == 0
        await assert_quiescent(cache)


def _hold_rates_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Future[None], threading.Event]:
    """Every write of the rates file blocks (a slow disk) until the returned event is set; the
    future resolves once the first write has begun."""
    loop = asyncio.get_running_loop()
    entered: asyncio.Future[None] = loop.create_future()
    release = threading.Event()

    def held(directory: Path, data: bytes, fd: int | None = None) -> bool:
        loop.call_soon_threadsafe(lambda: entered.done() or entered.set_result(None))
        assert release.wait(30), "the test never released the rates write"
        return write_rates_file(directory, data, fd)

    monkeypatch.setattr(manager_module, "write_rates_file", held)
    return entered, release


async def _directory_is_free(root: Path) -> bool:
    """Whether a new cache over ``root`` gets the directory's lock (no open tier holds it)."""
    async with KVCache(config(root), LAYOUT, make_kv(54)) as probe:
        assert probe.disk is not None
        return probe.disk.read_only is None


@pytest.mark.asyncio
async def test_a_cancelled_close_is_finished_by_the_next_one_before_the_pool_is_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: the close marked the manager closed, then was cancelled while the rates were
    # saved; a second aclose() saw it closed and freed the pool under the still open disk tier
    # (its ring, threads, lock, and write-behind that may use pool pages).
    entered, release = _hold_rates_writes(monkeypatch)
    cache = KVCache(config(tmp_path), LAYOUT, make_kv(54))
    await cache.start()
    disk = cache.disk
    assert disk is not None and disk.read_only is None
    cache.manager.costs.pool.update(1e9, 1.0)  # a rate changed: the close (or a save it waits for) writes it
    first = asyncio.create_task(cache.aclose())
    await entered  # the rates file is being written
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    second = asyncio.create_task(cache.aclose())  # the engine's retry
    for _ in range(20):
        await asyncio.sleep(0)
    assert not second.done(), "the second close returned while the first was still closing"
    assert not cache.pool.closed  # nothing freed the pool under the disk tier
    release.set()
    await second
    assert cache.pool.closed
    assert await _directory_is_free(tmp_path)  # the tier was closed: its lock is released
    assert (tmp_path / LAYOUT.fingerprint.hex() / RATES_FILE).is_file()  # and the rates were saved


@pytest.mark.asyncio
async def test_a_close_during_start_waits_for_the_disk_tier_it_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: a close while start() was opening the disk tier saw no tier, so the pool was
    # freed; the start then kept a tier open over the freed pool.
    entered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    gate = asyncio.Event()
    real_start = DiskTier.start

    async def held_start(tier: DiskTier) -> None:
        entered.set_result(None)
        await gate.wait()  # the directory checks and the ring set-up take a while
        await real_start(tier)

    monkeypatch.setattr(DiskTier, "start", held_start)
    cache = KVCache(config(tmp_path), LAYOUT, make_kv(55))
    starting = asyncio.create_task(cache.start())
    await entered
    closing = asyncio.create_task(cache.aclose())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not closing.done(), "the close returned while the start was still opening the disk tier"
    assert not cache.pool.closed
    gate.set()
    with pytest.raises(RuntimeError, match="closed while it was starting"):
        await starting
    await closing
    assert cache.pool.closed
    monkeypatch.setattr(DiskTier, "start", real_start)
    assert await _directory_is_free(tmp_path)


@pytest.mark.asyncio
async def test_a_cancelled_close_finishes_without_a_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: KVCache.aclose cancelled while the manager closed returned with the bridge's
    # threads and the pool still open, and nothing freed them unless the engine called it again.
    entered, release = _hold_rates_writes(monkeypatch)
    cache = KVCache(config(tmp_path), LAYOUT, make_kv(56))
    await cache.start()
    cache.manager.costs.pool.update(1e9, 1.0)  # a rate changed: the close writes it (held here)
    first = asyncio.create_task(cache.aclose())
    await entered
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert not cache.pool.closed
    release.set()
    closing = cache._close_task  # no second aclose(): the close goes on by itself
    assert closing is not None
    await asyncio.wait_for(asyncio.shield(closing), 10)
    assert cache.pool.closed
    assert cache._bridge.closed
    assert await _directory_is_free(tmp_path)
    await cache.aclose()  # idempotent: returns at once


@pytest.mark.asyncio
async def test_a_failing_disk_close_still_frees_the_pool_and_the_bridge(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression (review): an error out of the manager's close (here the disk tier's close failing
    # with EIO) was the stored close's outcome: every aclose() re-raised it and the pool and the
    # bridge were never freed. The failure is counted; the close goes on.
    cache = KVCache(config(tmp_path), LAYOUT, make_kv(57))
    await cache.start()
    real = DiskTier.aclose

    async def failing(self: DiskTier) -> None:
        await real(self)
        raise OSError(5, "EIO at close (injected)")

    monkeypatch.setattr(DiskTier, "aclose", failing)
    await cache.aclose()
    assert cache.pool.closed and cache._bridge.closed
    assert cache.stats().errors["close_failed"] == 1
    await cache.aclose()  # idempotent
