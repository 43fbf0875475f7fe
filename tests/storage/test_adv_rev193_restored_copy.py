"""Review 193: a key deleted, then stored again by this tier: a copy of its old file that comes back
with new times (``cp`` without ``-p``, a restore that resets times) is still the page deleted.

Before, once the tier stored the key again (``tierbase.STORED_SINCE_DELETE`` marked on the
remembered delete), a listing indexed any file of the key newer than the delete as that store's.
A copy of the old directory made after the delete has every file newer than it: the deleted page
came back with it (stale KV), and won over the new write whose directory had gone away. Now the
store remembers its file's identity (inode number and change time, as a listing sees it): a file
moved with its directory is that store's; a copy is another file, unlinked.

Real renames of the fan-out directory; ``shutil.copytree`` with ``copyfile`` (new files, new times)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _indexed, _on_disk, _settled
from test_adv_rev188_deletes_away import _served
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

TAG = 0x3B


@pytest.mark.asyncio
async def test_a_fresh_copy_of_the_old_file_is_not_taken_for_the_store_after_the_delete(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(3)]
    victim, kept = keys[0], keys[1:]
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as tier:
        checks = LockChecks(tier)
        for key in keys:
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        fan, away = tier.files.layout_dir / f"{TAG:02x}", tmp_path / "away"
        os.rename(fan, away)  # the old directory, holding the victim's page
        await checks.next()  # retired
        await tier.delete(victim)  # remembered: its old file is away
        assert await tier.write_from(victim, memoryview(_bytes_of(victim, size)))  # stored again, 3b made again
        await _settled(tier)
        new_file = os.stat(fan / victim.hex())
        copy = tmp_path / "copy"
        shutil.copytree(away, copy, copy_function=shutil.copyfile)  # made after the delete: newer than it
        old_copy = os.stat(copy / victim.hex())
        assert old_copy.st_mtime_ns > new_file.st_mtime_ns - 1  # the copy looks as new as the store
        os.rename(fan, tmp_path / "made-again")  # the new write's directory goes away
        os.rename(copy, fan)  # the old page's copy comes back in its place
        await checks.next()  # the copy opened and listed
        await _settled(tier)
        assert not tier.contains(victim), "a copy of the deleted page was indexed as the store after the delete"
        assert not await _served(tier, victim, size), "a deleted page was served"
        assert not (fan / victim.hex()).exists()
        for key in kept:
            assert await _served(tier, key, size)
        assert _indexed(tier) == _on_disk(tier.files.layout_dir)
        # The store's own file, moved back with its directory, is still taken for it.
        os.rename(fan, tmp_path / "copy-gone")
        await checks.next()  # retired
        if fan.exists():
            os.rmdir(fan)  # made again meanwhile: empty
        os.rename(tmp_path / "made-again", fan)
        await checks.next()  # opened and listed
        await _settled(tier)
        assert tier.contains(victim), "the page stored after the delete was not taken back with its directory"
        assert await _served(tier, victim, size)
        assert _indexed(tier) == _on_disk(tier.files.layout_dir)
    assert_clean(pool)
