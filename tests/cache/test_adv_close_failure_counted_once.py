"""One failure of the disk tier's close is counted once, whichever of the tier and the cache's
manager sees it first.

Sequence (helper 303): the cache's close waits for its rates save (held in the kernel) while the
tier's ``close_within`` gives up on the tier's close (stuck behind write-behind held in the
kernel); the close's task alone is then cut; thawed, the tier's close fails and the tier counts
``close_failed`` (8e0a9d9); ``aclose()`` runs the cache's close anew, whose ``close_within`` raises
that same failure, and the manager counted it again: ``close_failed`` 2 for one failure.

Real: a frozen loop-mounted ext4 holds write-behind and the save; the failure at the end of the
tier's close is injected (an ``OSError``: no real fault of a healthy close makes it fail, reviews
300 and 303)."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import sys
import threading
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, make_kv, prompt
from loop_probes import no_loop_reports, until, until_thread, waiting_in
from test_adv_rates_save_budget_spent import _config, _taught_since_the_last_save

import aiokv.manager
from aiokv import KVCache
from aiokv.storage.disk import DiskTier

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw

BOUND_S = 30.0
T = LAYOUT.page_tokens


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_tier_close_failure_seen_by_the_tier_and_by_the_close_run_anew_counts_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_close = DiskTier._close

    async def failing_close(self: DiskTier) -> None:
        await real_close(self)  # held while the file system is frozen
        raise OSError(errno.EIO, "EIO at the end of the tier's close (injected)")

    monkeypatch.setattr(DiskTier, "_close", failing_close)
    # The close keeps waiting for the held save well past the tier's give-up (CLOSE_STALL_S).
    monkeypatch.setattr(aiokv.manager, "RATES_CLOSE_WAIT_S", BOUND_S)
    with loop_ext4(tmp_path, 16) as mount:
        cfg = dataclasses.replace(_config(mount / "kv"), close_timeout=0.1)
        cache = KVCache(cfg, LAYOUT, make_kv(1))
        watchdog = threading.Timer(2 * BOUND_S, thaw, args=(mount,))
        frozen = False
        try:
            async with no_loop_reports("a close failure counted by the tier and by the close run anew") as reports:
                await _taught_since_the_last_save(cache)  # the close's save has rates to write
                manager, disk = cache.manager, cache.disk
                assert disk is not None
                freeze(mount)
                frozen = True
                watchdog.start()
                tokens = prompt(2, 4 * T)
                await cache.offload(tokens, torch.arange(len(tokens)))  # write-behind held in the kernel
                await until_thread(lambda: disk.statistics().in_flight > 0, "a write held by the freeze", BOUND_S)
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(cache.aclose(), 0.2)  # the close's task goes on (shielded)
                first = manager._close_task
                assert first is not None
                closing = [t for t in asyncio.all_tasks() if waiting_in(t, "close_within")]
                assert len(closing) == 1
                async with asyncio.timeout(BOUND_S):
                    await asyncio.wait(closing)  # given up: the tier's close stuck
                assert closing[0].result() is False
                assert not first.done() and waiting_in(first, "wait"), "the close no longer waits for the save"
                first.cancel()  # the close's task alone, while it waits for the save
                await until(lambda: first.done(), turns=1_000_000)
                thaw(mount)
                frozen = False
                async with asyncio.timeout(BOUND_S):
                    await asyncio.shield(disk.io_ended)
                await until_thread(lambda: cache.stats().errors.get("close_failed", 0) >= 1,
                                   "the tier's late close failure counted", BOUND_S)
                async with asyncio.timeout(BOUND_S):
                    await cache.aclose()  # the close run anew: its close_within raises that failure
                assert cache.stats().errors.get("close_failed") == 1, cache.stats().errors  # was 2
                await reports.assert_none()
        finally:
            watchdog.cancel()
            if frozen:
                thaw(mount)
            async with asyncio.timeout(BOUND_S):
                await cache.aclose()
