"""Review 232, of 174d014 and 6c7629f: a follower withholds every page while the writer's
pending-delete record cannot be read, until a look reads it again, and only the writer's next save
replaces it. A writer whose record was damaged on disk (a flipped byte, a block answering EIO) and
whose failed unlink keeps failing never saves again (a retry's failure changes nothing there): the
follower served none of its pages for as long as the writer ran. The writer's lock check reads the
record again when it changed (6c7629f) and left one it could not read as it was. Now the lock
holder replaces it, unread, with the record it keeps in memory (every delete it names), once no
fan-out directory waits to be listed again; the follower's next look reads it and serves again.

Real faults: the deleted page's file made immutable (``chattr +i``: the writer's unlink and its
retries answer EPERM) so the record names it for good; the record's last byte flipped on disk, or
its block answering EIO (an ext4 on a loop device over a FUSE file, the page cache dropped);
writer and follower two tiers over the directory (a real flock), the writer's lock check and the
follower's looks real. Root only (FUSE, loop device, chattr)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from take_over_helpers import (
    delete_recorded,
    exists,
    mutable_again,
    record_errno,
    take_over_config,
    writer_and_follower,
)
from test_adv_rev142_bad_blocks import bad_block_ext4
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev222_record_unreadable_take_over import _make_unreadable
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, ReadOnly
from aiokv.storage.deletelog import DELETES_NAME

VICTIM = key_of(1, 0x21)
OTHER = key_of(2, 0x22)


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["eio", "damaged"])
async def test_the_writer_replaces_its_damaged_record_and_the_follower_serves_again(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, how: str) -> None:
    size = layout.page_bytes
    page: Path | None = None
    with bad_block_ext4(tmp_path, 32) as (mount, bad):
        cfg = take_over_config(mount / "disk", backend)
        try:
            async with contextlib.AsyncExitStack() as stack:
                writer, follower, looks = await writer_and_follower(stack, cfg, layout, pool, (VICTIM, OTHER))
                assert follower.read_only is ReadOnly.LOCKED
                layout_dir = writer.files.layout_dir
                page = Path(writer.files.path(VICTIM))
                await delete_recorded(writer, VICTIM, page)  # EPERM: the file stays, named in the record
                await asyncio.to_thread(_make_unreadable, how, layout_dir / DELETES_NAME, bad)
                await looks.next()
                assert not follower.contains(OTHER), "the follower did not withhold: no test"
                checks = LockChecks(writer)
                for _ in range(2):
                    await checks.next()
                    await _settled(writer)
                assert exists(page), "the retried unlink succeeded: no test"
                assert record_errno(layout_dir, VICTIM) == 0, "the writer left its damaged record as it was"
                await looks.next()
                assert await _served(follower, OTHER, size), "the follower withholds for as long as the writer runs"
                assert not follower.contains(VICTIM) and not await _served(follower, VICTIM, size)
        finally:
            bad.good()
            mutable_again(page)
    assert_clean(pool)
