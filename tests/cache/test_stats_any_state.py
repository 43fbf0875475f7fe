"""`stats()` answers in every state of a cache: before its start, while the start is held, after a
start cancelled at each of its steps and then closed, after a normal close.

A monitor calls ``stats()`` whenever it likes. It raised "the cache is not started" (``RuntimeError``
from the manager's ``pool`` property) once a start cancelled before its pool opened had been
closed: nothing had set the pool, so the cache had no statistics at all. Now a cache without a pool
reports zeros for it (``PoolStatistics.unopened``) and its own counters as they are.

Each start is held for real on the thread that runs a step (``held_call.Hold``): the pool's
creation, the disk tier's directory preparation, the read of the saved rates (``KVCache`` only); the start task is
cancelled there, the step let go, then the cache closed. ``KVCache`` and ``TPCache`` (no rank
needed: its start only listens).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from cache_helpers import LAYOUT, config, make_kv
from held_call import Hold

import aiokv.manager as manager_module
import aiokv.storage.disk as disk_module
from aiokv import KVCache
from aiokv.pool import PagePool
from aiokv.results import CacheStatistics
from aiokv.tp.cache import TPCache

KINDS = ["kv", "tp"]
# A TPCache reads the saved rates only once its ranks said which device they copy on: not at start.
STEPS = [("kv", "pool"), ("kv", "disk"), ("kv", "rates"), ("tp", "pool"), ("tp", "disk")]


def _cache(kind: str, tmp_path: Path) -> KVCache | TPCache:
    if kind == "kv":
        return KVCache(config(tmp_path / "disk"), LAYOUT, make_kv())
    return TPCache(config(tmp_path / "disk"), LAYOUT, tp_size=2, num_slots=256, directory=tmp_path / "tp")


def _hold(step: str, monkeypatch: pytest.MonkeyPatch) -> Hold:
    """Hold ``step`` of the start on the thread that runs it."""
    hold = Hold()
    if step == "pool":
        monkeypatch.setattr(PagePool, "create", hold.wrap(PagePool.create))
    elif step == "disk":
        monkeypatch.setattr(disk_module, "_start_then_prepare", hold.wrap(disk_module._start_then_prepare))
    else:
        monkeypatch.setattr(manager_module, "read_rates_file", hold.wrap(manager_module.read_rates_file))
    return hold


def _no_pool(stats: CacheStatistics) -> None:
    assert stats.pool.name == "" and stats.pool.pages.capacity == 0 and stats.pool.chunks_total == 0, stats.pool
    assert (stats.pool_free, stats.pool_reserved, stats.pool_ready, stats.pool_referenced) == (0, 0, 0, 0), stats
    assert stats.pool.page_bytes > 0, stats.pool  # the layout's, known without a pool
    assert stats.disk is None and stats.write_behind_queue == 0, stats


def _untouched(stats: CacheStatistics) -> None:
    assert stats.lookups == 0 and stats.miss_tokens == 0 and stats.pages_stored == 0, stats
    assert sum(stats.bytes_moved.values()) == 0 and sum(stats.hit_tokens.values()) == 0, stats


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "step"), STEPS)
async def test_stats_answer_after_a_start_cancelled_at_each_step_and_closed(
    kind: str, step: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _cache(kind, tmp_path)
    hold = _hold(step, monkeypatch)
    starting: asyncio.Task[Any] = asyncio.ensure_future(cache.start())
    try:
        await hold.wait_entered()
        held = cache.stats()  # while the start is held there
        _untouched(held)
        if step == "pool":
            _no_pool(held)
        else:
            assert held.pool.name and held.pool.pages.capacity > 0, held.pool
    finally:
        starting.cancel()  # (also where the test failed: nothing it started outlives it)
        hold.release()
        (outcome,) = await asyncio.gather(starting, return_exceptions=True)
        await asyncio.wait_for(cache.aclose(), 30)
    assert isinstance(outcome, asyncio.CancelledError), repr(outcome)
    stats = cache.stats()  # raised "the cache is not started" where the pool never opened
    _untouched(stats)
    assert stats.background_jobs == 0, stats
    if step == "pool":
        _no_pool(stats)
    else:
        assert stats.pool.name and stats.pool.pages.capacity > 0, stats.pool
    with pytest.raises(RuntimeError):
        await cache.start()  # closed is final; stats still answer after it
    assert cache.stats().lookups == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_stats_answer_before_a_start_and_after_a_close_that_never_started(kind: str, tmp_path: Path) -> None:
    cache = _cache(kind, tmp_path)
    before = cache.stats()
    _untouched(before)
    _no_pool(before)
    assert before.background_jobs == 0 and dict(before.errors) == {}, before
    await cache.aclose()
    _no_pool(cache.stats())


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_stats_answer_after_a_normal_close(kind: str, tmp_path: Path) -> None:
    cache = _cache(kind, tmp_path)
    async with cache:
        opened = cache.stats()
    closed = cache.stats()
    assert closed.pool.name == opened.pool.name != "", (opened.pool, closed.pool)
    assert closed.pool.pages.capacity == opened.pool.pages.capacity > 0
    assert closed.disk is not None
