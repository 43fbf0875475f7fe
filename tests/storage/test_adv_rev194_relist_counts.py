"""Review 194: a fan-out directory whose late listing keeps failing is counted once in
``skipped_at_scan`` (its entries that could not be examined, and itself), however often it is
listed again; each listing that fails is counted in ``listings_failed``.

Before, every listing again (b2f9a21: after 1, 2, 4 ... checks, for as long as it fails) added the
directory and its unexamined entries to ``skipped_at_scan`` once more, a count documented as what
could not be read at start. The fault is real: an ext4 whose directory block 2 of ``3c`` answers
EIO (``listing_fs.py``: a loop device over a FUSE file). Root only (FUSE, loop device)."""

from __future__ import annotations

from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from listing_fs import dir_blocks, listing_ext4
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

TAG = 0x3C
FILES = 500
"""Page files of ``3c``: about 5 blocks of a directory without an index."""
BAD = 2


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_directory_listed_again_is_counted_skipped_once(tmp_path: Path, backend: DiskBackend,
                                                                layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    with listing_ext4(tmp_path, 128) as fs:
        cfg = config(fs.mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            for i in range(FILES):
                assert await tier.write_from(key_of(i, TAG), memoryview(_bytes_of(key_of(i, TAG), size)))
            fan = tier.files.layout_dir / f"{TAG:02x}"
        assert dir_blocks(fan) > BAD + 1
        fs.cold()
        fs.bad_block(fan, BAD)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            assert tier._dir is not None and tier._dir.fanout[TAG] < 0  # the start's listing failed
            at_start = tier.statistics().skipped_at_scan
            assert at_start >= 1
            checks = LockChecks(tier)
            await checks.next()  # 3c opened and listed late: fails (its first late listing)
            await _settled(tier)
            assert tier.statistics().listings_failed == 1
            first = tier.statistics().skipped_at_scan
            assert first >= at_start
            # Listed again after 1, then 2 checks: fails each time.
            for _ in range(6):
                await checks.next()
                await _settled(tier)
            stats = tier.statistics()
            assert stats.listings_failed >= 3, stats
            assert stats.skipped_at_scan == first, (
                f"skipped_at_scan grew from {first} to {stats.skipped_at_scan} over "
                f"{stats.listings_failed - 1} listings again of one directory")
            fs.good()
    assert_clean(pool)
