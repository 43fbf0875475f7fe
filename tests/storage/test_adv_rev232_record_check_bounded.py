"""Review 232, of 6c7629f: the lock holder reads the pending-delete record again at each lock
check when it changed, and applied every delete it names that is not its own in one loop turn,
remembering each (``_remember``). Past ``DELETED_KEPT`` (65,536) each one forgotten into the filter
pushed another out, and the next record read did it all again: a record of 100,000 deletes of
another cache (a writer still running after its ``.lock`` was replaced, or the one before a
take-over: their entries stay in the record) held the engine's loop for seconds at every check
where the record had changed. Now applied in bounded steps, a delete the filter already covers
not remembered again.

Real: the record saved into the layout directory as another cache saves it (``save_deletes``), the
writer's real lock check reading it (its ``stat`` of each name on the check's thread); the loop's
longest turn measured by a task that ticks beside it."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from loop_probes import until
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev188_deletes_away import _served
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.deletelog import save_deletes

FOREIGN = 100_000
LONGEST_S = 1.0
"""Before: 1.5 to 3 s in one turn here."""
KEPT = key_of(1, 0x30)


async def _longest_turn(stop: asyncio.Event) -> float:
    longest = 0.0
    last = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0)
        now = time.monotonic()
        longest = max(longest, now - last)
        last = now
    return longest


@pytest.mark.asyncio
async def test_a_large_record_of_another_cache_is_applied_in_bounded_steps(
        tmp_path: Path, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    victim = key_of(2, 0x31)
    # (the loop's work alone: one backend)
    cfg = config(tmp_path / "disk", DiskBackend.THREADS, follow_interval_s=3600.0, min_free_bytes=0)
    async with started(DiskTier(cfg, layout, pool)) as tier:
        for key in (KEPT, victim):
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        checks = LockChecks(tier)
        await checks.next()  # the first check read the (absent) record
        later = time.time_ns() + 10**9  # after the victim's file: the page deleted
        records = {key_of(1_000_000 + i, i % 256): later for i in range(FOREIGN)}
        records[victim] = later
        fd = os.open(tier.files.layout_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            save_deletes(fd, records)  # as another cache saves it
        finally:
            os.close(fd)
        for _ in range(2):  # the second read: the deletes remembered (and forgotten) already
            stop = asyncio.Event()
            ticker = asyncio.create_task(_longest_turn(stop))
            await checks.next(limit_s=120.0)
            await until(lambda: not tier.contains(victim) and (
                (applying := getattr(tier, "_record_applying", None)) is None or applying.done()), turns=100_000)
            stop.set()
            longest = await ticker
            assert longest < LONGEST_S, f"the loop was held {longest:.2f} s in one turn applying the record"
            # The record changed again (another save): read and applied whole again.
            fd = os.open(tier.files.layout_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                save_deletes(fd, records)
            finally:
                os.close(fd)
        assert not tier.contains(victim) and not await _served(tier, victim, size), "the record was not applied"
        assert await _served(tier, KEPT, size), "a page the record does not name was lost"
    assert_clean(pool)
