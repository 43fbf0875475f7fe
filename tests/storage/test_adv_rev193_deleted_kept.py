"""Review 193: deletes beyond ``followpath.DELETED_KEPT`` no longer bring their pages back.

The tier remembers at most ``DELETED_KEPT`` deletes of keys whose file may lie in a directory away;
the oldest was forgotten beyond that, and when its directory came back the forgotten key's file
was indexed and served (stale KV; documented only as "the oldest forgotten first"). Now a
forgotten key is kept in a fixed filter of bits (no growth) with the time of its delete as a bound
for its fan-out directory: a listing unlinks a file of a key the filter may hold that is no newer
than that bound (a false positive is a miss, never stale data); other pages are indexed.

``DELETED_KEPT`` is lowered for the test (real deletes, real renames out and back)."""

from __future__ import annotations

import os
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
from aiokv.storage import DiskBackend, DiskTier, followpath

TAG = 0x3D
KEPT = 2


@pytest.mark.asyncio
async def test_deletes_forgotten_beyond_the_bound_stay_deleted(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(followpath, "DELETED_KEPT", KEPT)
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(8)]
    deleted, kept = keys[:5], keys[5:]
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as tier:
        checks = LockChecks(tier)
        for key in keys:
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        fan, away = tier.files.layout_dir / f"{TAG:02x}", tmp_path / "away"
        os.rename(fan, away)
        await checks.next()  # retired
        for key in deleted:
            await tier.delete(key)
        assert len(tier._deleted_away) == KEPT  # the oldest three forgotten
        assert not fan.exists()  # nothing written there since: not made again
        os.rename(away, fan)  # the old directory put back
        await checks.next()  # opened and listed
        await _settled(tier)
        for key in deleted:
            assert not tier.contains(key), f"deleted key {deleted.index(key)} was indexed from the old directory"
            assert not await _served(tier, key, size), "a deleted page was served"
            assert not (fan / key.hex()).exists()
        for key in kept:
            assert await _served(tier, key, size), "a page never deleted was lost"
        assert _indexed(tier) == _on_disk(tier.files.layout_dir)
    assert_clean(pool)
