"""Review 225's finding (left open): a writer still running after its ``.lock`` was replaced (the
file unlinked from outside, a new cache started on the new one) keeps writing until its next lock
check, and a delete whose unlink fails there is saved into ``.deletes`` *after* the new writer's
start (or take-over) read it: the new writer never learnt of it, kept the page indexed and served
it (stale KV). Now the writer reads the record again at each lock check when it changed (its
identity: inode number, change time, size) and applies deletes it had not seen, as a start does:
a page it indexed from a file no newer than the delete leaves the index and is unlinked (named in
the record while the unlink fails), and the delete is remembered (a listing later leaves that file
out).

Real faults: two processes, each with its own real ``flock`` (the old writer a child process that
keeps its lock on the unlinked file, the new one this test's tier on the new ``.lock``); the old
writer's unlink answering EPERM for real (``chattr +i`` on the page file, a loop-device ext4); the
new writer's real lock check."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config
from follow_helpers import started
from fs_helpers import loop_ext4
from take_over_helpers import chattr, exists, mutable_again
from test_adv_rev188_deletes_away import _served
from test_adv_rev213_pending_deletes import OTHER, VICTIM, _killed_child, _on_disk, _receive
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.layoutdir import LOCK_NAME


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_delete_the_old_writer_records_after_the_new_writer_started_is_honoured(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    page: Path | None = None
    with loop_ext4(tmp_path, 64) as mount:
        directory = mount / "disk"
        cfg = config(directory, backend, follow_interval_s=3600.0, min_free_bytes=0)
        try:
            with _killed_child(str(directory), backend.value, "killed") as conn:
                assert await _receive(conn) == "written"  # the old writer: VICTIM and OTHER stored
                layout_dir = next(path for path in directory.iterdir() if path.is_dir())
                os.unlink(layout_dir / LOCK_NAME)  # an operator's rm: the old writer checks in an hour
                async with started(DiskTier(cfg, layout, pool)) as new:
                    assert new.read_only is None, "the new cache did not take the new .lock"
                    assert await _served(new, VICTIM, size)
                    page = layout_dir / f"{VICTIM[0]:02x}" / VICTIM.hex()
                    chattr("+i", page)
                    conn.send("delete")  # the old writer's unlink fails: it saves the record after our start
                    _tag, _counted, kept = await _receive(conn)  # type: ignore[misc]
                    assert kept and VICTIM in _on_disk(layout_dir) and exists(page), "the unlink did not fail"
                    checks = LockChecks(new)
                    await checks.next()
                    assert not new.contains(VICTIM) and not await _served(new, VICTIM, size), \
                        "the new writer served a page the old writer deleted after the new one started"
                    assert await _served(new, OTHER, size), "a page nobody deleted was lost"
                    assert VICTIM in _on_disk(layout_dir), "the record no longer names the page still on disk"
        finally:
            mutable_again(page)
    assert_clean(pool)
