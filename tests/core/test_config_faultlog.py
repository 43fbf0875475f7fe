"""The cache's configuration tree builds one fault log: the disk tier counts into the manager's."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from aiokv import CacheConfig, KVCache, KVLayout
from aiokv.storage import DiskConfig, ErrorKind

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens


@pytest.mark.asyncio
async def test_a_disk_fault_lands_in_the_managers_one_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"not a page")
    config = CacheConfig(
        cpu_bytes=2 * LAYOUT.page_bytes, pool_chunk_bytes=2 * LAYOUT.page_bytes, namespace="faultlog",
        disk=DiskConfig(directory=tmp_path / "disk", capacity_bytes=64 * (LAYOUT.page_bytes + 4096)),
    )
    kv = torch.randn(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim).to(LAYOUT.dtype)
    first, second = list(range(2 * T)), list(range(1000, 1000 + 2 * T))
    async with KVCache(config, LAYOUT, kv) as cache:
        assert cache.disk is not None
        await cache.pool.wait_ready()
        await cache.offload(first, torch.arange(2 * T))
        await cache.flush()
        await cache.offload(second, torch.arange(2 * T, 4 * T))  # evicts `first` from the 2-page pool
        await cache.flush()
        # A real fault: symlinks planted where `first`'s page files are (never followed: UNSAFE).
        for key in cache.keys(first):
            path = cache.disk.files.path(key)
            os.unlink(path)
            os.symlink(outside, path)
        caplog.set_level(logging.WARNING)
        match = await cache.match(first)
        assert match.disk_pages == 2  # the index cannot know yet
        loaded = await cache.load(match, torch.arange(4 * T, 4 * T + match.tokens))
        assert loaded.tokens == 0
        faults = cache.manager.faults["disk_unsafe"]
        assert faults >= 1  # counted in the manager's own log, not in a second one of the tier's
        assert cache.disk.statistics().errors[ErrorKind.UNSAFE] == faults
        stats = cache.stats()
        assert stats.errors["disk_unsafe"] == faults
        assert stats.errors["disk_eio"] == 0  # every disk kind is reported, zeros included
        assert stats.pool_reserved == 0 and stats.pool_referenced == 0
        # Logged once, by the one log, however many faults of the kind were counted.
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "disk_unsafe" in r.getMessage()]
        assert len(warned) == 1
    assert outside.read_bytes() == b"not a page"
