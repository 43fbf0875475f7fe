"""Review 227: a take-over that cannot read the pending-delete record replaces it once it may
write (review 225: else every later start takes its deletes for unknown again and serves none of
the pages the new writer stored). A take-over on a read-only file system holds the lock and may not
write; its look that finds the file system writable again scanned as a take-over does, and the
damaged record stayed.

Real faults: the record planted damaged; the file system (a loop-device ext4) remounted read-only
for the take-over, read-write again after."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from follow_helpers import started
from fs_helpers import loop_ext4, remount
from take_over_helpers import (
    PLANTED,
    read_only_take_over,
    record_errno,
    take_over_config,
    writable_again,
    writer_and_follower,
)
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.layoutdir import LOCK_NAME

TAG = 0x73
PAGE, LATER = key_of(0, TAG), key_of(1, TAG)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_read_only_take_over_of_a_damaged_record_replaces_it_once_writable(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    with loop_ext4(tmp_path, 64) as mount:
        cfg = take_over_config(mount / "disk", backend)
        try:
            async with contextlib.AsyncExitStack() as stack:
                writer, follower, looks = await writer_and_follower(stack, cfg, layout, pool, (PAGE,))
                assert follower.read_only is ReadOnly.LOCKED
                record = await read_only_take_over(mount, writer, looks)
                assert not follower.contains(PAGE)
                remount(mount, "rw")
                await looks.next()
                assert follower.read_only is None, "the tier did not write once the file system was writable"
                assert await follower.write_from(LATER, memoryview(_bytes_of(LATER, size)))
                await _settled(follower)
                assert await _served(follower, LATER, size)
                await follower.aclose()
                assert record_errno(record.parent) == 0, \
                    "the damaged record stayed: the next start serves none of the pages stored since"
            async with started(DiskTier(cfg, layout, pool)) as restarted:
                assert restarted.read_only is None
                assert await _served(restarted, LATER, size), "a page stored after the take-over was lost"
                assert not await _served(restarted, PAGE, size)
        finally:
            writable_again(mount)
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_held_look_leaves_the_record_once_lock_names_another_file(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The held look replaces the record only while ``.lock`` names the file the tier locked: once
    another file is there (removed and made again, locked by another cache before the tier's lock
    check tells it), the record is that cache's to write. A real lock on the new ``.lock``."""
    with loop_ext4(tmp_path, 64) as mount:
        cfg = take_over_config(mount / "disk", backend)
        other: int | None = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                writer, _, looks = await writer_and_follower(stack, cfg, layout, pool, (PAGE,))
                record = await read_only_take_over(mount, writer, looks)
                remount(mount, "rw")
                other = _lock_anew(record.parent / LOCK_NAME)
                await looks.next()
                assert record.read_bytes() == PLANTED, \
                    "a held look replaced the record while another cache held the directory's lock"
        finally:
            if other is not None:
                os.close(other)
            writable_again(mount)
    assert_clean(pool)


def _lock_anew(lock: Path) -> int:
    """``.lock`` removed and made again, locked as another cache's take-over would."""
    lock.unlink()
    fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd
