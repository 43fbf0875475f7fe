"""Review 241: the writer's lock check reads the pending-delete record again when it changed and
examines the file under each key it names (``lockwatch.check_record``, one ``stat`` a key, on the
check's thread). The close waits for that thread, and nothing stopped it before the last key: a
record of a million keys (``MAX_RECORDS``: another cache's deletes, or a record planted in the
cache directory) held the close 3 s on a warm local ext4, and as long as a million lookups take on
a slow file system. Now the close ends the examination at its next batch of keys
(``layoutdir.STOP_EVERY``), as it ends a listing.

The fault is real: the fan-out directories' blocks are read through a FUSE file under an ext4
(``listing_fs.py``). The record names ``2 * STOP_EVERY`` keys of ``3a``, then keys of ``3b``;
block 0 of each directory is held, so the check's thread waits in the lookup of the first key of
``3a``. Once the close began, that block is answered: a check that asks no stop flag goes on to
``3b`` and waits there, and so does the close (before: it never ended while the block was held).
Now the close ends at once and ``3b``'s block is never asked for. Root only (FUSE, loop device)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from gate_helpers import BOUND_S
from listing_fs import listing_ext4
from loop_probes import until, waiting_in
from test_adv_rev175_fanouts import _bytes_of
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.deletelog import save_deletes
from aiokv.storage.layoutdir import STOP_EVERY

FIRST, LATER = 0x3A, 0x3B
"""The fan-out directories of the record's keys: the check waits in the first when the close
begins, and must never reach the second."""
CLOSE_S = 10.0
"""The close must end within this once the first held block is answered (seconds)."""


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_close_ends_the_examination_of_a_large_record(tmp_path: Path, layout: KVLayout,
                                                              pool: PagePool) -> None:
    with listing_ext4(tmp_path, 64) as fs:
        # (the lock check alone: one backend; no check but those the test asks for)
        cfg = config(fs.mount / "disk", DiskBackend.THREADS, follow_interval_s=3600.0, min_free_bytes=0)
        tier = DiskTier(cfg, layout, pool)
        await tier.start()
        closing: asyncio.Task[None] | None = None
        try:
            for tag in (FIRST, LATER):  # both directories made and held open by the tier
                key = key_of(1, tag)
                assert await tier.write_from(key, memoryview(_bytes_of(key, layout.page_bytes)))
            checks = LockChecks(tier)
            await checks.next()  # the first check read the (absent) record
            later = time.time_ns()
            records = {key_of(1000 + i, FIRST): later for i in range(2 * STOP_EVERY)}
            records.update({key_of(1000 + i, LATER): later for i in range(8)})  # in this order on disk
            fd = os.open(tier.files.layout_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                save_deletes(fd, records)  # as another cache saves it
            finally:
                os.close(fd)
            first, second = (tier.files.layout_dir / f"{tag:02x}" for tag in (FIRST, LATER))
            fs.cold()
            fs.hold_block(first, 0)
            fs.hold_block(second, 0)
            tier._check_lock_soon()
            await asyncio.to_thread(fs.wait_held)  # the check's lookup of the first key waits
            closing = asyncio.create_task(tier.aclose())
            await until(lambda: waiting_in(tier._watch_task, "wait_uncancelled"))  # the close waits for it
            fs.free_block(first, 0)
            done, _ = await asyncio.wait({closing}, timeout=CLOSE_S)
            assert done, f"the close still waited for the record's examination {CLOSE_S} s after its block was read"
            assert fs.held() == 0, "the examination went on past the close to a later directory"
        finally:
            fs.release()
            async with asyncio.timeout(BOUND_S):
                await (closing if closing is not None else tier.aclose())
        assert not [t.name for t in threading.enumerate() if t.name.startswith("aiokv-disk-lock")]
    assert_clean(pool)
