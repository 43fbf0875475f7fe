"""Adversarial (helper-228): the read marks are tier-wide; a read of a file unlinked from outside
must not read as an eviction because another read met *its* page evicted meanwhile.

The cache's ``_evicted_since`` (35fe3e7) answers GONE when ``reads_evicted`` grew over a read and
no fault was counted. A file unlinked from outside while its page is indexed counts no fault in the
tier, so beside any read of another page that met its page evicted (or deleted) by the tier in the
same window, the unlinked read was taken for an eviction: no ``disk_read_failed``. The same for two
reads of one outside-unlinked key (the first forgets the key, the second finds it out of the index)
and for the reads of a fan-out directory removed from outside and made again by a write meanwhile.

Everything real: page files on disk, ``os.unlink``/``rm -rf`` of the tier's own paths, a real
eviction by the tier's own writes (2-page budget) or a delete, the reads' loads held in front of
the backend. Every backend.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from disk_helpers import assert_clean, fill, gated_small_tier, key_of, reserve, stored_page
from follow_helpers import WRITER_TAG, follow_config, started, store_page
from load_gate import LoadGate
from loop_probes import until_thread

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.loadpath import _evicted_since, _tier_marks
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.pagefile import HEADER_BYTES

BOUND_S = 10.0


async def _store(tier: DiskTier, pool: PagePool, key: PageKey) -> None:
    handle = fill(pool, key, key[1] & 0xFFFF)
    try:
        assert await tier.write(key, handle)
    finally:
        pool.table.release(handle)
    pool.table.evict(pool.num_pages)


async def _read(tier: DiskTier, pool: PagePool, key: PageKey, tag: int) -> bool:
    into = reserve(pool, key_of(key[1] & 0xFFFF, tag=tag))
    try:
        async with asyncio.timeout(BOUND_S):
            return await tier.read(key, into)
    finally:
        pool.table.abort(into)


@pytest.mark.asyncio
@pytest.mark.parametrize("remover", ["evict", "delete"])
async def test_an_unlinked_read_beside_another_pages_eviction_is_no_eviction(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, remover: str) -> None:
    # A 2-page budget, no recycling (a recycled file is never one a read has open).
    async with gated_small_tier(disk_dir, backend, layout, pool, 2, monkeypatch, request) as (tier, gate):
        unlinked, evicted = key_of(0), key_of(1)
        await stored_page(tier, pool, 1)
        await stored_page(tier, pool, 0)
        gate.closed = True
        # Two reads, each its own group with its own marks (two prompts' loads): the evicted page's
        # read launched first, so it is the least recently used of the two.
        marks_evicted = _tier_marks(tier)
        read_evicted = asyncio.create_task(_read(tier, pool, evicted, 9))
        await until_thread(lambda: len(gate.held) == 1, "the first read's load")
        marks_unlinked = _tier_marks(tier)
        read_unlinked = asyncio.create_task(_read(tier, pool, unlinked, 10))
        await until_thread(lambda: len(gate.held) == 2, "the second read's load")
        os.unlink(tier.files.path(unlinked))  # from outside: still indexed
        # The eviction's unlink is a task of its own that the write does not wait for: one that
        # lands after the held read opened the file lets the read succeed (the page's own bytes,
        # checked), and the eviction is not what this test examines. A full run had it so once;
        # a few loop turns' delay before each unlink makes that order certain (the wait below
        # then lets the read go only once the file is gone).
        io = tier._io
        assert io is not None
        really_unlink = io.unlink

        async def late_unlink(dir_fd: int, name: str) -> None:
            for _ in range(20):
                await asyncio.sleep(0)
            await really_unlink(dir_fd, name)

        monkeypatch.setattr(io, "unlink", late_unlink)
        if remover == "evict":
            await stored_page(tier, pool, 2)  # the budget: the tier evicts the LRU page, `evicted`
        else:
            await tier.delete(evicted)  # (it waits for its unlink)
        assert not tier.contains(evicted) and tier.contains(unlinked)
        await until_thread(lambda: not os.path.lexists(tier.files.path(evicted)), "the evicted page's unlink")
        gate.open()
        async with asyncio.timeout(BOUND_S):
            assert not await read_evicted
            assert not await read_unlinked
        # The tier counts its own removal an evicted read, the outside unlink not.
        now = tier.read_marks()
        assert (now.reads_evicted - marks_evicted.reads_evicted,
                now.reads_unlinked - marks_evicted.reads_unlinked) == (1, 1), now
        # The outside unlink: a fault for the cache, never GONE. (The evicted read's window saw the
        # unlinked one too: counted failed as well, the safe side; the read says only False.)
        assert not _evicted_since(tier, marks_unlinked), (
            "an outside unlink read as an eviction of the tier", marks_unlinked, tier.read_marks())
        assert not tier.contains(unlinked)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_two_reads_of_one_unlinked_key_are_no_eviction(tier: DiskTier, pool: PagePool,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             request: pytest.FixtureRequest) -> None:
    """The first read's ENOENT forgets the key; the second then finds it out of the index, which
    the tier did not evict: the cache counts both failed, neither GONE."""
    await stored_page(tier, pool, 0)
    gate = LoadGate(tier, monkeypatch, request)
    marks = _tier_marks(tier)
    reads = [asyncio.create_task(_read(tier, pool, key_of(0), 9 + i)) for i in range(2)]
    try:
        await until_thread(lambda: len(gate.held) == 2, "the reads' loads")
        os.unlink(tier.files.path(key_of(0)))
    finally:
        gate.open()
    async with asyncio.timeout(BOUND_S):
        assert await asyncio.gather(*reads) == [False, False]
    # (The second read finds the key out of the index, dropped by the first: the tier counts it
    # ``reads_evicted``; the first's ``reads_unlinked`` in the same window keeps both failed.)
    assert tier.read_marks().reads_unlinked > marks.reads_unlinked, tier.read_marks()
    assert not _evicted_since(tier, marks), (marks, tier.read_marks())
    assert not tier.contains(key_of(0))
    assert_clean(pool)


@pytest.mark.asyncio
async def test_reads_of_a_fan_out_removed_and_made_again_are_no_eviction(
        tier: DiskTier, pool: PagePool, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """``rm -rf`` of a fan-out directory under two held reads; the first read's ENOENT retires it,
    then a write of a third key of that directory makes it again before the second read opens:
    the second page left the index with the retired directory, not by an eviction."""
    tag = 0x3B
    keys = [key_of(i, tag) for i in range(2)]
    for key in keys:
        await _store(tier, pool, key)
    gate = LoadGate(tier, monkeypatch, request)
    marks = _tier_marks(tier)
    reads = [asyncio.create_task(_read(tier, pool, key, 9)) for key in keys]
    try:
        await until_thread(lambda: len(gate.held) == 2, "the reads' loads")
        shutil.rmtree(tier.files.layout_dir / f"{tag:02x}")  # from outside: `rm -rf 3b`
        first, second = gate.held
        gate.held = [second]
        gate.closed = False
        gate.load(*first)
        async with asyncio.timeout(BOUND_S):
            assert not await reads[0]
        assert not any(tier.contains(k) for k in keys)  # the directory retired, its pages dropped
        gate.closed = True
        await _store(tier, pool, key_of(2, tag))  # makes the fan-out directory again
        assert tier.contains(key_of(2, tag))
    finally:
        gate.open()
    async with asyncio.timeout(BOUND_S):
        assert not await reads[1]
    assert tier.read_marks().reads_unlinked > marks.reads_unlinked, tier.read_marks()
    assert not _evicted_since(tier, marks), (marks, tier.read_marks())
    assert tier.contains(key_of(2, tag)) and not any(tier.contains(k) for k in keys)
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("remover", ["evict", "delete"])
async def test_a_followers_read_of_a_page_its_writer_removed_is_an_eviction(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, remover: str) -> None:
    """A follower (``ReadOnly.LOCKED``) indexed a page its writer then evicted (2-page budget) or
    deleted: the follower's read meets ENOENT with the page still in its index. docs/storage.md:
    "evicted pages misses, no fault"; the cache counted it ``disk_read_failed`` (a fault)."""
    capacity = 2 * (HEADER_BYTES + layout.page_bytes)
    cfg = follow_config(disk_dir, backend, capacity, recycle_files=False)
    async with started(DiskTier(cfg, layout, pool)) as writer:
        for i in range(2):
            assert await store_page(writer, pool, i)
        async with started(DiskTier(cfg, layout, pool)) as follower:
            assert follower.read_only is ReadOnly.LOCKED
            key = key_of(0, WRITER_TAG)
            assert follower.contains(key)
            if remover == "evict":
                assert await store_page(writer, pool, 2)  # the writer's budget: page 0 evicted
                await until_thread(lambda: not os.path.exists(writer.files.path(key)), "the eviction's unlink")
            else:
                await writer.delete(key)
            assert not os.path.exists(writer.files.path(key)) and follower.contains(key)  # noqa: ASYNC240
            marks = _tier_marks(follower)
            assert not await _read(follower, pool, key, 9)
            assert _evicted_since(follower, marks), (marks, follower.read_marks())
            assert follower.read_marks().faults == marks.faults
            assert not follower.contains(key)
            got = await _read(follower, pool, key_of(1, WRITER_TAG), 10)  # the other page still served
            assert got
    assert_clean(pool)
