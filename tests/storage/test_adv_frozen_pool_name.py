"""A pool closed while page-file writes hang in the kernel (a frozen file system) keeps its mapping,
never its /dev/shm name.

``PagePool.close_after(io_ended)`` kept the segment's name until the stuck I/O ended: if it never
ends (or the loop that would see it end is gone), the name outlived the process. Now the name goes
at the close; the mapping stays while the stuck writes may still read it, and is freed once the
thaw lets them end. A watchdog thaws after THAW_S so nothing stays stuck when the check fails. Root only.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path

import pytest
from disk_helpers import BIG, config, fill, key_of
from fs_helpers import freeze, loop_ext4, thaw

from aiokv.pool import PagePool
from aiokv.shm import SHM_DIR
from aiokv.storage import DiskBackend, DiskTier

THAW_S = 20.0
CLOSE_S = 0.5
BOUND_S = 10.0
WRITES = 4



def _named(name: str) -> bool:
    return os.path.exists(SHM_DIR + name)  # tmpfs: never blocks


@pytest.mark.root
@pytest.mark.asyncio
async def test_pool_closed_after_stuck_io_drops_its_name_at_once_and_its_mapping_after_the_thaw(
        tmp_path: Path, backend: DiskBackend) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    pool = PagePool.create(BIG, 8 * BIG.page_bytes, register_cuda=False, workers=1)
    pool.wait_ready_blocking()
    segment = pool.memory.segment
    try:
        with loop_ext4(tmp_path, 24) as mount:
            tier = DiskTier(config(mount / "disk", backend, min_free_bytes=0), BIG, pool)
            await tier.start()
            watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
            try:
                freeze(mount)
                watchdog.start()
                for i in range(WRITES):
                    assert tier.write_behind_nowait(key_of(i), fill(pool, key_of(i), i))
                assert not await tier.close_within(CLOSE_S), "the close did not wait: the freeze did not bite"
                assert tier.statistics().in_flight > 0
                assert _named(segment.name)
                pool.close_after(tier.io_ended)
                # The name is gone while the stuck writes are still in the kernel; the mapping stays.
                assert not _named(segment.name), "a closed pool's name stays while its I/O is stuck"
                assert tier.statistics().in_flight > 0 and not tier.io_ended.done()
                assert not segment.closed
                thaw(mount)
                async with asyncio.timeout(BOUND_S):
                    await pool.wait_freed()
                assert tier.io_ended.done() and segment.closed
                assert not _named(segment.name)
            finally:
                watchdog.cancel()
                thaw(mount)
                await tier.aclose()
    finally:
        pool.close()
