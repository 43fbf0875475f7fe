"""Review 229's second finding (left open by 4b00f54): a follower took the directory over where the
file system was read-only (``.deletes`` damaged, so it could not replace it then), and before the
held look that finds it writable, the tier's lock check took ``.lock`` again (removed from outside,
made again once the file system was writable: ``lock_retaken``). The held look asked whether
``.lock`` still named the file the *take-over's* look had locked (``FollowState.lock_taken``): never
again, so it switched the tier to writing without replacing the damaged record, and every later
start took that record's deletes for unknown: the pages the new writer stored were served by no
start and unlinked by the next lock holder (the cache lost at each restart). Now the held look is
handed a duplicate of the lock the tier holds *now* and replaces the record while ``.lock`` names
that file.

Real faults: the record planted damaged; a loop-device ext4 remounted read-only for the take-over,
read-write after; ``.lock`` removed from outside and made again by the tier's real lock check; a
real restart over the directory."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config
from follow_helpers import started
from fs_helpers import loop_ext4, remount
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev229_held_lock_retaken import LATER, PAGE, PLANTED, _held_then_retaken

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.deletelog import DELETES_NAME


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_held_look_after_a_lock_retake_replaces_the_damaged_record(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    with loop_ext4(tmp_path, 64) as mount:
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        try:
            async with contextlib.AsyncExitStack() as stack:
                follower, looks, layout_dir, _taken = await _held_then_retaken(stack, mount, cfg, layout, pool)
                record = layout_dir / DELETES_NAME
                assert record.read_bytes() == PLANTED
                await looks.next()  # the held look: writable now, under the lock the check took again
                assert follower.read_only is None, "the held look did not switch the tier to writing"
                assert not (record.exists() and record.read_bytes() == PLANTED), \
                    "the held look left the damaged record after the lock was taken again"
                assert not follower.contains(PAGE), "a page of the unreadable record's time was kept"
                assert await follower.write_from(LATER, memoryview(_bytes_of(LATER, size)))
                await _settled(follower)
                await follower.aclose()
                # A restart: the page the new writer stored is served (before: the damaged record
                # named unknown deletes, and this start unlinked it).
                again = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
                assert again.read_only is None
                assert again.contains(LATER) and await _served(again, LATER, size), \
                    "a restart lost the page the new writer stored (the damaged record stayed)"
        finally:
            with contextlib.suppress(AssertionError):
                remount(mount, "rw")
    assert_clean(pool)
