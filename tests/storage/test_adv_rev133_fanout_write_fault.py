"""Adversarial (review 133): a write whose fan-out directory cannot be opened when it needs it (one
that could not be opened at start, then found deleted, or a symlink planted there) is a fault of
that write, counted by its kind and logged once per kind, as the read path counts it.

Before, ``_write_slot`` passed no error on to ``_write_failed``, so the write ended as a bug: a
planted symlink counted ``disk_other`` instead of ``disk_unsafe``, and every such write logged
"unexpected failure in write" with a traceback at ERROR (a randomized campaign that deleted fan-out
directories while a restarted cache scanned them printed one per write into that directory). The
same held for the victim of a recycling write. Every backend.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, fill, key_of
from test_fanout_opened_late import _as_unopened_at_start

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind

UNEXPECTED = "unexpected failure"


def _unexpected(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if UNEXPECTED in r.getMessage()]


async def _write(tier: DiskTier, pool: PagePool, i: int, tag: int) -> bool:
    h = fill(pool, key_of(i, tag), i)
    try:
        return await tier.write(key_of(i, tag), h)
    finally:
        pool.table.release(h)


@pytest.mark.asyncio
async def test_a_write_into_a_symlinked_fan_out_counts_unsafe_not_a_bug(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        caplog: pytest.LogCaptureFixture) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    caplog.set_level(logging.WARNING)
    async with DiskTier(config(tmp_path / "disk", backend), layout, pool) as tier:
        fan = tier.files.layout_dir / "05"
        _as_unopened_at_start(tier, 5)
        os.rmdir(fan)
        os.symlink(outside, fan)
        before = tier.statistics().errors
        assert not await _write(tier, pool, 1, 5)
        after = tier.statistics().errors
        assert after[ErrorKind.UNSAFE] == before[ErrorKind.UNSAFE] + 1, after
        assert after[ErrorKind.OTHER] == before[ErrorKind.OTHER], after
        assert _unexpected(caplog) == []
        assert os.listdir(outside) == []
        assert await _write(tier, pool, 2, 6)  # other fan-outs write on
    assert_clean(pool)


@pytest.mark.asyncio
async def test_writes_into_a_deleted_fan_out_make_it_again(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        caplog: pytest.LogCaptureFixture) -> None:
    # Until test_fanout_removed's fix these writes were counted faults (OTHER, ENOENT) until the
    # directory was made by hand; a writing tier now makes it again (0700, checked) and writes.
    caplog.set_level(logging.WARNING)
    async with DiskTier(config(tmp_path / "disk", backend), layout, pool) as tier:
        fan = tier.files.layout_dir / "07"
        _as_unopened_at_start(tier, 7)
        shutil.rmtree(fan)  # removed by someone else (what the start met, or after it)
        before = tier.statistics().errors
        for i in range(3):
            assert await _write(tier, pool, i, 7)
        assert tier.statistics().errors == before
        assert _unexpected(caplog) == []
        assert fan.is_dir() and not fan.is_symlink() and fan.stat().st_mode & 0o777 == 0o700
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_recycling_write_whose_victim_fan_out_is_gone_is_a_counted_fault(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    # Room for two page files: the third write recycles the least recently used one's file.
    capacity = 2 * (layout.page_bytes + 4096)
    async with DiskTier(config(tmp_path / "disk", backend, capacity=capacity), layout, pool) as tier:
        assert await _write(tier, pool, 1, 9)  # the victim, in fan-out 09
        assert await _write(tier, pool, 2, 10)
        _as_unopened_at_start(tier, 9)
        shutil.rmtree(tier.files.layout_dir / "09")
        await _write(tier, pool, 3, 11)  # stored or not, never a bug
        await tier.flush()
        assert _unexpected(caplog) == []
        assert await _write(tier, pool, 4, 12)  # the tier writes on
    assert_clean(pool)
