"""Review 202: a follower deleted a key; the writer then removed that page and stored the key again
before the follower's next look, and ext4 gave the new file the freed inode number. The looks
compare a known name by inode number only (no ``stat`` per entry), so they took the new page for
the one deleted: never indexed while following, and its name unlinked at the take-over (a valid
page lost). The names of keys the follower deleted are now examined whole (inode number and change
time: one ``stat`` each) whenever their directory is listed: the new page is told apart by its
change time and indexed (it is newer than the delete).

Real: a second writer deleting and storing for real on a fresh ext4 (loop device), where the freed
inode number is handed to the next file made; the reuse is checked, not assumed. Root only."""

from __future__ import annotations

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

TAG = 0x6E


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("then", ["following", "take_over"])
async def test_a_page_stored_again_under_a_reused_inode_after_a_follower_s_delete_is_kept(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, then: str) -> None:
    """``then``: the follower's next look follows the writer, or takes the directory over (the
    writer closed right after the new store): either way the new page is indexed and served."""
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(3)]
    victim = keys[0]
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, capacity=64 * size, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as b:
            for key in keys:
                assert await b.write_from(key, memoryview(_bytes_of(key, size)))
            name = b.files.layout_dir / f"{TAG:02x}" / victim.hex()
            async with started(DiskTier(cfg, layout, pool)) as a:
                assert a.read_only is ReadOnly.LOCKED and a.contains(victim)
                looks = Looks(a)
                await a.delete(victim)  # A's caller drops it: A never serves that page again
                inode = name.stat().st_ino
                _past_file_clock(mount / "probe")  # B's next file is newer than A's delete
                await b.delete(victim)
                assert await b.write_from(victim, memoryview(_bytes_of(victim, size)))  # before A's next look
                assert name.stat().st_ino == inode, "ext4 did not reuse the inode number (the case is not made)"
                if then == "take_over":
                    await b.aclose()
                await looks.next()
                if then == "take_over":
                    assert a.read_only is None and a.statistics().took_over == 1
                    await _settled(a)
                    assert name.exists(), "the take-over unlinked the page stored again (a valid page lost)"
                    assert _indexed(a) == _on_disk(a.files.layout_dir)
                assert a.contains(victim), "the page stored again under the reused inode was not indexed"
                assert await _served(a, victim, size)
                assert all([await _served(a, key, size) for key in keys[1:]])
    assert_clean(pool)
