"""Review 200: a take-over that found another writer's page under a key its own write (in flight
since before the lock loss) was still writing indexed that key blind when the write ended unstored
(review 199, ``_found_under_write``). If the key's fan-out directory was moved away meanwhile and a
copy put back in its place holding the page the caller had deleted, the key was indexed, and the
name's reopening kept it (an indexed key is not asked against the deletes): the deleted page was
served (stale KV). The take-over's finding is now forgotten when that directory is retired: the
listing of the name's next directory decides (it unlinks the deleted page).

Real: the delete remembered with the old directory moved away; a second writer stores the key
again; the write held by ``fsfreeze`` across the lock loss, the other writer's close and the
take-over look, on a file system filled for real (ENOSPC once thawed); the directories renamed for
real before the write's end runs on the loop, and the writer's own lock check retires the moved one.
Root only."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from fs_helpers import loop_ext4
from held_write import assert_deleted_page_gone, found_under_write, needs_fsfreeze

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend
from aiokv.storage.lockwatch import check_writer

TAG = 0x5C


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_found_page_s_directory_replaced_before_the_write_fails_serves_no_deleted_page(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    needs_fsfreeze()
    victim = key_of(0, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        async with found_under_write(mount, backend, layout, pool, TAG, lambda fan: None) as scene:
            a, fan, prepared = scene.a, scene.fan, scene.following.prepared
            # Before the write's end runs on the loop (no await): the directory holding the
            # other writer's page moved away, the one holding the page deleted put back, and
            # A's own lock check retires the name's old descriptor.
            os.rename(fan, mount / "newer")
            os.rename(scene.away, fan)
            assert prepared.lock_fd is not None
            checked = check_writer(prepared.dir_fd, prepared.lock_fd, list(prepared.fanout), None,
                                   a.files.layout_dir)
            try:
                a._apply_lock_check(checked)
            finally:
                checked.close()
            assert TAG in a._fanouts_away, "the moved directory was not retired"
            assert not await asyncio.wait_for(scene.store, 10.0), "the write was to fail (ENOSPC)"
            await assert_deleted_page_gone(a, victim, fan, "put back with its directory")
    assert_clean(pool)
