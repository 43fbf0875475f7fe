"""Review 264: names that ``bytes.fromhex`` decodes but that are not a key's name. The scan
(``layoutdir.list_fanout``, shared by a start, a late listing and the follower's looks) took any
32-character name ``bytes.fromhex`` accepted: upper-case hex (``64AB…``: the key ``64ab…``, whose
file the tier then opens, evicts and deletes under the lower-case name) and hex pairs with spaces
(``64 00 00 …``: an 11-byte "key"). Planted (a copy, a backup tool, another program), such files
were indexed as pages: counted in ``pages`` and in the budget, evicted in place of real pages, and
their eviction unlinked a name that does not exist, so they stayed on disk outside the budget and
took its room again at every start. Now only a key's own name (``key.hex()``) is taken; anything
else is not a page file of ours and is left alone, as any other name is."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.pagefile import file_bytes

REAL = key_of(0xAB, 0x64)
UPPER = key_of(0xCD, 0x64)  # only an upper-case copy of its file is planted
PLANTED = ["64" + " 00" * 9 + f" {i:02x}" for i in range(3)] + [UPPER.hex().upper()]


@pytest.mark.asyncio
async def test_only_a_keys_own_name_is_indexed(tmp_path: Path, backend: DiskBackend, layout: KVLayout,
                                               pool: PagePool) -> None:
    size = layout.page_bytes
    cfg = config(tmp_path / "disk", backend, 4 * file_bytes(layout), min_free_bytes=0)
    async with DiskTier(cfg, layout, pool) as tier:
        assert await tier.write_from(REAL, memoryview(b"\x01" * size))
        assert await tier.write_from(UPPER, memoryview(b"\x02" * size))
        fan = tier.files.layout_dir / "64"
    for name in PLANTED[:3]:
        shutil.copyfile(fan / REAL.hex(), fan / name)
    (fan / UPPER.hex()).rename(fan / UPPER.hex().upper())
    async with DiskTier(cfg, layout, pool) as tier:
        stats = tier.statistics()
        assert (stats.pages, stats.bytes_stored) == (1, file_bytes(layout)), stats
        assert all(len(key) == 16 for key in tier._index), "a name of another length was indexed"
        assert not tier.contains(UPPER)
        for i in range(3):  # the budget's other three files: no real page evicted for them
            assert await tier.write_from(key_of(i, 0x65), memoryview(bytes([i]) * size))
        assert tier.statistics().evictions == 0, tier.statistics()
        buf = bytearray(size)
        assert await tier.read_into(REAL, memoryview(buf)) and buf == b"\x01" * size
    assert sorted(p.name for p in fan.iterdir()) == sorted([*PLANTED, REAL.hex()]), "a planted file was touched"
    assert_clean(pool)
