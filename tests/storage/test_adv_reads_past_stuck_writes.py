"""Reads never wait behind writes hung in the kernel (a frozen file system), however many
write-behind workers there are.

Reads and writes took turns on :class:`~aiokv.storage.jobs.IOSlots`' one FIFO queue: with
``write_behind_workers >= queue_depth`` the page-file writes a freeze blocks held every slot, and a
read of a page already on disk (a frozen file system still serves reads) waited until the thaw.
Writes now hold at most ``write_limit`` slots; the rest are the reads'. A watchdog thaws after
THAW_S so nothing stays stuck when the check fails. The frozen-disk test is root only.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from disk_helpers import BIG, assert_clean, config, fill, key_of, payload, ready_pool, reserve, write_page
from fs_helpers import freeze, loop_ext4, thaw

from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage import jobs as jobs_module
from aiokv.storage.jobs import IOSlots, Job, ReadJob, WriteJob, reserved_for_reads

THAW_S = 20.0
READ_BOUND_S = 2.0
QUEUE_DEPTH = 4
WRITES = 8  # write-behind workers, and pages written behind: twice the queue depth



def _write(i: int) -> WriteJob:
    return WriteJob(key_of(i), None, None)


def _read(i: int) -> ReadJob:
    loop = asyncio.get_running_loop()
    return ReadJob(key_of(i), None, 0, loop.create_future())  # type: ignore[arg-type]  # never started


@pytest.mark.parametrize(("count", "reserved"), [(1, 0), (2, 1), (8, 1), (16, 2), (64, 8)])
def test_reads_keep_a_share_of_the_slots(count: int, reserved: int) -> None:
    assert reserved_for_reads(count) == reserved
    assert IOSlots(count).write_limit == count - reserved


@pytest.mark.asyncio
async def test_writes_never_hold_the_reads_share_and_the_counts_stay_true(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs_module, "START_TURN_S", 60.0)  # every start at once: no turn budget here
    slots = IOSlots(QUEUE_DEPTH)
    limit = slots.write_limit
    started: list[Job] = []

    def start(job: Job, _slot: int) -> None:
        started.append(job)

    writes = [_write(i) for i in range(WRITES)]
    for job in writes:
        slots.take(job, start)
    assert started == writes[:limit]
    assert (slots.in_use, slots.writes_in_use, slots.waiting) == (limit, limit, WRITES - limit)
    reads = [_read(100 + i) for i in range(QUEUE_DEPTH)]
    for job in reads:
        slots.take(job, start)
    # The reserved slots go to reads past every queued write; the other reads wait for a slot.
    free = QUEUE_DEPTH - limit
    assert started == writes[:limit] + reads[:free]
    assert (slots.in_use, slots.writes_in_use) == (QUEUE_DEPTH, limit)
    # A write's slot goes to the older waiter that may take it: the queued writes came first.
    slots.give_back(writes[0])
    assert started[-1] is writes[limit]
    assert (slots.in_use, slots.writes_in_use) == (QUEUE_DEPTH, limit)
    # A read's slot goes to the next read while writes are at their limit.
    slots.give_back(reads[0])
    assert started[-1] is reads[free]
    assert slots.leave(reads[free + 1]) and not slots.leave(reads[free + 1])
    while any(job.holds_slot for job in started):  # each slot given back goes on to a waiter
        for job in [job for job in started if job.holds_slot]:
            slots.give_back(job)
            slots.give_back(job)  # idempotent
    assert (slots.in_use, slots.writes_in_use, slots.waiting) == (0, 0, 0)
    assert [job for job in writes + reads if job not in started] == [reads[free + 1]]


def _count_write_takes(tier: DiskTier, want: int) -> asyncio.Event:
    """An event set once ``want`` writes asked ``tier`` for an I/O slot (started or queued)."""
    real: Callable[[Job, Callable[[Job, int], None]], None] = tier._io_slots.take
    asked = asyncio.Event()
    seen = [0]

    def take(job: Job, then: Callable[[Job, int], None]) -> None:
        real(job, then)
        if isinstance(job, WriteJob):
            seen[0] += 1
            if seen[0] >= want:
                asked.set()

    tier._io_slots.take = take  # type: ignore[method-assign]
    return asked


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_read_completes_while_writes_hang_on_a_frozen_disk_with_workers_past_the_queue_depth(
        tmp_path: Path, backend: DiskBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    # Every start at once (no turn budget): once all writes asked for a slot, the slots writes may
    # take are all held, deterministically.
    monkeypatch.setattr(jobs_module, "START_TURN_S", 60.0)
    with ready_pool(BIG, WRITES + 2) as pool, loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, queue_depth=QUEUE_DEPTH, write_behind_workers=WRITES,
                     write_behind_depth=2 * WRITES, min_free_bytes=0)
        tier = DiskTier(cfg, BIG, pool)
        await tier.start()
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        try:
            ok, want = await write_page(tier, pool, 0)  # on disk before the freeze
            assert ok
            asked = _count_write_takes(tier, WRITES)
            freeze(mount)
            watchdog.start()
            for i in range(1, WRITES + 1):
                assert tier.write_behind_nowait(key_of(i), fill(pool, key_of(i), i))  # the tier's reference
            async with asyncio.timeout(READ_BOUND_S):
                await asyncio.shield(asyncio.ensure_future(asked.wait()))
            stats = tier.statistics()
            assert stats.in_flight >= tier._io_slots.write_limit, stats  # the writes hold their slots
            into = reserve(pool, key_of(0))
            began = time.perf_counter()
            try:
                async with asyncio.timeout(READ_BOUND_S):
                    got = await tier.read(key_of(0), into)
            except TimeoutError:
                pytest.fail(f"a read waited over {READ_BOUND_S} s behind writes blocked by the freeze "
                            f"(in flight: {tier.statistics().in_flight} of {QUEUE_DEPTH} slots)")
            took = time.perf_counter() - began
            assert got, f"the read failed after {took:.2f} s"
            assert torch.equal(payload(pool, into), want)
            pool.table.abort(into)
            stats = tier.statistics()
            # Still true while the writes hang: only they hold slots, the read's went back.
            assert stats.in_flight == tier._io_slots.writes_in_use == tier._io_slots.write_limit, stats
            assert stats.writes == 1 and stats.hits == 1, stats
            thaw(mount)
            await tier.flush()
            stats = tier.statistics()
            assert stats.in_flight == 0 and stats.writes == 1 + WRITES, stats
            assert all(tier.contains(key_of(i)) for i in range(1, WRITES + 1))
        finally:
            watchdog.cancel()
            thaw(mount)
            await tier.aclose()
        assert_clean(pool)
