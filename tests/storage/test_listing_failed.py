"""A listing of a fan-out directory opened late that fails part-way is listed again at the
writer's periodic check (``follow_interval_s``), until one completes: the files after the failure
are indexed (served, counted in the budget, evicted) rather than left on disk outside the index
until a restart, where a budget they exceed stays exceeded.

The fault is real: an ext4 whose directory block 5 of ``3a`` answers EIO (``listing_fs.py``: a
loop device over a FUSE file), so ``getdents`` fails after the entries of blocks 0-4. The start's
scan meets it (``3a`` is left without a descriptor), the writer's first check opens and lists it
again, which fails again. Then the block reads again. Before: nothing listed ``3a`` again (the
files after block 5 were neither indexed nor removed: 1,000 page files on disk over a budget of
600). Now the next check lists it: the newest files within the free room are indexed, the older
ones unlinked, every byte served is its key's, and ``listings_failed`` counts the failed listing;
a key deleted meanwhile whose name lies past the bad block stays deleted.
Root only (FUSE, loop device)."""

from __future__ import annotations

from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from listing_fs import dir_blocks, listing_ext4
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _indexed, _on_disk, _settled
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage.pagefile import file_bytes

TAG = 0x3A
FILES = 1000
"""Page files of ``3a``: about 10 blocks of a directory without an index."""
BAD = 5
BUDGET = 600
"""Page files the restarted tier's budget holds."""


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_listing_that_failed_part_way_is_listed_again(tmp_path: Path, backend: DiskBackend,
                                                             layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    with listing_ext4(tmp_path, 128) as fs:
        cfg = config(fs.mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            for i in range(FILES):
                assert await tier.write_from(key_of(i, TAG), memoryview(_bytes_of(key_of(i, TAG), size)))
            layout_dir = tier.files.layout_dir
        fan = layout_dir / f"{TAG:02x}"
        assert dir_blocks(fan) > BAD + 2
        fs.cold()
        fs.bad_block(fan, BAD)
        small = config(fs.mount / "disk", backend, BUDGET * file_bytes(layout), follow_interval_s=3600.0,
                       min_free_bytes=0)
        async with started(DiskTier(small, layout, pool)) as tier:
            assert tier._dir is not None and tier._dir.fanout[TAG] < 0  # the start's listing failed
            first = tier.statistics().pages
            assert 0 < first < BUDGET
            checks = LockChecks(tier)
            await checks.next()  # 3a opened and listed again on its thread: fails again
            await _settled(tier)
            assert tier._dir.fanout[TAG] >= 0
            assert tier.statistics().pages == first
            assert tier.statistics().errors[ErrorKind.EIO] >= 2
            # The newest key not listed (it would be indexed by the next listing), deleted now:
            # its name lies past the bad block (the unlink may fail with EIO), yet it stays deleted.
            unlisted = max(i for i in range(FILES) if not tier.contains(key_of(i, TAG)))
            await tier.delete(key_of(unlisted, TAG))
            fs.good()
            await checks.next()
            await _settled(tier)
            stats = tier.statistics()
            assert _indexed(tier) == _on_disk(layout_dir), "page files on disk outside the index"
            assert stats.pages == BUDGET, stats
            assert stats.bytes_stored <= small.capacity_bytes
            assert stats.listings_failed == 1, stats
            assert not tier.contains(key_of(unlisted, TAG)), "a deleted page was indexed"
            assert not (fan / key_of(unlisted, TAG).hex()).exists()
            buf = bytearray(size)
            for key in sorted(tier._index):
                assert await tier.read_into(key, memoryview(buf)) and buf == _bytes_of(key, size)
            await checks.next()  # nothing failed: no listing again
            await _settled(tier)
            assert tier._listings == {}
        assert len(_on_disk(layout_dir)) == BUDGET
    assert_clean(pool)


