"""Review 303: once ``DiskTier.close_within`` gave a close up as stuck in the kernel (False; the
cache counts ``close_timeout``), a failure of that close once the I/O ended was retrieved and
dropped: logged nowhere, counted nowhere. Now it is logged and counted ``close_failed`` in the
tier's fault log (the cache's, shared: ``KVCache.stats().errors`` after the close), once however
many calls gave up on that close.

Real: the close held in the kernel by a frozen loop-mounted ext4 (write-behind stuck in it). The
failure after the thaw is injected (an ``OSError`` at the end of the tier's close): no real fault
makes a close of a thawed tier raise (its steps count their I/O faults, they do not raise them; an
ext4 shut down while frozen fails the stuck writes, counted ``disk_eio``, not the close).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import shutil
import threading
from pathlib import Path

import pytest
import torch
from disk_helpers import BIG, config, fill, key_of, ready_pool
from fs_helpers import freeze, loop_ext4, thaw
from loop_probes import no_loop_reports, until_thread
from test_adv_cache_fs import LAYOUT, SLOTS, cache_config, offload_all, prompts

from aiokv import DiskBackend, KVCache
from aiokv.faults import FaultLog
from aiokv.storage import DiskTier

THAW_S = 30.0
CLOSE_S = 1.0
LATE = "failed later"


def _fail_after_the_close(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every tier's close runs to its end, then raises EIO; returns the ids of the closes run."""
    runs: list[int] = []
    real_close = DiskTier._close

    async def failing_close(self: DiskTier) -> None:
        runs.append(id(self))  # an id: a reference would keep the tier alive
        await real_close(self)  # held while the file system is frozen
        raise OSError(errno.EIO, "EIO at the end of the tier's close (injected)")

    monkeypatch.setattr(DiskTier, "_close", failing_close)
    return runs


def _late_reports(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aiokv.storage.disk" and LATE in r.getMessage()]


@pytest.mark.root
@pytest.mark.asyncio
async def test_the_cache_counts_a_failure_of_the_tier_close_it_gave_up_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    caplog.set_level(logging.WARNING)
    runs = _fail_after_the_close(monkeypatch)
    kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = cache_config(mount / "kv")
        assert cfg.disk is not None
        cfg = dataclasses.replace(cfg, close_timeout=CLOSE_S)
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))  # nothing stays frozen on a failure
        cache = KVCache(cfg, LAYOUT, kv)
        try:
            await cache.start()
            disk = cache.disk
            assert disk is not None
            await offload_all(cache, kv, prompts(1, 10))
            await cache.flush()
            freeze(mount)
            watchdog.start()
            await offload_all(cache, kv, prompts(2, 8))  # write-behind held in the kernel
            await until_thread(lambda: disk.statistics().in_flight > 0, "a write held by the freeze", THAW_S)
            async with no_loop_reports("the given-up close's failure reached the loop"):
                await cache.aclose()  # gives the tier's close up as stuck
                errors = cache.stats().errors
                assert errors.get("close_timeout", 0) >= 1 and errors.get("close_failed", 0) == 0, errors
                assert not disk.io_ended.done(), "the tier's close ended while the file system was frozen"
                thaw(mount)
                async with asyncio.timeout(THAW_S):
                    await asyncio.shield(disk.io_ended)  # the close ran to its end, then failed
                await until_thread(lambda: cache.stats().errors.get("close_failed", 0) > 0,
                                   "the late failure counted", THAW_S)
                await cache.aclose()  # again: returns at once, counts nothing again
            assert cache.stats().errors.get("close_failed") == 1, cache.stats().errors
            assert len(runs) == 1, "the tier's close ran again"
            late = _late_reports(caplog)
            assert len(late) == 1 and "EIO" in late[0], late
        finally:
            watchdog.cancel()
            thaw(mount)
            async with asyncio.timeout(THAW_S):
                await cache.aclose()


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_tier_counts_a_late_close_failure_once_however_many_calls_gave_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Two ``close_within`` calls give up on the one close: each leaves its wait unawaited, both
    see the same failure; counted once, in the fault log the tier was given."""
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    caplog.set_level(logging.WARNING)
    _fail_after_the_close(monkeypatch)
    faults = FaultLog(logging.getLogger("aiokv.cache"))
    with ready_pool(BIG, 8) as pool, loop_ext4(tmp_path, 24) as mount:
        tier = DiskTier(config(mount / "disk", DiskBackend.THREADS, min_free_bytes=0), BIG, pool, faults)
        await tier.start()
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        try:
            freeze(mount)
            watchdog.start()
            for i in range(8):
                assert tier.write_behind_nowait(key_of(i), fill(pool, key_of(i), i))
            await until_thread(lambda: tier.statistics().in_flight > 0, "a write held by the freeze", THAW_S)
            async with no_loop_reports("the given-up close's failure reached the loop"):
                assert await tier.close_within(CLOSE_S) is False
                assert await tier.close_within(0) is False
                assert faults["close_failed"] == 0
                thaw(mount)
                async with asyncio.timeout(THAW_S):
                    await asyncio.shield(tier.io_ended)
                await until_thread(lambda: faults["close_failed"] > 0, "the late failure counted", THAW_S)
                with pytest.raises(OSError, match="injected"):
                    await tier.aclose()  # a caller that waits sees the failure itself
            assert faults["close_failed"] == 1, faults.counts()
            assert len(_late_reports(caplog)) == 1, _late_reports(caplog)
        finally:
            watchdog.cancel()
            thaw(mount)
