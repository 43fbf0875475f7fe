"""Adversarial (helper-222): a page file gone under a read, told apart by who removed it.

A read whose open meets ENOENT dropped the page from the index and counted nothing, whoever had
removed the file. Two different things look alike there:

- the tier itself took the page out of its index under the read (evicted for room, deleted): a
  plain miss, now counted ``ReadMarks.reads_evicted`` (the cache's ``NoPage.GONE``);
- the page is still indexed: its file was unlinked by someone else (another process, an operator,
  a bad clean-up). A miss, the page out of the index (it can never be read again), and no
  ``reads_evicted``: the cache counts it ``disk_read_failed``. (The cache's mark was the tier's
  ``evictions``, so beside any eviction it read as one: review 222.)

``DiskTier.read_marks()`` (the counters the cache takes around each read group) equals the
statistics' fields after real reads, faults and evictions.

Everything real: page files on disk, ``os.unlink`` of a page's own path, a capacity-driven eviction
by the tier's own writes while the read's load is held in front of the backend. Every backend.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import torch
from disk_helpers import (
    assert_clean,
    fill,
    gated_small_tier,
    key_of,
    payload,
    read_page,
    reserve,
    small_tier,
    stored_page,
)
from load_gate import LoadGate, flip_payload
from loop_probes import until_thread

from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.config import DiskStatistics
from aiokv.storage.disk import ReadMarks

BOUND_S = 10.0


def _faults(stats: DiskStatistics) -> int:
    return stats.corrupt + stats.follow_raced + sum(stats.errors.values())


def _assert_marks_match(tier: DiskTier) -> ReadMarks:
    marks = tier.read_marks()
    stats = tier.statistics()
    assert (marks.evictions, marks.faults) == (stats.evictions, _faults(stats)), (marks, stats)
    return marks


async def _ended(read: asyncio.Task[list[bool]], pool: PagePool, into: list[PageHandle]) -> list[bool]:
    """What a held batch read answered once let go (bounded), its pages aborted."""
    async with asyncio.timeout(BOUND_S):
        oks = await read
    for handle in into:
        pool.table.abort(handle)
    return oks


@pytest.mark.asyncio
async def test_a_file_unlinked_from_outside_while_indexed_is_a_miss_not_an_eviction(tier: DiskTier,
                                                                                  pool: PagePool) -> None:
    want = [await stored_page(tier, pool, i) for i in range(3)]
    os.unlink(tier.files.path(key_of(1)))  # behind the tier's back: still indexed
    assert tier.contains(key_of(1))
    before = tier.read_marks()
    assert await read_page(tier, pool, 1) is None  # a miss, never bytes
    marks = _assert_marks_match(tier)
    # Not a read that met its page evicted by the tier (the cache counts it a failed read).
    assert (marks.reads_evicted, marks.evictions) == (0, 0), marks
    assert marks.faults == before.faults, marks  # (the tier counts no fault of its own: see the docs)
    assert not tier.contains(key_of(1))  # never readable again: out of the index
    # Read again: a plain miss at once (not indexed), no second fault.
    assert await read_page(tier, pool, 1) is None
    assert tier.read_marks().faults == marks.faults
    # The other pages are served, bit-exact.
    for i in (0, 2):
        got = await read_page(tier, pool, i)
        assert got is not None and torch.equal(got, want[i]), i
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_batch_with_files_unlinked_from_outside_serves_the_rest(tier: DiskTier, pool: PagePool) -> None:
    want = [await stored_page(tier, pool, i) for i in range(4)]
    for i in (1, 3):
        os.unlink(tier.files.path(key_of(i)))
    into = [reserve(pool, key_of(100 + i, tag=9)) for i in range(4)]
    async with asyncio.timeout(BOUND_S):
        oks = await tier.read_many([key_of(i) for i in range(4)], into)
    assert oks == [True, False, True, False]
    for i, handle in enumerate(into):
        if oks[i]:
            assert torch.equal(payload(pool, handle), want[i]), i
        pool.table.abort(handle)
    marks = _assert_marks_match(tier)
    assert (marks.reads_evicted, marks.evictions) == (0, 0), marks
    assert [tier.contains(key_of(i)) for i in range(4)] == [True, False, True, False]
    assert_clean(pool)


@pytest.mark.asyncio
async def test_pages_the_tier_evicts_under_a_held_read_are_no_fault(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    async with gated_small_tier(disk_dir, backend, layout, pool, 2, monkeypatch, request) as (tier, gate):
        for i in range(2):
            await stored_page(tier, pool, i)
        gate.closed = True
        keys = [key_of(0), key_of(1)]
        into = [reserve(pool, key_of(i, tag=9)) for i in range(2)]
        read = asyncio.create_task(tier.read_many(keys, into))
        await until_thread(lambda: len(gate.held) == 2, "the reads' loads")
        # Two more pages into the 2-page budget: the tier evicts both read ones (a read keeps its
        # file from being recycled, not from being evicted) and unlinks their files (review 214).
        for i in (2, 3):
            await stored_page(tier, pool, i)
        assert not any(tier.contains(k) for k in keys)
        paths = [tier.files.path(k) for k in keys]
        await until_thread(lambda: not any(os.path.exists(p) for p in paths), "the evicted files' unlinks")
        gate.open()
        assert await _ended(read, pool, into) == [False, False]
        marks = _assert_marks_match(tier)
        assert marks.evictions >= 2 and marks.reads_evicted == 2, marks
        assert marks.faults == 0, tier.statistics().errors  # not a fault: the tier removed them
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_page_deleted_under_a_held_read_is_no_fault(tier: DiskTier, pool: PagePool,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           request: pytest.FixtureRequest) -> None:
    await stored_page(tier, pool, 0)
    gate = LoadGate(tier, monkeypatch, request)
    into = reserve(pool, key_of(0, tag=9))
    read = asyncio.create_task(tier.read(key_of(0), into))
    try:
        await until_thread(lambda: len(gate.held) == 1, "the read's load")
        await tier.delete(key_of(0))  # out of the index, its file unlinked (the delete awaits it)
        assert not os.path.exists(tier.files.path(key_of(0)))  # noqa: ASYNC240 (a stat, in a test)
    finally:
        gate.open()  # a failed check must not leave the close waiting for a held load
    async with asyncio.timeout(BOUND_S):
        assert not await read
    pool.table.abort(into)
    marks = _assert_marks_match(tier)
    assert (marks.reads_evicted, marks.faults) == (1, 0), (marks, tier.statistics().errors)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_read_marks_equal_the_statistics_after_reads_and_faults(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    tier = small_tier(disk_dir, backend, layout, pool, 4)
    await tier.start()
    try:
        assert _assert_marks_match(tier) == ReadMarks(0, 0, 0)
        for i in range(4):
            await stored_page(tier, pool, i)
        assert await read_page(tier, pool, 0) is not None
        _assert_marks_match(tier)
        flip_payload(tier.files.path(key_of(1)))  # refused (corrupt)
        assert await read_page(tier, pool, 1) is None
        os.unlink(tier.files.path(key_of(2)))
        assert await read_page(tier, pool, 2) is None
        for i in (4, 5, 6):  # the 4-page budget: evictions
            await stored_page(tier, pool, i)
        marks = _assert_marks_match(tier)
        stats = tier.statistics()
        assert stats.corrupt == 1 and marks.faults == 1, stats
        assert marks.evictions >= 1 and marks.reads_evicted == 0, marks
    finally:
        await tier.aclose()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_reads_of_a_fan_out_directory_removed_from_outside_are_no_evictions(
        tier: DiskTier, pool: PagePool, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """``rm -rf`` of a fan-out directory under two held reads: the first ENOENT retires the
    directory (its pages leave the index), the second finds its page out of the index already,
    but the tier did not evict it: neither read is ``reads_evicted``."""
    tag = 0x3A
    keys = [key_of(i, tag) for i in range(2)]
    for key in keys:
        handle = fill(pool, key, 7)
        try:
            assert await tier.write(key, handle)
        finally:
            pool.table.release(handle)
        pool.table.evict(pool.num_pages)
    gate = LoadGate(tier, monkeypatch, request)
    into = [reserve(pool, key_of(i, tag=9)) for i in range(2)]
    read = asyncio.create_task(tier.read_many(keys, into))
    try:
        await until_thread(lambda: len(gate.held) == 2, "the reads' loads")
        shutil.rmtree(tier.files.layout_dir / f"{tag:02x}")  # from outside: `rm -rf 3a`
    finally:
        gate.open()
    assert await _ended(read, pool, into) == [False, False]
    marks = _assert_marks_match(tier)
    assert marks.reads_evicted == 0, marks
    assert not any(tier.contains(k) for k in keys)
    assert_clean(pool)
