"""Review 264: a fan-out directory holding indexed pages removed under the running tier (``rm -rf``)
and replaced by a symlink to a directory outside the cache that holds, under the very names of
those pages, page files that pass every check but the payload's owner (headers of those keys,
checksums of other bytes: forged valid files). Every backend. Then the tier reads each of those
keys, deletes some, evicts the rest by writing other fan-outs' keys past its budget, and writes new
keys of that fan-out.

What must hold: nothing is served from outside (a page served must be its key's own bytes, which
only the removed files had: so no page of those keys is served at all), nothing outside changes
(names, sizes, modification times, contents), the tier keeps serving other fan-outs right, and a
restart over the symlink refuses to start (``UnsafeDirectoryError``) rather than follow it."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import xxhash
from disk_helpers import assert_clean, config, key_of
from planted_helpers import snapshot as _snapshot
from test_adv_rev264_crafted_headers import _forge

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.pagefile import file_bytes
from aiokv.storage.safefiles import UnsafeDirectoryError

TAG, OTHER = 0x64, 0x65
VICTIMS = [key_of(i, TAG) for i in range(4)]


def _bytes_of(key: PageKey, size: int, salt: bytes = b"") -> bytes:
    return hashlib.shake_256(salt + key).digest(size)


async def _read(tier: DiskTier, key: PageKey, size: int) -> bytes | None:
    buf = bytearray(b"\x5a" * size)
    return bytes(buf) if await tier.read_into(key, memoryview(buf)) else None


def _forged_copy(src: Path, dst: Path, size: int, key: PageKey) -> None:
    shutil.copyfile(src, dst)
    forged = _bytes_of(key, size, b"forged")

    def swap(fields: list[object], body: bytearray) -> None:
        body[:size] = forged
        fields[7] = xxhash.xxh3_64_intdigest(forged)

    _forge(str(dst), swap)


@pytest.mark.asyncio
async def test_a_fanout_replaced_by_a_symlink_out_serves_and_touches_nothing_there(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    cfg = config(tmp_path / "disk", backend, capacity=6 * file_bytes(layout), follow_interval_s=3600.0,
                 min_free_bytes=0)
    async with DiskTier(cfg, layout, pool) as tier:
        for key in VICTIMS:
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        fan = tier.files.layout_dir / f"{TAG:02x}"
        for key in VICTIMS:
            _forged_copy(fan / key.hex(), outside / key.hex(), size, key)
        (outside / "bystander").write_bytes(b"not ours")
        shutil.rmtree(fan)
        os.symlink(outside, fan)
        before = _snapshot(outside)

        for key in VICTIMS[:2]:
            assert await _read(tier, key, size) is None, "a page was served through the symlinked fan-out"
        await tier.delete(VICTIMS[2])
        new = key_of(9, TAG)
        assert not await tier.write_from(new, memoryview(_bytes_of(new, size)))
        others = [key_of(i, OTHER) for i in range(8)]  # past the budget: evicts what is left of TAG
        for key in others:
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        await tier.flush()
        for key in [*VICTIMS, new]:
            assert not tier.contains(key) and await _read(tier, key, size) is None
        for key in others[-4:]:
            assert await _read(tier, key, size) == _bytes_of(key, size)
        assert _snapshot(outside) == before, "something outside the cache directory changed"
    assert _snapshot(outside) == before, "something outside the cache directory changed (at close)"
    with pytest.raises(UnsafeDirectoryError):
        async with DiskTier(cfg, layout, pool):
            pass
    assert _snapshot(outside) == before
    assert fan.is_symlink()
    assert_clean(pool)
