"""A read-only tier follows the cache of another process that holds its directory: that cache's new
pages become hits within a bound (bit for bit), its evicted pages plain misses; once it closes, or
is SIGKILLed mid-write, the follower takes the directory over and writes, and what it writes
survives its own restart. Before: the index found at start stayed as it was, and the follower
stayed read-only until it restarted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, fill, key_of, payload, reserve, seed_payload, temp_files
from follow_helpers import (
    WRITER_TAG,
    Looks,
    child,
    follow_config,
    follow_threads,
    receive,
    started,
    stuck_writer_child,
    writer_child,
)

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind, ReadOnly
from aiokv.storage.pagefile import HEADER_BYTES

FILES = 6  # the writer's budget, in page files
BOUND_S = 15.0
"""How long after a page is stored the follower must index it (looks every 0.2 s; a loaded host)."""


def _no_errors(tier: DiskTier) -> None:
    stats = tier.statistics()
    assert stats.corrupt == 0 and not any(stats.errors.values()), stats


async def _served(tier: DiskTier, pool: PagePool, i: int, seed: int | None = None, tag: int = WRITER_TAG) -> bool:
    """Whether ``key_of(i, tag)`` reads back bit for bit as seed ``seed`` (default ``i``); a miss: False."""
    into = reserve(pool, key_of(200 + i, 99))
    try:
        ok = await asyncio.wait_for(tier.read(key_of(i, tag), into), 10)
        got = payload(pool, into).clone() if ok else None
    finally:
        pool.table.abort(into)
    if got is None:
        return False
    assert torch.equal(got, seed_payload(pool, i if seed is None else seed, 98)), f"page {i} served other bytes"
    return True


@pytest.mark.asyncio
async def test_follower_serves_the_writers_new_pages_within_a_bound(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    with child(writer_child, str(disk_dir), backend.value, 64) as (conn, _proc):
        assert await receive(conn) == ("ready", None)  # the other process writes
        conn.send(("write", [0, 1]))
        assert await receive(conn) == ("written", [True, True])
        async with started(DiskTier(follow_config(disk_dir, backend, interval=0.2), layout, pool)) as follower:
            looks = Looks(follower)
            assert follower.read_only is ReadOnly.LOCKED
            assert follower.statistics().pages == 2
            for batch in ([2, 3, 4, 5], list(range(6, 30))):
                conn.send(("write", batch))
                assert await receive(conn) == ("written", [True] * len(batch))
                stored = time.monotonic()
                # Looks come every 0.2 s by themselves: none is asked for here.
                await looks.until(lambda b=batch: all(follower.contains(key_of(i, WRITER_TAG)) for i in b),
                                  limit_s=BOUND_S, force=False)
                assert time.monotonic() - stored < BOUND_S
                for i in batch:
                    assert await _served(follower, pool, i), i
            stats = follower.statistics()
            assert (stats.pages, stats.followed_in, stats.hits) == (30, 28, 28), stats
            assert stats.follow_looks >= 2
            _no_errors(follower)
            conn.send("close")
            assert await receive(conn) == "closed"
            conn.send("exit")
    assert await asyncio.to_thread(follow_threads) == []
    assert_clean(pool)


@pytest.mark.asyncio
async def test_follower_misses_evicted_pages_and_takes_over_when_the_writer_closes(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    capacity = FILES * (HEADER_BYTES + layout.page_bytes)
    with child(writer_child, str(disk_dir), backend.value, FILES) as (conn, _proc):
        assert await receive(conn) == ("ready", None)
        async with started(DiskTier(follow_config(disk_dir, backend, capacity), layout, pool)) as follower:
            looks = Looks(follower)
            assert follower.read_only is ReadOnly.LOCKED
            conn.send(("write", list(range(6))))
            assert await receive(conn) == ("written", [True] * 6)
            await looks.next()
            assert follower.statistics().pages == 6
            # Writes here stay refused (counted), and are not kept for later.
            h = fill(pool, key_of(50), 50)
            assert not await follower.write(key_of(50), h)
            assert not follower.write_behind_nowait(key_of(50), h)
            pool.table.release(h)
            pool.table.evict(pool.num_pages)
            assert follower.statistics().writes_refused == 2
            # The writer's budget is 6 files: 6 more pages evict (recycle) every one indexed here.
            conn.send(("write", list(range(6, 12))))
            assert await receive(conn) == ("written", [True] * 6)
            for i in range(3):  # before any look: the file is gone, a plain miss (no fault), forgotten
                assert follower.contains(key_of(i, WRITER_TAG))
                assert not await _served(follower, pool, i)
                assert not follower.contains(key_of(i, WRITER_TAG))
            _no_errors(follower)
            await looks.next()  # the rest found gone, the new ones found
            for i in range(3, 6):
                assert not follower.contains(key_of(i, WRITER_TAG))
                assert not await _served(follower, pool, i)
            for i in range(6, 12):
                assert await _served(follower, pool, i), i
            stats = follower.statistics()
            assert (stats.pages, stats.followed_in, stats.followed_out, stats.misses) == (6, 12, 3, 6), stats
            _no_errors(follower)
            # The writer closes: the follower takes the directory over at its next look.
            conn.send("close")
            assert await receive(conn) == "closed"
            await looks.next()
            stats = follower.statistics()
            assert (stats.took_over, stats.read_only, stats.pages) == (1, None, 6), stats
            assert not follower.contains(key_of(50))  # the refused write was not kept for later
            for i in range(20):  # its own writes land, within its budget (it evicts now)
                h = fill(pool, key_of(i), 1000 + i)
                assert await follower.write(key_of(i), h)
                pool.table.release(h)
                pool.table.evict(pool.num_pages)
            assert follower.statistics().pages == FILES
            _no_errors(follower)
            conn.send("exit")
    assert await asyncio.to_thread(follow_threads) == []
    # Its pages survive its restart (the last FILES written: the budget evicted the rest).
    async with started(DiskTier(follow_config(disk_dir, backend, capacity), layout, pool)) as again:
        assert again.read_only is None and again.statistics().pages == FILES
        for i in range(20 - FILES, 20):
            assert await _served(again, pool, i, 1000 + i, tag=0), i
    assert_clean(pool)


@pytest.mark.asyncio
async def test_follower_takes_over_from_a_writer_killed_mid_write(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    with child(stuck_writer_child, str(disk_dir), 5) as (conn, proc):
        for i in range(5):
            assert await receive(conn) == ("stored", i)
        async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as follower:
            looks = Looks(follower)
            assert follower.read_only is ReadOnly.LOCKED and follower.statistics().pages == 5
            assert await receive(conn) == "stuck"
            left = temp_files(disk_dir)
            assert len(left) == 4, left  # four writes in flight, their temporary files created
            await looks.next()
            assert follower.read_only is ReadOnly.LOCKED  # still held: nothing changes
            assert temp_files(disk_dir) == left
            proc.kill()  # SIGKILL, mid-write
            await asyncio.to_thread(proc.join, 30)
            await looks.until(lambda: follower.read_only is None)
            stats = follower.statistics()
            assert (stats.took_over, stats.temp_files_removed, stats.pages) == (1, 4, 5), stats
            assert temp_files(disk_dir) == []
            for i in range(5):
                assert await _served(follower, pool, i), i
            for i in range(4):
                h = fill(pool, key_of(i), 2000 + i)
                assert await follower.write(key_of(i), h)
                pool.table.release(h)
                pool.table.evict(pool.num_pages)
            _no_errors(follower)
    async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as again:
        assert again.read_only is None and again.statistics().pages == 9
        assert again.statistics().temp_files_removed == 0
        for i in range(4):
            assert await _served(again, pool, i, 2000 + i, tag=0), i
        for i in range(5):
            assert await _served(again, pool, i), i
        _no_errors(again)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_follow_interval_zero_keeps_the_start_index(disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    backend = DiskBackend.THREADS
    with child(writer_child, str(disk_dir), backend.value, FILES) as (conn, _proc):
        assert await receive(conn) == ("ready", None)
        async with started(DiskTier(follow_config(disk_dir, backend, interval=0), layout, pool)) as frozen:
            assert frozen.read_only is ReadOnly.LOCKED and frozen._follow_task is None
            conn.send(("write", [0]))
            assert await receive(conn) == ("written", [True])
            conn.send("close")
            assert await receive(conn) == "closed"
            frozen._look_soon()  # nothing to wake
            await asyncio.sleep(0)
            stats = frozen.statistics()
            assert (stats.pages, stats.read_only, stats.follow_looks) == (0, ReadOnly.LOCKED, 0)
            assert stats.errors[ErrorKind.OTHER] == 0
            conn.send("exit")
    assert_clean(pool)
