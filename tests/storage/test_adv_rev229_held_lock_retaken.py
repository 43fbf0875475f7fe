"""Review 229 of eed23ff: a held look replaces a damaged pending-delete record only while ``.lock``
names "the file the take-over locked" (``FollowState.lock_taken``, the ``(st_dev, st_ino)`` the look
that took the lock saw). The tier's lock check may take ``.lock`` again since (removed from outside:
``lock_retaken``) and close the file the look locked: its inode number is free then, and ext4 hands
it to the next file made there. Another cache's ``.lock`` under that number passed the check, and
the held look saved the record (here: removed it, nothing left to name) while that cache held the
directory's lock: two writers of ``.deletes`` (the other cache's pending deletes lost: a later start
serves a page it deleted). Now the identity kept is the file's (inode number and change time,
``file_identity``), as for page files: a file made under a freed inode number is another file.

Real faults: the record planted damaged; a loop-device ext4 remounted read-only for the take-over,
read-write after; ``.lock`` removed from outside; a real flock on another cache's ``.lock``."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from follow_helpers import Looks
from fs_helpers import loop_ext4, remount
from take_over_helpers import PLANTED, read_only_take_over, take_over_config, writable_again, writer_and_follower
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskConfig, DiskTier
from aiokv.storage.deletelog import DELETES_NAME
from aiokv.storage.layoutdir import LOCK_NAME

TAG = 0x79
PAGE, LATER = key_of(0, TAG), key_of(1, TAG)  # LATER: review 229's other test (left to the lead)
TRIES = 256
"""Files made at most to meet the freed inode number again (ext4 hands out the lowest free one)."""


def _reuses_inodes(where: Path) -> None:
    """Control: ext4 here hands a freed inode number to the next file made (else: no test)."""
    where.mkdir(parents=True, exist_ok=True)
    first = where / "file"
    first.write_bytes(b"")
    ino = first.stat().st_ino
    first.unlink()
    first.write_bytes(b"")
    again = first.stat().st_ino
    first.unlink()
    if again != ino:
        pytest.skip("this file system does not hand a freed inode number out again: no test")


async def _held_then_retaken(stack: contextlib.AsyncExitStack, mount: Path, cfg: DiskConfig, layout: KVLayout,
                             pool: PagePool) -> tuple[DiskTier, Looks, Path, int]:
    """A follower that took the directory over on a read-only file system (the record damaged), the
    file system writable again, and ``.lock`` removed from outside and taken again by the tier's
    lock check before its next look. Returns the follower, its looks, the layout directory and the
    inode number of the lock file the take-over's look locked (closed now)."""
    writer, follower, looks = await writer_and_follower(stack, cfg, layout, pool, (PAGE,))
    layout_dir = writer.files.layout_dir
    await read_only_take_over(mount, writer, looks)
    taken = os.stat(layout_dir / LOCK_NAME).st_ino
    remount(mount, "rw")
    checks = LockChecks(follower)
    os.unlink(layout_dir / LOCK_NAME)
    await checks.next()
    assert follower.statistics().lock_retaken == 1, "the lock check did not take .lock again: no test"
    assert os.stat(layout_dir / LOCK_NAME).st_ino != taken
    return follower, looks, layout_dir, taken


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_held_look_leaves_the_record_of_a_lock_that_reuses_the_freed_inode(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    with loop_ext4(tmp_path, 64) as mount:
        cfg = take_over_config(mount / "disk", backend)
        other: int | None = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                _reuses_inodes(mount / "control")
                _follower, looks, layout_dir, taken = await _held_then_retaken(stack, mount, cfg, layout, pool)
                # Another cache's .lock (removed and made again, then locked by that cache), under
                # the inode number the tier's first lock file had.
                lock = layout_dir / LOCK_NAME
                made: list[Path] = []
                for n in range(TRIES):
                    path = layout_dir / f"made.{n}"
                    path.write_bytes(b"")
                    made.append(path)
                    if path.stat().st_ino == taken:
                        break
                else:
                    pytest.skip(f"ext4 did not hand inode {taken} out again in {TRIES} files: no test")
                lock.unlink()
                os.rename(made.pop(), lock)
                for path in made:
                    path.unlink()
                other = os.open(lock, os.O_RDONLY)
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                await looks.next()
                record = layout_dir / DELETES_NAME
                assert record.exists() and record.read_bytes() == PLANTED, \
                    "a held look replaced (an empty record: removed) the record while another cache held the " \
                    "directory's lock"
        finally:
            if other is not None:
                os.close(other)
            writable_again(mount)
    assert_clean(pool)
