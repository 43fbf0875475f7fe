"""Adversarial (a review's leftover): ``DiskTier.close_within(seconds)`` said "I/O stuck in the kernel"
whenever its close had not ended within ``seconds``, with nothing in the kernel at all. Callers pass
what is left of their own bound (``CacheManager``'s and the adapters' stores' closes pass
``max(0, deadline - now)``: 0 once background jobs used it up), so a healthy tier was given up: its
queued write-behind pages were dropped (lost for nothing), "still stuck in the kernel" was logged,
the cache counted ``close_timeout`` and kept the pool mapped until ``io_ended``.

Now a close is given up only while the tier's I/O stalls (:data:`~aiokv.storage.disk.CLOSE_STALL_S`
without a request or a thread of the tier ending, past the budget): a healthy tier given 0 s closes
and writes out its queue; a frozen one (``fsfreeze``) given 0 s still returns False, within about
``CLOSE_STALL_S``, and drops its queue. Real tiers in a temporary directory, every backend; the frozen
case is root only, a watchdog thaws after THAW_S."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from disk_helpers import BIG, assert_clean, config, fill, key_of, page_files, payload, read_page, ready_pool, write_page
from fs_helpers import freeze, loop_ext4, thaw

from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage import disk as disk_module

QUEUED = 8
THAW_S = 20.0
MARGIN_S = 1.5


def _no_stuck_log(caplog: pytest.LogCaptureFixture) -> None:
    stuck = [r.getMessage() for r in caplog.records if "stuck" in r.getMessage()]
    assert stuck == [], stuck


@pytest.mark.asyncio
@pytest.mark.parametrize("seconds", [0, 0.0, 1e-9])
async def test_an_idle_tier_closes_within_a_zero_budget(tmp_path: Path, backend: DiskBackend, seconds: float,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Nothing queued, nothing in flight: the close is bounded CPU work, never "stuck"."""
    caplog.set_level(logging.INFO, logger="aiokv.storage.disk")
    with ready_pool(BIG, 8) as pool:
        tier = DiskTier(config(tmp_path / "disk", backend), BIG, pool)
        await tier.start()
        ok, _ = await write_page(tier, pool, 0)
        assert ok
        assert await tier.close_within(seconds) is True  # before: False, after 0 s
        assert tier.io_ended.done()
        assert tier not in disk_module._STUCK
        assert tier.statistics().dropped == 0
        _no_stuck_log(caplog)
        assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("seconds", [0.0, 1e-4])
async def test_a_healthy_tier_given_no_time_writes_out_its_queue(tmp_path: Path, backend: DiskBackend,
                                                                  seconds: float,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Pages queued for write-behind at a close with 0 s (or almost) left: the drain's writes
    complete, so it goes on to its end; every page is written (none dropped) and reads back
    bit-exact from a fresh tier."""
    caplog.set_level(logging.INFO, logger="aiokv.storage.disk")
    directory = tmp_path / "disk"
    with ready_pool(BIG, QUEUED + 1) as pool:
        tier = DiskTier(config(directory, backend, write_behind_depth=QUEUED), BIG, pool)
        await tier.start()
        written: dict[int, torch.Tensor] = {}
        for i in range(QUEUED):
            handle = fill(pool, key_of(i), i)
            written[i] = payload(pool, handle)
            assert tier.write_behind_nowait(key_of(i), handle)  # its reference is the tier's now
        assert tier.statistics().write_behind_queued > 0
        assert await tier.close_within(seconds) is True  # before: False, the queue dropped
        stats = tier.statistics()
        assert (stats.writes, stats.dropped) == (QUEUED, 0), stats
        assert tier.io_ended.done() and tier not in disk_module._STUCK
        _no_stuck_log(caplog)
        assert len(page_files(directory)) == QUEUED
        pool.table.evict(pool.num_pages)
        async with DiskTier(config(directory, backend), BIG, pool) as again:
            for i, data in written.items():
                got = await read_page(again, pool, i)
                assert got is not None and got.equal(data), i
        assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_frozen_tier_given_no_time_still_gives_up_within_the_stall_bound(
        tmp_path: Path, backend: DiskBackend) -> None:
    """The real stuck case with a zero budget: write-behind held by ``fsfreeze``. ``close_within(0)``
    returns False within about ``CLOSE_STALL_S`` (never waits for the thaw), drops the queue, and
    ``io_ended`` resolves once the thaw lets the stuck writes end."""
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    with ready_pool(BIG, QUEUED) as pool, loop_ext4(tmp_path, 24) as mount:
        tier = DiskTier(config(mount / "disk", backend, min_free_bytes=0), BIG, pool)
        await tier.start()
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        try:
            freeze(mount)
            watchdog.start()
            for i in range(QUEUED):
                assert tier.write_behind_nowait(key_of(i), fill(pool, key_of(i), i))
            async with asyncio.timeout(THAW_S / 2):
                while tier.statistics().in_flight == 0:  # noqa: ASYNC110 (a worker's write reaching the kernel)
                    await asyncio.sleep(0.01)
            began = time.perf_counter()
            closed = await tier.close_within(0)
            took = time.perf_counter() - began
            assert closed is False
            assert took < disk_module.CLOSE_STALL_S + MARGIN_S, f"close_within(0) took {took:.1f} s"
            assert not tier.io_ended.done() and tier in disk_module._STUCK
            thaw(mount)
            async with asyncio.timeout(THAW_S):
                await asyncio.shield(tier.io_ended)
            stats = tier.statistics()
            assert stats.dropped > 0 and stats.writes + stats.dropped == QUEUED, stats
        finally:
            watchdog.cancel()
            thaw(mount)
        assert_clean(pool)
