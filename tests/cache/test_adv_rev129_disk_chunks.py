"""Review 129 of 8d3c74c: a load copies each read group's disk pages in launch groups (chunks).

Attacks (the cancel at every loop turn is tests/cache/test_adv_rev111_group_reads.py's sweep, whose
groups are several chunks): a cancel right after each launch, copy failures in a
multi-page disk chunk, the close beginning between chunks, a corrupt/missing page inside a group,
from_token inside the first disk page, mixed pool + disk matches. Every attempt checks the prefix,
the counters, bytes outside the requested slots, that no copy writes after a cancel returned, and
that every pool reference is released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import assert_quiescent, mover_of
from group_helpers import (
    GROUP,
    LAYOUT,
    T,
    group_config,
    pages_unchanged,
    put_on_disk,
    random_kv,
    random_tokens,
    take_free_pages,
)

from aiokv import CacheConfig, DiskBackend, KVCache

PAGES = GROUP + 9  # 41 pages: with up to 2 pooled, >= two read groups
N = PAGES * T
POOL_PAGES = PAGES + 16
SLOTS = 4 * N


def _config(root: Path, backend: DiskBackend = DiskBackend.THREADS, **extra: Any) -> CacheConfig:
    cfg = group_config(root, PAGES, POOL_PAGES, backend, offload_wait=0.01)
    extra.setdefault("launch_pages", 3)
    extra.setdefault("launch_turn_s", 0.0)
    return dataclasses.replace(cfg, **extra)


async def _setup(cache: KVCache, tokens: list[int], pooled: int) -> None:
    """Every page out of the pool, then the first ``pooled`` pages back in (unreferenced)."""
    for key in cache.keys(tokens):
        cache.pool.table.discard(key)
    if pooled:
        await cache.prefetch(tokens[: pooled * T])


def _slow_copies(cache: KVCache, monkeypatch: pytest.MonkeyPatch, delay: float = 0.0005) -> list[int]:
    """Each copy takes ``delay`` longer on the copy thread (a copy left running after a cancel
    would write the slots late); returns the page counts of the copies, in launch order."""
    mover = mover_of(cache)
    real = mover.load
    sizes: list[int] = []

    def slow(page_ids: list[int], slots: torch.Tensor, skip: int = 0, **kwargs: Any) -> Any:
        time.sleep(delay)
        return real(page_ids, slots, skip, **kwargs)

    transfers = cache._transfers
    assert transfers is not None
    real_launch = transfers.load

    def counted(ids: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(ids))
        return real_launch(ids, *args, **kwargs)

    monkeypatch.setattr(mover, "load", slow)
    monkeypatch.setattr(transfers, "load", counted)
    return sizes




@pytest.mark.asyncio
@pytest.mark.parametrize("fail_call", [1, 2, 4, 7, 11, 14])
@pytest.mark.parametrize(("pooled", "from_token"), [(0, T + 1), (2, 1), (2, 2 * T + 2)])
async def test_a_failed_disk_chunk_ends_the_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   fail_call: int, pooled: int, from_token: int) -> None:
    source = random_kv(41, SLOTS)
    tokens = random_tokens(41, N)
    await put_on_disk(_config(tmp_path), tokens, source)
    kv = random_kv(42, SLOTS)
    async with KVCache(_config(tmp_path), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await _setup(cache, tokens, pooled)
        mover = mover_of(cache)
        real = mover.load
        calls: list[int] = []

        def fails(page_ids: list[int], slots: torch.Tensor, skip: int = 0, **kwargs: Any) -> Any:
            calls.append(len(page_ids))
            if len(calls) == fail_call:
                real(page_ids[:1], slots[: T - skip], skip, **kwargs)  # part written, then a fault
                raise RuntimeError("copy engine fault (injected)")
            return real(page_ids, slots, skip, **kwargs)

        monkeypatch.setattr(mover, "load", fails)
        match = await cache.match(tokens)
        target = torch.arange(N + from_token, 2 * N)
        before = kv.clone()
        stats0 = cache.stats()
        result = await cache.load(match, target, from_token=from_token)
        first = from_token // T
        good = sum(calls[: fail_call - 1])  # pages of the copies before the failed one
        if len(calls) < fail_call:
            assert result.tokens == N
            pytest.skip("fewer copies")
        assert result.tokens == max(from_token, (first + good) * T), (result, calls)
        loaded = result.tokens - from_token
        assert torch.equal(kv[:, target[:loaded]], source[:, from_token : result.tokens])
        outside = torch.ones(SLOTS, dtype=torch.bool)
        outside[target] = False
        assert torch.equal(kv[:, outside], before[:, outside])
        stats = cache.stats()
        assert stats.errors["copy_failed"] == 1 and stats.errors["load_shortened"] == 1, stats.errors
        pool_good = min(good, max(0, pooled - first))
        assert result.pool_pages == pool_good and result.disk_pages == good - pool_good, result
        lt = {k: stats.loaded_tokens[k] - stats0.loaded_tokens[k] for k in stats.loaded_tokens}
        assert sum(lt.values()) == good * T
        assert stats.pages_withdrawn == stats0.pages_withdrawn
        await assert_quiescent(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("after_call", [1, 2, 5, 11, 14])
@pytest.mark.parametrize("extra_turns", [0, 1, 2])
async def test_the_close_begins_between_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               after_call: int, extra_turns: int) -> None:
    source = random_kv(51, SLOTS)
    tokens = random_tokens(51, N)
    await put_on_disk(_config(tmp_path), tokens, source)
    kv = random_kv(52, SLOTS)
    cache = KVCache(_config(tmp_path), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    transfers = cache._transfers
    assert transfers is not None
    real_launch = transfers.load
    sizes: list[int] = []
    closing: list[asyncio.Task[None]] = []

    async def close_later() -> None:
        for _ in range(extra_turns):
            await asyncio.sleep(0)
        await cache.aclose()

    def counted(ids: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(ids))
        copy = real_launch(ids, *args, **kwargs)
        if len(sizes) == after_call:
            closing.append(asyncio.ensure_future(close_later()))
        return copy

    monkeypatch.setattr(transfers, "load", counted)
    manager = cache._manager
    real_close_pool = manager.close_pool
    seen: dict[str, Any] = {}
    load_task: list[asyncio.Task[Any]] = []

    async def checked_close_pool() -> None:
        await asyncio.wait(load_task)
        manager.pool.table.check_invariants()
        seen["referenced"] = manager.stats().pool_referenced
        seen["reserved"] = manager.stats().pool_reserved
        seen["stats"] = manager.stats()
        await real_close_pool()

    monkeypatch.setattr(manager, "close_pool", checked_close_pool)
    match = await cache.match(tokens)
    target = torch.arange(N + 1, 2 * N)
    before = kv.clone()
    load_task.append(asyncio.ensure_future(cache.load(match, target, from_token=1)))
    result = await load_task[0]
    if closing:
        await closing[0]
    else:
        await cache.aclose()
    stats = seen["stats"]
    assert (seen["referenced"], seen["reserved"]) == (0, 0)
    loaded_pages = result.pool_pages + result.disk_pages
    assert loaded_pages == sum(sizes) or (loaded_pages < sum(sizes)), (result, sizes)
    assert torch.equal(kv[:, target[: result.tokens - 1]], source[:, 1 : result.tokens])
    outside = torch.ones(SLOTS, dtype=torch.bool)
    outside[target] = False
    assert torch.equal(kv[:, outside], before[:, outside])
    errors = {k: v for k, v in stats.errors.items() if v}
    if result.tokens < N:
        assert loaded_pages + stats.pages_withdrawn == PAGES, (result, stats.pages_withdrawn, sizes)
        assert not errors, (errors, result, sizes)


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [1, 7, 31, 32, 40])
@pytest.mark.parametrize("how", ["corrupt", "missing"])
@pytest.mark.parametrize("from_token", [0, 3])
async def test_a_bad_page_in_a_group_ends_the_prefix(tmp_path: Path, bad: int, how: str, from_token: int) -> None:
    source = random_kv(61, SLOTS)
    tokens = random_tokens(61, N)
    await put_on_disk(_config(tmp_path), tokens, source)
    kv = random_kv(62, SLOTS)
    async with KVCache(_config(tmp_path), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert cache.disk is not None
        # a few pages after the bad one already in the pool: held by the group, must be released
        await cache.prefetch(tokens[: min(PAGES, bad + 3) * T])
        for key in cache.keys(tokens)[: bad + 1]:
            cache.pool.table.discard(key)
        match = await cache.match(tokens)
        path = cache.disk.files.path(cache.keys(tokens)[bad])
        if how == "corrupt":
            fd = os.open(path, os.O_RDWR)
            b = os.pread(fd, 1, 4096 + 5)
            os.pwrite(fd, bytes([b[0] ^ 0x10]), 4096 + 5)
            os.close(fd)
        else:
            os.unlink(path)
        target = torch.arange(N + from_token, 2 * N)
        before = kv.clone()
        result = await cache.load(match, target, from_token=from_token)
        want = max(from_token, bad * T) if match.pool_pages == 0 else None
        assert result.tokens == want, (result, match.pool_pages, match.disk_pages)
        n = result.tokens - from_token
        assert torch.equal(kv[:, target[:n]], source[:, from_token : result.tokens])
        outside = torch.ones(SLOTS, dtype=torch.bool)
        outside[target] = False
        assert torch.equal(kv[:, outside], before[:, outside])
        errs = cache.stats().errors
        assert errs["load_shortened"] == 1 and errs.get("copy_failed", 0) == 0, errs
        await assert_quiescent(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("at_call", [1, 2, 3, 6, 12, 16])
@pytest.mark.parametrize(("pooled", "from_token"), [(0, T + 1), (2, 1), (2, 2 * T + 1), (3, 0)])
async def test_cancel_right_after_each_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              at_call: int, pooled: int, from_token: int) -> None:
    """The cancel is requested inside the at_call-th launch: it lands on the very next await of the
    load (the new sleep(0) between disk chunks, or the wait for the next read group)."""
    source = random_kv(71, SLOTS)
    tokens = random_tokens(71, N)
    await put_on_disk(_config(tmp_path), tokens, source)
    kv = random_kv(72, SLOTS)
    async with KVCache(_config(tmp_path), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        sizes = _slow_copies(cache, monkeypatch, 0.002)
        transfers = cache._transfers
        assert transfers is not None
        launch = transfers.load
        tasks: list[asyncio.Task[Any]] = []

        def cancelling(ids: Any, *args: Any, **kwargs: Any) -> Any:
            copy = launch(ids, *args, **kwargs)
            if len(sizes) == at_call:
                tasks[0].cancel()
            return copy

        monkeypatch.setattr(transfers, "load", cancelling)
        await _setup(cache, tokens, pooled)
        match = await cache.match(tokens)
        target = torch.arange(N + from_token, 2 * N)
        before = kv.clone()
        tasks.append(asyncio.ensure_future(cache.load(match, target, from_token=from_token)))
        try:
            result = await tasks[0]
        except asyncio.CancelledError:
            snap = kv.clone()
            taken = take_free_pages(cache, POOL_PAGES, 1, 0x33)
            await cache._bridge.run_cpu(lambda: None)  # copies stay in order: every one queued has run
            await cache.flush()
            assert torch.equal(kv, snap), "a copy wrote the slots after the cancelled load returned"
            pages_unchanged(cache, taken, 0x33)
        else:
            assert len(sizes) < at_call and result.tokens == N
            pytest.skip("fewer launches")
        outside = torch.ones(SLOTS, dtype=torch.bool)
        outside[target] = False
        assert torch.equal(kv[:, outside], before[:, outside])
        errors = {k for k, v in cache.stats().errors.items() if v}
        assert not errors, cache.stats().errors
        await assert_quiescent(cache)
        # the cache still serves the prompt exactly
        for key in cache.keys(tokens):
            cache.pool.table.discard(key)
        again = await cache.load(await cache.match(tokens), torch.arange(2 * N, 3 * N))
        assert again.tokens == N
        assert torch.equal(kv[:, 2 * N : 3 * N], source[:, :N])
        await assert_quiescent(cache)
