"""Review 200: a take-over that found another writer's page under a key its own write (in flight
since before the lock loss) was still writing indexed that key blind when the write ended unstored
(review 199, ``_found_under_write``): a copy of the page the caller had deleted, restored under the
name meanwhile (its times kept), was indexed and served (stale KV). The file under the name is now
asked against the deletes again at the write's end.

Real: the delete remembered with the old directory moved away; a second writer stores the key
again; the write held by ``fsfreeze`` across the lock loss, the other writer's close and the
take-over look, on a file system filled for real (ENOSPC once thawed); the old copy renamed over
the name for real before the write's end runs on the loop. Root only."""

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

TAG = 0x5E


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_found_page_replaced_by_a_deleted_copy_before_the_write_fails_is_not_served(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    needs_fsfreeze()
    victim = key_of(0, TAG)
    with loop_ext4(tmp_path, 24) as mount:

        def keep_a_link(fan: Path) -> None:
            # A second link to B's page: renamed over, its blocks stay taken (the write still fails).
            os.link(fan / victim.hex(), mount / "kept")

        async with found_under_write(mount, backend, layout, pool, TAG, keep_a_link) as scene:
            # Before the write's end runs on the loop (no await): the copy of the page deleted
            # (its times kept) restored over the other writer's page.
            os.rename(scene.away / victim.hex(), scene.fan / victim.hex())
            assert not await asyncio.wait_for(scene.store, 10.0), "the write was to fail (ENOSPC)"
            await assert_deleted_page_gone(scene.a, victim, scene.fan, "restored under its name")
    assert_clean(pool)
