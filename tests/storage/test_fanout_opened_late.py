"""A fan-out directory that could not be opened at start is opened when first needed, with the
same checks, and never reached through a path: names used to be resolved from the layout
directory as ``xx/<key>``, where ``O_NOFOLLOW`` guards only the last component, so a symlink
planted at ``xx`` led reads and writes outside the cache. Every backend."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, payload, reserve

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind


def _as_unopened_at_start(tier: DiskTier, index: int) -> None:
    """The state a fault at start leaves (``layoutdir._scan_fanout``: the directory could not be
    opened or read): no descriptor for fan-out ``index``."""
    assert tier._dir is not None
    os.close(tier._dir.fanout[index])
    tier._dir.fanout[index] = -1


@pytest.mark.asyncio
async def test_a_symlink_planted_at_a_fan_out_directory_opened_late_is_refused(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    disk_dir = tmp_path / "disk"
    outside = tmp_path / "outside"
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        h = fill(pool, key_of(1), 1)
        want = payload(pool, h)
        assert await tier.write(key_of(1), h)
        pool.table.release(h)
        pool.table.evict(pool.num_pages)
        fan = tier.files.layout_dir / "00"
        _as_unopened_at_start(tier, 0)
        os.rename(fan, outside)  # the page file, valid, now outside the cache
        os.symlink(outside, fan)
        before = sorted(os.listdir(outside))
        into = reserve(pool, key_of(100))
        assert not await tier.read(key_of(1), into)  # a counted miss, never the bytes outside
        pool.table.abort(into)
        assert tier.statistics().errors[ErrorKind.UNSAFE] >= 1
        h = fill(pool, key_of(2), 2)
        assert not await tier.write(key_of(2), h)  # nothing written through the symlink
        pool.table.release(h)
        await tier.flush()
        assert sorted(os.listdir(outside)) == before
        # The real directory back: the next operation opens it (checked) and the tier serves it again.
        os.unlink(fan)
        os.rename(outside, fan)
        h = fill(pool, key_of(3), 3)
        want3 = payload(pool, h)
        assert await tier.write(key_of(3), h)
        pool.table.release(h)
        pool.table.evict(pool.num_pages)
        into = reserve(pool, key_of(101))
        assert await tier.read(key_of(3), into)
        assert torch.equal(payload(pool, into), want3)
        pool.table.abort(into)
        assert not torch.equal(want, want3)
    assert_clean(pool)
