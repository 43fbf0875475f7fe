"""A key the caller deleted while its fan-out directory was away (moved out of the cache and
retired by the writer's check) does not come back when the directory is put back: its file there
(the one the delete was meant for) is unlinked by the late listing, not indexed. Before, the
delete found nothing indexed and did nothing, and the listing indexed the file again: ``read``
served the deleted page (stale KV where the caller deleted it as invalid). A key stored after the
delete is served as usual, and the directory's other keys come back.

Real faults: ``os.rename`` of the fan-out directory out of the layout directory and back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _indexed, _on_disk, _settled
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

TAG = 0x3A


@pytest.mark.asyncio
async def test_a_key_deleted_while_its_directory_was_away_stays_deleted(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(4)]
    deleted, kept = keys[:2], keys[2:]
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as tier:
        checks = LockChecks(tier)
        for key in keys:
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        fan, away = tier.files.layout_dir / f"{TAG:02x}", tmp_path / "away"
        os.rename(fan, away)
        await checks.next()  # retired: its keys out of the index
        assert not any(tier.contains(key) for key in keys)
        for key in deleted:
            await tier.delete(key)
        os.rename(away, fan)
        await checks.next()  # opened again and listed
        await _settled(tier)
        buf = bytearray(size)
        for key in deleted:
            assert not tier.contains(key)
            assert not await tier.read_into(key, memoryview(buf)), "a deleted page was served"
            assert not (fan / key.hex()).exists()
        for key in kept:
            assert await tier.read_into(key, memoryview(buf)) and buf == _bytes_of(key, size)
        assert _indexed(tier) == _on_disk(tier.files.layout_dir)
        new = bytes(reversed(_bytes_of(deleted[0], size)))
        assert await tier.write_from(deleted[0], memoryview(new))  # stored anew after the delete
        assert await tier.read_into(deleted[0], memoryview(buf)) and buf == new
    async with started(DiskTier(cfg, layout, pool)) as again:
        assert _indexed(again) == {key.hex() for key in [deleted[0], *kept]}
    assert_clean(pool)
