"""Review 232 (left open by 8296011 and 174d014): a take-over whose writer's pending-delete record
(``.deletes``) cannot be read treats every page found as deleted, and its look replaces the
damaged record only where it listed every fan-out directory whole and the save succeeded
(``follow._replace_record``). Where it could not (a directory's listing failed; the save failed),
nothing replaced it later: the tier wrote on with the damaged record on disk, and the next start
took its deletes for unknown again, every page stored since the take-over unlinked (lost
needlessly). Now the tier replaces it itself once the take-over's unlinks ended and every directory
the take-over could not list was listed again (at its lock checks; a failed save is tried again).

The fault is real: an ext4 whose directory block 5 of ``3b`` answers EIO (``listing_fs.py``: a
loop device over a FUSE file) as the take-over lists it; the record planted damaged; writer and
follower two tiers over the directory (a real flock); a real restart. Root only."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from listing_fs import dir_blocks, listing_ext4
from take_over_helpers import plant_damaged_record, record_errno, writer_and_follower
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind

TAG = 0x3B
FILES = 1000
"""Page files of ``3b``: about 10 blocks of a directory without an index."""
BAD = 5
NEW = key_of(1, 0x42)
"""Stored by the tier that took the directory over."""


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_damaged_record_a_take_over_could_not_replace_is_replaced_later(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    with listing_ext4(tmp_path, 128) as fs:
        cfg = config(fs.mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with contextlib.AsyncExitStack() as stack:
            writer, follower, looks = await writer_and_follower(
                stack, cfg, layout, pool, [key_of(i, TAG) for i in range(FILES)])
            layout_dir = writer.files.layout_dir
            fan = layout_dir / f"{TAG:02x}"
            assert dir_blocks(fan) > BAD + 2
            plant_damaged_record(writer)
            await writer.aclose()
            fs.cold()
            fs.bad_block(fan, BAD)
            try:
                await looks.next()
            finally:
                fs.good()
            assert follower.read_only is None and follower.statistics().took_over == 1, "no take-over: no test"
            assert follower.statistics().errors[ErrorKind.EIO] >= 1, "the listing did not fail: no test"
            assert record_errno(layout_dir) == errno.EBADMSG, "the take-over's look replaced the record: no test"
            checks = LockChecks(follower)
            await checks.next()  # lists 3b again
            await _settled(follower)
            await checks.next()
            await _settled(follower)
            assert record_errno(layout_dir) == 0, "the damaged record was never replaced"
            assert await follower.write_from(NEW, memoryview(_bytes_of(NEW, size)))
            await _settled(follower)
            await follower.aclose()
        async with started(DiskTier(cfg, layout, pool)) as again:
            assert again.read_only is None
            assert await _served(again, NEW, size), \
                "a restart lost the page stored after the take-over (the damaged record stayed)"
    assert_clean(pool)
