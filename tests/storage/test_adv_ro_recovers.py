"""Adversarial: a disk tier switched to read-only by EROFS (its file system remounted read-only under
it) left that mode never: after `mount -o remount,rw` no new page reached the disk until a restart,
while a full disk is rechecked every free_space_recheck_s and recovers (#11). Now the read-only switch
is rechecked the same way (fstatvfs ST_RDONLY) and writes resume. Root only.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from disk_helpers import BIG, assert_clean, config, key_of, read_page, ready_pool, write_page
from fs_helpers import loop_ext4, remount
from test_adv_cache_fs import LAYOUT, SLOTS, cache_config, disk_pages, offload_all, prompts

from aiokv import KVCache
from aiokv.storage import DiskBackend, DiskTier, ReadOnly


@pytest.mark.root
@pytest.mark.asyncio
async def test_read_only_switch_ends_after_remount_read_write(tmp_path: Path) -> None:
    kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    with loop_ext4(tmp_path, 24) as mount:
        async with KVCache(cache_config(mount / "kv"), LAYOUT, kv) as cache:  # free_space_recheck_s 0.2
            await offload_all(cache, kv, prompts(1, 10))
            await cache.flush()
            await asyncio.to_thread(remount, mount, "ro")
            await offload_all(cache, kv, prompts(2, 10))  # EROFS: the tier turns read-only
            await cache.flush()
            stats = cache.stats().disk
            assert stats is not None and stats.read_only is not None
            await asyncio.to_thread(remount, mount, "rw")
            await asyncio.sleep(2.0)  # ten rechecks
            before = disk_pages(cache)
            await offload_all(cache, kv, prompts(3, 10))
            await cache.flush()
            assert disk_pages(cache) > before, "no page reached the disk after remount,rw"


# -- the tier itself, on every backend -------------------------------------------------------------

RECHECK_S = 0.1
BOUND_S = 10.0


def _exists(path: str) -> bool:
    return os.path.exists(path)


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until ``condition()`` holds: the tier looks again every RECHECK_S on its own."""
    async with asyncio.timeout(BOUND_S):
        while not condition():  # noqa: ASYNC110 (a state of the tier, no event to wait on)
            await asyncio.sleep(RECHECK_S / 4)
    assert condition(), what


@pytest.mark.root
@pytest.mark.asyncio
async def test_tier_writes_again_after_remount_read_write_and_removes_what_read_only_kept(
        tmp_path: Path, backend: DiskBackend) -> None:
    """EROFS turns the tier read-only; a page deleted meanwhile keeps its file (nothing may be
    deleted). After ``remount,rw`` the tier sees it within a few rechecks: read_only is None again,
    that file is removed, new pages are written, old ones are served with their bytes."""
    with ready_pool(BIG, 8) as pool, loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, min_free_bytes=0, free_space_recheck_s=RECHECK_S)
        stored: dict[int, torch.Tensor] = {}
        async with DiskTier(cfg, BIG, pool) as tier:
            for i in range(4):
                ok, stored[i] = await write_page(tier, pool, i)
                assert ok
            await asyncio.to_thread(remount, mount, "ro")
            ok, _ = await write_page(tier, pool, 4)  # meets EROFS
            assert not ok
            assert tier.read_only is ReadOnly.FILE_SYSTEM
            deleted = tier.files.path(key_of(0))
            await tier.delete(key_of(0))
            assert _exists(deleted)  # read-only: kept (and no longer served)
            await asyncio.sleep(3 * RECHECK_S)
            assert tier.read_only is ReadOnly.FILE_SYSTEM  # still read-only: the rechecks see ST_RDONLY
            ok, _ = await write_page(tier, pool, 5)
            assert not ok

            await asyncio.to_thread(remount, mount, "rw")
            await _until(lambda: tier.read_only is None, "the tier stayed read-only after remount,rw")
            await _until(lambda: not _exists(deleted), "the file deleted while read-only stayed")
            for i in (6, 7):
                ok, stored[i] = await write_page(tier, pool, i)
                assert ok, "no page reached the disk after remount,rw"
                assert _exists(tier.files.path(key_of(i)))
            for i in (1, 2, 3, 6, 7):
                got = await read_page(tier, pool, i)
                assert got is not None and torch.equal(got, stored[i])
            assert await read_page(tier, pool, 0) is None
            stats = tier.statistics()
            assert stats.read_only is None and stats.pages == 5
        assert_clean(pool)
