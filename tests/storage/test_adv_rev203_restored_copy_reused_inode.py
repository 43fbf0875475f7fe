"""Review 203, a guard on a491382: a follower's deleted names are examined whole so that a page the
writer stores again under the freed inode number is told apart (by its change time) from the page
deleted, and indexed. The same reuse brings a copy of the page deleted back: taken before the
delete with its times kept (``cp -p``, a backup) and restored after the writer removed the page,
ext4 gives it the freed inode number. Its change time differs too, but its modification time is
the page deleted's: it must stay a miss (never served: stale KV) and be unlinked at the take-over.

Real: a second writer deleting for real on a fresh ext4 (loop device), the copy restored by
``shutil.copy2`` into the name (the inode reuse checked, not assumed), the real looks and the real
take-over. Root only."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from fs_helpers import loop_ext4
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _indexed, _on_disk, _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev194_deleted_while_following import _past_file_clock

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 0x70


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("then", ["following", "take_over"])
async def test_a_copy_of_a_deleted_page_restored_under_its_freed_inode_is_never_served(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, then: str) -> None:
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(3)]
    victim = keys[0]
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, capacity=64 * size, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as b:
            for key in keys:
                assert await b.write_from(key, memoryview(_bytes_of(key, size)))
            name = b.files.layout_dir / f"{TAG:02x}" / victim.hex()
            backup = tmp_path / "backup"
            shutil.copy2(name, backup)  # a backup of the page, times kept (another file system)
            async with started(DiskTier(cfg, layout, pool)) as a:
                assert a.read_only is ReadOnly.LOCKED and a.contains(victim)
                looks = Looks(a)
                _past_file_clock(mount / "probe")  # the delete is later than the page's times
                await a.delete(victim)
                inode = name.stat().st_ino
                await b.delete(victim)  # the writer removes the page: its inode number freed
                shutil.copy2(backup, name)  # the copy restored, times kept, before A's next look
                assert name.stat().st_ino == inode, "ext4 did not reuse the inode number (the case is not made)"
                if then == "take_over":
                    await b.aclose()
                await looks.next()
                assert not a.contains(victim), "a copy of the deleted page was indexed"
                assert not await _served(a, victim, size), "a copy of the deleted page was served"
                if then == "take_over":
                    assert a.read_only is None and a.statistics().took_over == 1
                    await _settled(a)
                    assert not name.exists(), "the copy of the deleted page stayed on disk after the take-over"
                    assert _indexed(a) == _on_disk(a.files.layout_dir)
                else:
                    assert victim in a._unlink_when_writable, "the copy on disk is no longer named for the take-over"
                assert all([await _served(a, key, size) for key in keys[1:]])
    assert_clean(pool)
