"""Recycling against the reads and writes around it: a read waiting for an I/O slot keeps its file
from being overwritten, and a recycle that fails never unlinks the file a new write of the
victim's key put under that name."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, fill, gated, key_of, payload, reserve, spin

from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
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


def _regular_file(path: str) -> bool:
    return stat.S_ISREG(os.lstat(path).st_mode)


def _exists(path: str) -> bool:
    return os.path.lexists(path)


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


@pytest.mark.asyncio
async def test_a_failed_recycle_never_unlinks_a_new_file_of_the_victims_key(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: a recycle whose victim's name was refused (here a planted symlink) woke a waiting
    # writer of the victim's key before it registered the unlink of that name, and the writer did
    # not look again: its new file could land under the name first and then be unlinked (stored,
    # indexed, and gone: a miss). The unlink is held until the writer either published (the old
    # order) or is seen waiting for it, so the test fails on the old code whatever the timing.
    async with DiskTier(config(disk_dir, backend, 2 * file_bytes(layout)), layout, pool) as tier:
        await _store(tier, pool, 1, 1)
        await _store(tier, pool, 2, 2)
        victim = tier.files.path(key_of(1))
        os.unlink(victim)
        os.symlink(tmp_path / "elsewhere", victim)
        gate, entered = asyncio.Event(), asyncio.Event()
        monkeypatch.setattr(tier.backend, "start_recycle", gated(tier.backend.start_recycle, gate, entered))
        real_unlink = tier.backend.unlink
        new_file_first: list[bool] = []  # per unlink of key 1's name: was a new file of key 1 indexed?
        unlinked = asyncio.Event()

        async def unlink(dir_fd: int, name: str) -> None:
            if not name.endswith(key_of(1).hex()):
                await real_unlink(dir_fd, name)
                return
            await spin(10)  # a writer woken by the failed recycle has claimed its room by now
            writer = tier._writing.get(key_of(1))
            if writer is not None and writer.holds_room:  # it did not wait for this unlink
                await writer.wait_ended()
            new_file_first.append(tier.contains(key_of(1)))
            try:
                await real_unlink(dir_fd, name)
            finally:
                unlinked.set()

        monkeypatch.setattr(tier.backend, "unlink", unlink)
        h3 = fill(pool, key_of(3), 3)
        third = asyncio.create_task(tier.write(key_of(3), h3))  # recycles key 1's name (the LRU file)
        await entered.wait()
        h1 = fill(pool, key_of(1), 11)
        fresh = payload(pool, h1)
        again = asyncio.create_task(tier.write(key_of(1), h1))  # waits until the name is free
        try:
            await spin(5)
            assert not again.done()
        finally:
            gate.set()
        assert await third
        assert await again
        pool.table.release(h3)
        pool.table.release(h1)
        await unlinked.wait()
        assert new_file_first == [False]  # the refused name was removed before the new file came, not after
        stats = tier.statistics()
        assert (stats.errors[ErrorKind.UNSAFE], stats.pages) == (1, 2), stats
        assert _regular_file(victim)
        pool.table.discard(key_of(1))
        into = reserve(pool, key_of(1))
        assert await tier.read(key_of(1), into)
        assert torch.equal(payload(pool, into), fresh)
        pool.table.abort(into)
        _settled(tier, pool)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_new_write_of_the_victims_key_waits_while_its_recycle_waits_for_a_slot(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: a recycle took its victim out of the index when it claimed room but registered
    # the rename of the victim's name only once it had an I/O slot. A new write of the victim's key
    # meanwhile published its file under that name; the recycle then overwrote and renamed it away:
    # write() said True and the index listed the key, but its file was gone (a miss).
    capacity = 3 * file_bytes(layout)
    async with DiskTier(config(disk_dir, backend, capacity, queue_depth=2), layout, pool) as tier:
        for i in (1, 2, 3):
            await _store(tier, pool, i, i)
        read_gate, read_entered = asyncio.Event(), asyncio.Event()
        recycle_gate, recycle_entered = asyncio.Event(), asyncio.Event()
        monkeypatch.setattr(tier.backend, "start_load", gated(tier.backend.start_load, read_gate, read_entered))
        monkeypatch.setattr(tier.backend, "start_recycle",
                            gated(tier.backend.start_recycle, recycle_gate, recycle_entered))
        into = {i: reserve(pool, key_of(100 + i)) for i in (2, 3)}
        h4, h1 = fill(pool, key_of(4), 4), fill(pool, key_of(1), 11)
        data4, fresh = payload(pool, h4), payload(pool, h1)
        try:
            busy = [asyncio.create_task(tier.read(key_of(i), into[i])) for i in (2, 3)]  # both slots
            await read_entered.wait()
            await spin(2)
            fourth = asyncio.create_task(tier.write(key_of(4), h4))  # recycles key 1's file; no slot yet
            await spin(5)
            assert not tier.contains(key_of(1)) and tier.statistics().evictions == 1
            again = asyncio.create_task(tier.write(key_of(1), h1))  # a new file of the victim's key
            await spin(5)
            read_gate.set()
            await asyncio.wait_for(recycle_entered.wait(), 5)  # the recycle has its slot, its I/O held
            await spin(10)
            assert not again.done()  # it waits until the recycle left key 1's name
        finally:
            read_gate.set()
            recycle_gate.set()
        for task in busy:
            assert await task
        assert await asyncio.wait_for(fourth, 5)
        assert await asyncio.wait_for(again, 5)
        for h, i in ((h1, 1), (h4, 4)):
            pool.table.release(h)
            pool.table.discard(key_of(i))
        for handle in into.values():
            pool.table.abort(handle)
        for i, expected in ((1, fresh), (4, data4)):
            check = reserve(pool, key_of(200 + i))
            assert await tier.read(key_of(i), check), i
            assert torch.equal(payload(pool, check), expected), i
            pool.table.abort(check)
        stats = tier.statistics()
        assert (stats.corrupt, stats.recycled, stats.pages) == (0, 2, 3), stats
        _settled(tier, pool)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_recycle_that_fails_by_a_bug_frees_its_victims_name(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: a recycle that raised before it freed its victim's name (here counting the refused
    # name raises) ended by the bug path, which left the name registered as moving for good: a new
    # write of the victim's key waited forever, and so did the tier's close.
    tier = DiskTier(config(disk_dir, backend, 2 * file_bytes(layout)), layout, pool)
    await tier.start()
    try:
        await _store(tier, pool, 1, 1)
        await _store(tier, pool, 2, 2)
        victim = tier.files.path(key_of(1))
        os.unlink(victim)
        os.symlink(tmp_path / "elsewhere", victim)
        real_count = tier._faults.count

        def count(exc: OSError, what: str) -> None:
            if what == "recycle":
                raise RuntimeError("injected: counting the refused name fails")
            real_count(exc, what)

        monkeypatch.setattr(tier._faults, "count", count)
        h3 = fill(pool, key_of(3), 3)
        try:
            assert not await asyncio.wait_for(tier.write(key_of(3), h3), 5)  # recycles key 1's name
        finally:
            pool.table.release(h3)
            pool.table.discard(key_of(3))
        stats = tier.statistics()
        assert (stats.errors[ErrorKind.OTHER], stats.pages) == (1, 1), stats
        h1 = fill(pool, key_of(1), 11)
        fresh = payload(pool, h1)
        try:
            assert await asyncio.wait_for(tier.write(key_of(1), h1), 5)
        finally:
            pool.table.release(h1)
            pool.table.discard(key_of(1))
        assert _regular_file(victim)  # the planted name was removed, the new file put there
        into = reserve(pool, key_of(1))
        assert await tier.read(key_of(1), into)
        assert torch.equal(payload(pool, into), fresh)
        pool.table.abort(into)
        _settled(tier, pool)
    finally:
        await asyncio.wait_for(tier.aclose(), 10)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_recycle_that_fails_by_a_bug_before_its_slot_unlinks_its_victim(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A write that fails by a bug right after choosing its victim (here removing the evicted files
    # raises) frees the victim's name and removes its file: out of the index, it would otherwise
    # stay on disk outside the budget.
    async with DiskTier(config(disk_dir, backend, 2 * file_bytes(layout)), layout, pool) as tier:
        await _store(tier, pool, 1, 1)
        await _store(tier, pool, 2, 2)
        victim = tier.files.path(key_of(1))

        def remove_files(keys: list[object]) -> list[asyncio.Task[None]]:
            raise RuntimeError("injected: removing the evicted files fails")

        monkeypatch.setattr(tier, "_remove_files", remove_files)
        h3 = fill(pool, key_of(3), 3)
        try:
            assert not await asyncio.wait_for(tier.write(key_of(3), h3), 5)
        finally:
            pool.table.release(h3)
            pool.table.discard(key_of(3))
        monkeypatch.undo()
        stats = tier.statistics()
        assert (stats.errors[ErrorKind.OTHER], stats.pages, stats.recycled) == (1, 1, 0), stats
        assert not tier.contains(key_of(1))
        if tier._jobs:  # the victim's unlink
            await asyncio.wait(set(tier._jobs), timeout=5)
        assert not tier._jobs
        assert not _exists(victim)
        h1 = fill(pool, key_of(1), 11)
        fresh = payload(pool, h1)
        try:
            assert await asyncio.wait_for(tier.write(key_of(1), h1), 5)
        finally:
            pool.table.release(h1)
            pool.table.discard(key_of(1))
        into = reserve(pool, key_of(1))
        assert await tier.read(key_of(1), into)
        assert torch.equal(payload(pool, into), fresh)
        pool.table.abort(into)
        _settled(tier, pool)
    assert_clean(pool)
