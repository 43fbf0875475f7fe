"""Review 203: a delete whose own unlink is what meets the read-only file system (EROFS: the file
system remounted read-only, or turned so by an error, since the last write). The tier was
writable when the delete began, so nothing remembered it (a writer's delete of a key in a directory
listed whole unlinks at once), and the failed unlink only turned the tier read-only: the key was
not named in ``_unlink_when_writable`` either. The page stayed on disk, outside the index, for good:
once writable again nothing unlinked it (outside the budget; a restart indexed and served it:
stale KV), and when the lock was lost first, the looks (seeded from the index) found it as new
and served it at once.

Real: a loop ext4 remounted read-only and read-write for real, the EROFS met by the delete's own
unlink, the real writability check, a real restart, ``.lock`` unlinked and a second tier taking
the directory, the loss found by the real lock check. Root only."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from fs_helpers import loop_ext4, remount
from loop_probes import until_thread
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev199_held_take_over_deleted_write import _remount_read_only
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 0x71


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("then", ["writable_again", "lock_lost"])
async def test_a_page_whose_delete_met_erofs_is_never_served_again(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, then: str) -> None:
    size = layout.page_bytes
    victim, other = key_of(0, TAG), key_of(1, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        # The lock-lost case: the writability check must not come first (the loss is found first).
        recheck = 0.05 if then == "writable_again" else 3600.0
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, free_space_recheck_s=recheck,
                     min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            checks = LockChecks(a)
            for key in (victim, other):
                assert await a.write_from(key, memoryview(_bytes_of(key, size)))
            await _settled(a)
            page = a.files.layout_dir / f"{TAG:02x}" / victim.hex()
            await asyncio.to_thread(_remount_read_only, mount)
            try:
                assert a.read_only is None
                await a.delete(victim)  # its unlink meets EROFS: the tier turns read-only there
                assert a.read_only is ReadOnly.FILE_SYSTEM and page.exists()
                assert not a.contains(victim) and not await _served(a, victim, size)
            finally:
                await asyncio.to_thread(remount, mount, "rw")
            if then == "writable_again":
                # The tier's own check (every free_space_recheck_s) finds it writable again.
                await until_thread(lambda: a.read_only is None, "writes resumed")
            else:
                os.unlink(a.files.layout_dir / ".lock")  # another cache takes the directory
                async with started(DiskTier(cfg, layout, pool)) as b:
                    assert b.read_only is None
                    await checks.next()
                    assert a.read_only is ReadOnly.LOCKED
                    looks = Looks(a)
                    await looks.next()
                    assert a.contains(other), "the looks did not follow the directory"
                    assert not a.contains(victim), "a page whose delete met EROFS was indexed after the lock loss"
                    assert not await _served(a, victim, size), "a page its caller deleted was served"
                await looks.next()  # B closed: A takes over
                assert a.read_only is None
            await _settled(a)
            assert not page.exists(), "a page whose delete met EROFS stayed on disk"
        async with started(DiskTier(cfg, layout, pool)) as restarted:
            assert not await _served(restarted, victim, size), "a deleted page was served after a restart"
            assert await _served(restarted, other, size)
    assert_clean(pool)
