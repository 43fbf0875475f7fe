"""`IOSlots` hands a slot on without nesting: many waiters whose start fails at once (a closed
engine) all end and every slot comes back, with a flat stack; a job leaving the queue leaves it,
whatever slot it held before."""

from __future__ import annotations

import asyncio
import errno
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config, fill, gated, key_of, spin

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import IOOp
from aiokv.storage.jobs import IOSlots, Job, WriteJob
from aiokv.storage.pagefile import file_bytes

WAITERS = 5 * sys.getrecursionlimit()
"""More waiters than the stack allows nested hand-offs."""


@pytest.mark.asyncio
@pytest.mark.parametrize("count", [1, 3])
async def test_failing_waiters_all_end_and_slots_return(count: int) -> None:
    slots = IOSlots(count)
    depth = [0, 0]  # now, deepest
    ended: list[Job] = []

    def start(job: Job, _slot: int) -> None:
        # As a page job whose backend call raises synchronously: its except gives the slot back.
        depth[0] += 1
        depth[1] = max(depth[1], depth[0])
        try:
            raise OSError("engine closed")
        except OSError:
            slots.give_back(job)
            job.end()
            ended.append(job)
        finally:
            depth[0] -= 1

    holders = [Job() for _ in range(count)]
    for holder in holders:
        slots.take(holder, lambda _job, _slot: None)
    waiters = [Job() for _ in range(WAITERS)]
    for job in waiters:
        slots.take(job, start)
    assert slots.in_use == count and not ended
    for holder in holders:
        slots.give_back(holder)
    # The hand-off starts waiters for at most jobs.START_TURN_S per turn of the loop: the rest in
    # the turns after (#14), each turn's starts run from a flat loop too.
    for _ in range(WAITERS):
        if len(ended) == WAITERS:
            break
        await asyncio.sleep(0)
    assert len(ended) == WAITERS and all(job.ended and not job.holds_slot for job in waiters)
    assert depth[1] == 1  # each start ran from the hand-off loop, none nested in another
    assert slots.in_use == 0
    await asyncio.sleep(0)  # a fresh turn: its start budget unspent
    # Every slot is free again: new jobs get one at once.
    got: list[int] = []
    for _ in range(count):
        slots.take(Job(), lambda _job, slot: got.append(slot))
    assert sorted(got) == list(range(count))


@pytest.mark.asyncio
async def test_bug_while_queued_after_an_enospc_retry_leaves_the_queue(disk_dir: Path, backend: DiskBackend,
                                                                       layout: KVLayout, pool: PagePool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: a write that met ENOSPC (injected into its WRITE) gave its slot back and kept
    # the slot's number; queued again for a slot on its retry, ``IOSlots.leave`` took that number
    # for "holds a slot" and left it in the queue when it ended on a bug. The next slot given back
    # went to the ended job: it wrote and indexed its page after reporting False, and ended twice.
    # Bounded: without the fix the ended job ends twice and the tier's close never sees it idle.
    async with asyncio.timeout(60), DiskTier(config(disk_dir, backend, queue_depth=1), layout, pool) as tier:
        handles = {i: fill(pool, key_of(i), i) for i in (1, 2, 3, 4)}
        assert await tier.write(key_of(1), handles[1])
        assert await tier.write(key_of(2), handles[2])
        tier.backend.faults.inject(IOOp.WRITE, errno.ENOSPC)
        retry_gate, retrying = asyncio.Event(), asyncio.Event()
        real_refresh = tier._refresh_space

        async def refresh(after_enospc: bool) -> None:
            retrying.set()
            await retry_gate.wait()  # the retry waits here: meanwhile another write takes the slot
            await real_refresh(after_enospc)

        monkeypatch.setattr(tier, "_refresh_space", refresh)
        first = asyncio.ensure_future(tier.write(key_of(3), handles[3]))
        await retrying.wait()
        gate, entered = asyncio.Event(), asyncio.Event()
        monkeypatch.setattr(tier.backend, "start_publish", gated(tier.backend.start_publish, gate, entered))
        second = asyncio.ensure_future(tier.write(key_of(4), handles[4]))
        await entered.wait()  # the second write holds the only slot
        real_take = tier._io_slots.take

        def take(job: Job, then: Any) -> None:
            real_take(job, then)  # queued: the slot is busy
            if isinstance(job, WriteJob) and job.attempt:
                raise RuntimeError("injected bug")

        monkeypatch.setattr(tier._io_slots, "take", take)
        retry_gate.set()
        assert not await first  # ended on the bug while queued
        assert tier._io_slots.waiting == 0  # it left the queue
        gate.set()
        assert await second
        await tier.flush()
        await spin(20)
        stats = tier.statistics()
        assert not tier.contains(key_of(3))
        assert not await asyncio.to_thread(os.path.lexists, tier.files.path(key_of(3)))
        assert (stats.in_flight, tier._active) == (0, 0)
        assert stats.bytes_stored == stats.pages * file_bytes(layout)
        for h in handles.values():
            pool.table.release(h)
    assert_clean(pool)
