"""Review 203: a tier that took the directory over where it could not write (a read-only file
system: ``_follow_held``) keeps looking whether it may write now; such a look, once the file system
is writable, scans as a take-over does and reports ``writable``. When the tier's lock check found
the lock lost (``.lock`` replaced, another cache holding the new one) while that look was still on
its thread, the look's result, applied after the loss, switched the tier to writing anyway
(``read_only`` None, no lock held, no lock check running): two writers in one directory, each
evicting by its own budget and unlinking the other's pages. A held look's ``writable`` now takes
the directory over only while the tier still holds the lock (``_follow_held``).

Real: a loop ext4 remounted read-only (the take-over held) and read-write for real, ``.lock``
unlinked and another tier taking the new one, a fan-out directory removed so the held look's scan
makes it again, where a real ``fsfreeze`` holds that look in the kernel across the real lock check.
Root only."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from fs_helpers import freeze, loop_ext4, remount, thaw
from loop_probes import until_thread
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev199_held_take_over_deleted_write import _remount_read_only
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 0x6E
THAW_S = 30.0


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_held_look_applied_after_the_lock_was_lost_does_not_write(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    size = layout.page_bytes
    kept = key_of(0, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, free_space_recheck_s=3600.0,
                     min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            checks = LockChecks(a)
            lock = a.files.layout_dir / ".lock"
            os.unlink(lock)
            async with started(DiskTier(cfg, layout, pool)) as b:
                assert await b.write_from(kept, memoryview(_bytes_of(kept, size)))
                await checks.next()
                assert a.read_only is ReadOnly.LOCKED
            looks = Looks(a)
            await asyncio.to_thread(_remount_read_only, mount)
            try:
                await looks.next()  # B closed: A takes the directory over, held (read-only)
                assert a._follow_held and a.read_only is ReadOnly.FILE_SYSTEM and a._dir is not None
                assert a._dir.lock_fd is not None
            finally:
                await asyncio.to_thread(remount, mount, "rw")
            os.unlink(lock)
            async with started(DiskTier(cfg, layout, pool)) as c:
                assert c.read_only is None
                # An empty fan-out directory removed: the held look's scan makes it again (held there).
                for index in range(256):
                    try:
                        os.rmdir(a.files.layout_dir / f"{index:02x}")
                        break
                    except OSError:
                        continue
                else:
                    pytest.fail("no empty fan-out directory to remove")
                applied = looks.applied
                watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
                freeze(mount)
                watchdog.start()
                try:
                    started_before = a._follow_started
                    a._look_soon()  # may write now: scans as a take-over does, held by the freeze
                    await until_thread(lambda: a._follow_started > started_before, "the held look started")
                    await checks.next()  # the lock check meanwhile: C holds .lock now
                    assert a.read_only is ReadOnly.LOCKED and a.statistics().lock_lost == 2
                finally:
                    thaw(mount)
                    watchdog.cancel()
                await until_thread(lambda: looks.applied > applied, "the held look applied")
                await _settled(a)
                assert a._dir.lock_fd is None
                assert a.read_only is ReadOnly.LOCKED, "a look applied after the lock loss made the tier write"
                assert a.statistics().took_over == 1
                other = key_of(1, TAG)
                assert not await a.write_from(other, memoryview(_bytes_of(other, size))), \
                    "the tier wrote beside the cache that holds the lock"
                assert await _served(c, kept, size)
            await looks.next()  # C closed: A takes over for writing now
            assert a.read_only is None and a._dir.lock_fd is not None
            assert await _served(a, kept, size)
    assert_clean(pool)
