"""Adversarial (a review's leftover, beside ``test_adv_close_budget_spent``): a cache whose background
jobs use up the whole ``close_timeout`` gave its rates save at close what was left of it, 0 s. A
healthy save (milliseconds on a real file system) was then counted ``rates_not_saved`` ("rates file
still being written at close") although nothing was wrong, and left to land unwaited (here it did,
during the tier's close). Now the close waits for its save at least
``RATES_CLOSE_WAIT_S`` (as the disk tier's close gets ``CLOSE_STALL_S``): the healthy save lands
before the close returns, uncounted. A save held in the kernel (a frozen file system, root) still
does not hang the close: given up past that wait, counted, left to end in its thread; counted once,
even where it fails there later (it was counted again by the save itself).

The job is one the manager tracks and nobody awaits (``CacheManager.track``, as an abandoned copy
is), held past the bound; the disk tier, its file system and the rates file are real."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from pathlib import Path

import pytest
from cache_helpers import DEVICE, LAYOUT, make_kv
from loop_probes import until_thread, waiting_in

from aiokv import CacheConfig, KVCache
from aiokv.manager import RATES_CLOSE_WAIT_S
from aiokv.rates_file import RATES_FILE, RATES_TEMP, decode_rates
from aiokv.storage import DiskConfig
from aiokv.storage.disk import CLOSE_STALL_S

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw

CLOSE_S = 0.3
PAGE = LAYOUT.page_bytes
FIRST_S, LAST_S = 0.010, 0.002
"""Seconds per page read taught before and after the last save: the files are told apart by their rate."""


def _config(root: Path) -> CacheConfig:
    disk = DiskConfig(directory=root, capacity_bytes=16 * (PAGE + 4096), min_free_bytes=0)
    return CacheConfig(cpu_bytes=8 * PAGE, disk=disk, namespace="test-model", pool_chunk_bytes=4 * PAGE,
                       close_timeout=CLOSE_S)


def _disk_rate(path: Path) -> float:
    return decode_rates(path.read_bytes(), LAYOUT.fingerprint.hex(), DEVICE.type).rates["disk"][0]


async def _taught_since_the_last_save(cache: KVCache) -> Path:
    """Rates saved once (FIRST_S), then a later measurement (LAST_S) left for the close to save (the
    next background save is not due for RATES_SAVE_INTERVAL_S); a job held past the bound tracked.
    Returns the rates file."""
    await cache.start()
    await cache.pool.wait_ready()
    for _ in range(8):
        cache.manager.costs.disk.update(PAGE, FIRST_S)
    await cache.flush()
    assert cache.disk is not None
    rates = cache.disk.files.layout_dir / RATES_FILE
    assert _disk_rate(rates) == pytest.approx(PAGE / FIRST_S, rel=0.05), "the first save did not land"
    for _ in range(8):
        cache.manager.costs.disk.update(PAGE, LAST_S)
    assert cache.stats().background_jobs == 0, "a save due now would not be the close's"
    return rates


@pytest.mark.asyncio
async def test_background_jobs_that_use_up_close_timeout_leave_a_healthy_rates_save_done_uncounted(
        tmp_path: Path) -> None:
    cache = KVCache(_config(tmp_path / "disk"), LAYOUT, make_kv(1))
    held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    try:
        rates = await _taught_since_the_last_save(cache)
        learned = cache.manager.costs.disk.rate
        assert learned is not None and learned > 1.5 * PAGE / FIRST_S
        cache.manager.track(held, lambda: None)  # a job nobody awaits, running past the bound
        await cache.aclose()
        errors = cache.stats().errors
        assert errors.get("close_timeout") == 1, errors  # the job's
        assert "rates_not_saved" not in errors, errors  # before: "still being written at close"
        # Saved before the close returned (awaited now; before, it landed unwaited, here during the tier's close).
        assert _disk_rate(rates) == pytest.approx(learned), "the rates learned since the last save were lost"
    finally:
        held.set_result(None)
        await cache.aclose()
    async with KVCache(_config(tmp_path / "disk"), LAYOUT, make_kv(2)) as again:
        assert again.manager.costs.disk.rate == pytest.approx(learned)
        assert "rates_ignored" not in again.stats().errors


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_save_held_in_the_kernel_with_the_budget_spent_keeps_the_close_bounded(tmp_path: Path) -> None:
    """The file system frozen (its writes held in the kernel) at the close: the save waited for at
    least RATES_CLOSE_WAIT_S is given up past it, counted, and the close returns."""
    with loop_ext4(tmp_path, 16) as mount:
        cache = KVCache(_config(mount / "kv"), LAYOUT, make_kv(1))
        held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            rates = await _taught_since_the_last_save(cache)
            cache.manager.track(held, lambda: None)
            freeze(mount)
            started = time.monotonic()
            await cache.aclose()
            close_s = time.monotonic() - started
            errors = cache.stats().errors
            # Within the jobs' bound, then the save's wait side by side with the tier's stall bound.
            assert close_s < CLOSE_S + max(RATES_CLOSE_WAIT_S, CLOSE_STALL_S) + 2.0, close_s
            assert errors.get("rates_not_saved") == 1, errors
            assert _disk_rate(rates) == pytest.approx(PAGE / FIRST_S, rel=0.05)  # not replaced while frozen
        finally:
            thaw(mount)
            held.set_result(None)
            await cache.aclose()
        # Thawed: the held save goes on in its thread and ends, leaving no temporary file.
        await until_thread(lambda: not any(t.name == "aiokv-rates" for t in threading.enumerate())
                           and not any(p.name.startswith(RATES_TEMP) for p in rates.parent.iterdir()),
                           "a rates thread or a temporary rates file was left", timeout_s=10.0)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_save_given_up_at_close_that_fails_once_thawed_is_counted_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The save given up at the close (counted there) fails later in its thread: thawed, its rename
    meets a directory planted at the rates file's name (EISDIR). It was counted a second time by
    the save itself (``rates_not_saved`` 2 for one save); now once, its failure logged (info)."""
    caplog.set_level(logging.INFO, logger="aiokv.cache")
    with loop_ext4(tmp_path, 16) as mount:
        cache = KVCache(_config(mount / "kv"), LAYOUT, make_kv(1))
        held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            rates = await _taught_since_the_last_save(cache)
            rates.unlink()
            rates.mkdir()  # the save's rename over it fails (EISDIR) once the file system is thawed
            cache.manager.track(held, lambda: None)
            freeze(mount)
            await cache.aclose()
            assert cache.stats().errors.get("rates_not_saved") == 1, cache.stats().errors  # given up, counted
            saves = [t for t in asyncio.all_tasks() if waiting_in(t, "_save_rates")]
            assert len(saves) == 1, saves  # the given-up save, still held in the kernel
        finally:
            thaw(mount)
            held.set_result(None)
            await cache.aclose()
        done, _ = await asyncio.wait(saves, timeout=10.0)
        assert done, "the given-up save did not end once thawed"
        assert rates.is_dir()
        assert cache.stats().errors.get("rates_not_saved") == 1, cache.stats().errors  # was 2
        failed = [r.getMessage() for r in caplog.records if "the save the close gave up" in r.getMessage()]
        assert len(failed) == 1 and "Is a directory" in failed[0], failed  # it did fail, in its thread
        await until_thread(lambda: not any(t.name == "aiokv-rates" for t in threading.enumerate()),
                           "a rates thread was left", timeout_s=10.0)
