"""Review 203: a page deleted while the tier held the lock but could not write (the file system
turned read-only under it: an EROFS answer) stays on disk, its name waiting in
``_unlink_when_writable``; the delete itself was remembered nowhere else (a writer's delete of a key
in a directory listed whole is not: its file is unlinked at once). When the lock was then lost
(``.lock`` replaced once the file system was writable again, another cache holding the new one),
the tier followed from a seed of its index, which no longer named the key: the first look found
the page as new, no delete remembered said otherwise, and the tier indexed and served the page its
caller had deleted (stale KV); indexed, it was also kept on disk by the take-over. Such a delete is
now remembered (as a writer's delete of a key whose directory was away is), "a file no newer than
it" once the lock is lost.

Real: a loop ext4 remounted read-only and read-write for real, the EROFS met by a real write,
``.lock`` unlinked and a second tier taking the directory, the loss found by the real lock check,
the real looks and the real take-over once the other tier closed. Root only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from fs_helpers import loop_ext4, remount
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 0x6D


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_page_deleted_while_read_only_is_not_served_after_the_lock_is_lost(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    victim, other, probe = key_of(0, TAG), key_of(1, TAG), key_of(2, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        # Long intervals: the looks, lock checks and writability checks run when the test asks.
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, free_space_recheck_s=3600.0,
                     min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            checks = LockChecks(a)
            for key in (victim, other):
                assert await a.write_from(key, memoryview(_bytes_of(key, size)))
            await _settled(a)
            page = a.files.layout_dir / f"{TAG:02x}" / victim.hex()
            remount(mount, "ro")
            try:
                # A write meets the read-only file system: the tier stops writing (FILE_SYSTEM).
                assert not await a.write_from(probe, memoryview(_bytes_of(probe, size)))
                assert a.read_only is ReadOnly.FILE_SYSTEM
                await a.delete(victim)  # its file stays: nothing may be unlinked now
                assert victim in a._unlink_when_writable and page.exists()
            finally:
                remount(mount, "rw")
            os.unlink(a.files.layout_dir / ".lock")  # a cleanup; another cache takes the directory
            async with started(DiskTier(cfg, layout, pool)) as b:
                assert b.read_only is None
                await checks.next()
                assert a.read_only is ReadOnly.LOCKED and a.statistics().lock_lost == 1
                looks = Looks(a)
                await looks.next()
                await looks.next()
                assert a.contains(other), "the looks did not follow the directory"
                assert not a.contains(victim), "a page deleted while read-only was indexed after the lock loss"
                assert not await _served(a, victim, size), "a page its caller deleted was served"
            await looks.next()  # B closed: A takes over
            assert a.read_only is None and a.statistics().took_over == 1
            await _settled(a)
            assert not a.contains(victim) and not await _served(a, victim, size), "a deleted page was served"
            assert not page.exists(), "a page deleted while read-only stayed on disk after the take-over"
            assert await _served(a, other, size)
    assert_clean(pool)
