"""Review 194: a fan-out directory whose listing fails part-way during a take-over (the follower's
look that took the lock) is listed again by the writer's periodic checks, as a late listing that
failed is (b2f9a21).

The take-over lists every directory the tier holds a descriptor of; a listing that failed there
was to be "listed again at the next look", but a tier that writes looks no more: the files the
follower had not seen (written by the other cache after its last look), past the failure, stayed
on disk outside the index and the budget, never served nor evicted, until a restart.

The fault is real: an ext4 whose directory block 5 of ``3b`` answers EIO (``listing_fs.py``: a
loop device over a FUSE file). Root only (FUSE, loop device)."""

from __future__ import annotations

from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from listing_fs import dir_blocks, listing_ext4
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _indexed, _on_disk, _settled
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind, ReadOnly

TAG = 0x3B
FILES = 1000
"""Page files of ``3b``: about 10 blocks of a directory without an index."""
BAD = 5


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_directory_the_take_over_listed_in_part_is_listed_again(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    with listing_ext4(tmp_path, 128) as fs:
        cfg = config(fs.mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            b = DiskTier(cfg, layout, pool)
            await b.start()
            try:
                assert a.read_only is None and b.read_only is ReadOnly.LOCKED
                looks = Looks(b)
                for i in range(FILES):
                    assert await a.write_from(key_of(i, TAG), memoryview(_bytes_of(key_of(i, TAG), size)))
                layout_dir = a.files.layout_dir
                fan = layout_dir / f"{TAG:02x}"
                assert dir_blocks(fan) > BAD + 2
            except BaseException:
                await b.aclose()
                raise
        # A closed: B's next look takes the directory over, its listing of 3b failing at block 5.
        try:
            fs.cold()
            fs.bad_block(fan, BAD)
            await looks.next()
            assert b.read_only is None and b.statistics().took_over == 1
            assert b.statistics().errors[ErrorKind.EIO] >= 1
            assert len(_indexed(b)) < FILES
            fs.good()
            checks = LockChecks(b)
            await checks.next()  # lists 3b again
            await _settled(b)
            assert _indexed(b) == _on_disk(layout_dir), "page files on disk outside the index after the take-over"
            assert b.statistics().listings_failed == 1
            buf = bytearray(size)
            for key in sorted(b._index):
                assert await b.read_into(key, memoryview(buf)) and buf == _bytes_of(key, size)
            await checks.next()  # nothing failed: no listing again
            await _settled(b)
            assert b._listings == {} and b._relist == {}
        finally:
            await b.aclose()
    assert_clean(pool)
