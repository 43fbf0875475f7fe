"""Recycling against the reads around it: a read waiting for an I/O slot keeps its file from being
overwritten."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, fill, gated, key_of, payload, reserve, spin

from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.pagefile import file_bytes


async def _store(tier: DiskTier, pool: PagePool, i: int, seed: int) -> torch.Tensor:
    """Write page ``i`` (content from ``seed``); the pool forgets it (a later fill may reserve it)."""
    h = fill(pool, key_of(i), seed)
    data = payload(pool, h)
    try:
        assert await tier.write(key_of(i), h)
    finally:
        pool.table.release(h)
        pool.table.discard(key_of(i))
    return data


def _settled(tier: DiskTier, pool: PagePool) -> None:
    stats = tier.statistics()
    assert stats.in_flight == 0, stats
    assert not tier._index.readers  # every read uncounted its file, whichever way it ended
    assert_clean(pool)


async def _fill_slots_and_queue_a_read(tier: DiskTier, pool: PagePool, monkeypatch: pytest.MonkeyPatch,
                                       gate: asyncio.Event) -> tuple[list[asyncio.Task[bool]], asyncio.Task[bool],
                                                                     dict[int, PageHandle]]:
    """Reads of keys 2 and 3 hold both I/O slots (their loads held at ``gate``); a read of key 1
    waits for a slot. The index then holds 2, 3, 1 (least recently used first), all being read."""
    entered = asyncio.Event()
    monkeypatch.setattr(tier.backend, "start_load", gated(tier.backend.start_load, gate, entered))
    into = {i: reserve(pool, key_of(100 + i)) for i in (1, 2, 3)}
    busy = [asyncio.create_task(tier.read(key_of(i), into[i])) for i in (2, 3)]
    await entered.wait()
    await spin(2)
    assert tier.statistics().in_flight == 2
    waiting = asyncio.create_task(tier.read(key_of(1), into[1]))
    await spin(2)
    assert not waiting.done() and tier.statistics().in_flight == 2
    return busy, waiting, into


@pytest.mark.asyncio
async def test_a_read_waiting_for_a_slot_keeps_its_file_from_recycling(disk_dir: Path, backend: DiskBackend,
                                                                       layout: KVLayout, pool: PagePool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: a read counted itself a reader of its file only once it had a slot, so a write
    # into a full tier took the file of a read still queued as its recycling victim; once the
    # slots freed, the read could overlap the overwrite (a torn or foreign header: counted
    # corrupt, a miss). Room for three files, two slots, all three files being read.
    capacity = 3 * file_bytes(layout)
    async with DiskTier(config(disk_dir, backend, capacity, queue_depth=2), layout, pool) as tier:
        data = {i: await _store(tier, pool, i, i) for i in (1, 2, 3)}
        gate = asyncio.Event()
        busy, waiting, into = await _fill_slots_and_queue_a_read(tier, pool, monkeypatch, gate)
        h = fill(pool, key_of(4), 4)
        written = payload(pool, h)
        writing = asyncio.create_task(tier.write(key_of(4), h))
        try:
            await spin(5)  # hashed, room claimed (no slot yet)
            assert tier.statistics().evictions == 1
            # Key 1's file is not recycled: its read is queued. Key 2's (least recently used) goes.
            assert tier.contains(key_of(1))
            assert not tier.contains(key_of(2))
        finally:
            gate.set()  # (a failure above must not leave the tier's close waiting for the loads)
        assert await waiting
        assert torch.equal(payload(pool, into[1]), data[1])
        assert await busy[1]
        assert torch.equal(payload(pool, into[3]), data[3])
        await busy[0]  # key 2's file was unlinked meanwhile (or not yet): a miss or a hit
        assert await writing
        pool.table.release(h)
        stats = tier.statistics()
        assert (stats.corrupt, stats.recycled, stats.pages) == (0, 0, 3), stats
        for handle in into.values():
            pool.table.abort(handle)
        check = reserve(pool, key_of(104))
        assert await tier.read(key_of(4), check)
        assert torch.equal(payload(pool, check), written)
        pool.table.abort(check)
        _settled(tier, pool)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_read_cancelled_while_waiting_for_a_slot_leaves_its_file_recyclable(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The queued read's count goes when it leaves the queue: its file is the victim again.
    capacity = 3 * file_bytes(layout)
    async with DiskTier(config(disk_dir, backend, capacity, queue_depth=2), layout, pool) as tier:
        data = {i: await _store(tier, pool, i, i) for i in (1, 2, 3)}
        gate = asyncio.Event()
        busy, waiting, into = await _fill_slots_and_queue_a_read(tier, pool, monkeypatch, gate)
        h = fill(pool, key_of(4), 4)
        try:
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting  # nothing was read into its page: it ends at once
            assert tier.statistics().in_flight == 2
            writing = asyncio.create_task(tier.write(key_of(4), h))
            await spin(5)
            assert not tier.contains(key_of(1))  # the least recently used file no read needs
            assert tier.contains(key_of(2)) and tier.contains(key_of(3))
        finally:
            gate.set()
        for i, task in zip((2, 3), busy, strict=True):
            assert await task
            assert torch.equal(payload(pool, into[i]), data[i])
        assert await writing
        pool.table.release(h)
        stats = tier.statistics()
        assert (stats.corrupt, stats.recycled, stats.pages) == (0, 1, 3), stats
        for handle in into.values():
            pool.table.abort(handle)
        _settled(tier, pool)
    assert_clean(pool)
