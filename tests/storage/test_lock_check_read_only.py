"""A writer whose ``.lock`` was removed checks every ``follow_interval_s`` that the name still leads
to the file it holds, and makes the file again when it is gone. On a file system remounted
read-only that create answers EROFS: before, each check counted it as a fault (``OTHER``), every 2 s
for as long as the mount stayed read-only. Nobody can make or lock ``.lock`` there then, so it is no
fault: not counted, and the checks go on; once the file system is writable again the next check
makes and takes the file (``lock_retaken``).

Real faults: the mount of a loop ext4 remounted read-only (``remount,bind,ro``: the kernel answers
EROFS). A remount of the file system itself is refused (EBUSY) while an unlinked file is open, and
the writer keeps the unlinked ``.lock`` open (its ``flock``); an ext4 gone read-only on an error
does not ask. Root only."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, stored_page
from follow_helpers import follow_config
from fs_helpers import loop_ext4, remount
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, layoutdir

CHECKS = 3


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_lock_gone_on_a_read_only_file_system_is_no_fault(tmp_path: Path, backend: DiskBackend,
                                                                  layout: KVLayout, pool: PagePool) -> None:
    with loop_ext4(tmp_path, 24) as mount:
        # Checks only when the test asks for one (LockChecks.next).
        async with DiskTier(follow_config(mount / "kv", backend, min_free_bytes=0), layout, pool) as tier:
            checks = LockChecks(tier)
            await stored_page(tier, pool, 0)
            lock = tier.files.layout_dir / layoutdir.LOCK_NAME
            os.unlink(lock)
            await asyncio.to_thread(remount, mount, "bind,ro")
            try:
                for _ in range(CHECKS):
                    await checks.next()
                stats = tier.statistics()
                assert not any(stats.errors.values()), f"a lock not ours to make counted as a fault: {stats.errors}"
                assert stats.lock_retaken == 0 and stats.lock_lost == 0 and not lock.exists()
                assert tier.read_only is None  # nothing was written meanwhile: no EROFS seen by a write
            finally:
                await asyncio.to_thread(remount, mount, "bind,rw")
            await checks.next()  # the checks went on: writable again, the file is made and taken
            stats = tier.statistics()
            assert stats.lock_retaken == 1 and lock.exists(), stats
            assert not any(stats.errors.values()), stats.errors
            await stored_page(tier, pool, 1)
    assert_clean(pool)
