"""Review 232, of 174d014: a follower's look that cannot read the writer's pending-delete record
withholds every page, but only a look that did not take the lock was asked: a look that took it
(the writer closed) and then could not take the directory over (a fan-out name not safely ours: a
symlink planted in place of the directory) lets the lock go again and applied what its scan found
with no deletes known, as before 174d014: the page the writer deleted (its unlink failed, named only
in the record) stayed indexed and was served (stale KV), at every such look. Now whether a look
withholds is asked once it knows whether the tier writes: one that ends without the lock withholds.

Real faults: the deleted page's file made immutable (``chattr +i``: the writer's unlink answers
EPERM) so it stays on disk named in the record; the record's last byte flipped on disk (a loop
ext4); the fan-out directory ``ee`` moved out of the cache and a symlink to it left in its place.
Writer and follower two tiers over the directory (a real flock). Root only (loop device, chattr)."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from fs_helpers import loop_ext4
from take_over_helpers import (
    delete_recorded,
    flip_last_byte,
    follower_indexed,
    mutable_again,
    record_errno,
    take_over_config,
)
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, ReadOnly
from aiokv.storage.deletelog import DELETES_NAME

VICTIM = key_of(1, 0x21)
OTHER = key_of(2, 0x22)
PLANTED = 0xEE
"""The fan-out name a symlink replaces: the take-over refuses the directory."""


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_look_that_takes_the_lock_but_not_the_directory_withholds_while_the_record_is_damaged(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    page: Path | None = None
    with loop_ext4(tmp_path, 64) as mount:
        cfg = take_over_config(mount / "disk", backend)
        outside = mount / "outside"
        try:
            async with contextlib.AsyncExitStack() as stack:
                writer, follower, looks = await follower_indexed(stack, cfg, layout, pool, (VICTIM, OTHER))
                layout_dir = writer.files.layout_dir
                page = Path(writer.files.path(VICTIM))
                await delete_recorded(writer, VICTIM, page)  # EPERM: the file stays, named in the record
                flip_last_byte(layout_dir / DELETES_NAME)
                assert record_errno(layout_dir) == errno.EBADMSG
                await writer.aclose()
                fan = layout_dir / f"{PLANTED:02x}"
                os.rename(fan, outside)
                os.symlink(outside, fan)
                for _ in range(2):
                    await looks.next()
                    assert follower.read_only is ReadOnly.LOCKED, "the take-over did not fail: no test"
                    assert not follower.contains(VICTIM) and not await _served(follower, VICTIM, size), \
                        "a follower served a page its writer deleted (the record damaged, the take-over failed)"
                    assert not follower.contains(OTHER), "a page served while the record's deletes are unknown"
                assert follower.statistics().follow_withheld == 2, follower.statistics()
                assert not any(outside.iterdir()), "something was written outside the cache"
        finally:
            mutable_again(page)
    assert_clean(pool)
