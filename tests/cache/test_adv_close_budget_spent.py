"""Adversarial (a review's leftover): a cache whose background jobs use up the whole ``close_timeout``
gives its disk tier what is left of it, 0 s (``DiskTier.close_within(0)``). The tier, idle and
healthy, was then given up as if its I/O were stuck in the kernel: the close counted a second
``close_timeout`` ("disk I/O stuck in the kernel at close"), logged the tier's "still stuck" error
and left the pool mapped until the tier's ``io_ended``. Now only the background jobs are counted;
the tier closes (nothing of it is in the kernel), logs nothing of the kind, and the pool is freed
with the close. The job is one the manager tracks and nobody awaits (``CacheManager.track``, as an
abandoned copy is), held past the bound; the disk tier and its files are real."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, config, make_kv, prompt

from aiokv import KVCache

T = LAYOUT.page_tokens
CLOSE_S = 0.3


@pytest.mark.asyncio
async def test_background_jobs_that_use_up_close_timeout_leave_a_healthy_tier_closed_not_stuck(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    tokens = prompt(1, 6 * T)
    cache = KVCache(config(tmp_path / "disk", close_timeout=CLOSE_S), LAYOUT, make_kv(1))
    held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    try:
        await cache.start()
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(len(tokens)))
        await cache.flush()
        cache.manager.track(held, lambda: None)  # a job nobody awaits, running past the bound
        disk = cache.manager.disk
        assert disk is not None
        segment = cache.pool.memory.segment
        await cache.aclose()
        errors = cache.stats().errors
        assert errors.get("close_timeout") == 1, errors  # the job's; before: 2, the tier's too
        assert "close_failed" not in errors, errors
        assert disk.io_ended.done() and disk.statistics().dropped == 0
        assert segment.closed, "the pool was kept mapped as if disk I/O were stuck"
        stuck = [r.getMessage() for r in caplog.records if "stuck" in r.getMessage()]
        assert stuck == [], stuck
    finally:
        held.set_result(None)
        await cache.aclose()
    async with KVCache(config(tmp_path / "disk"), LAYOUT, make_kv(2)) as again:
        match = await again.match(tokens)
        assert match.disk_pages == len(tokens) // T, match
