"""Review 300: the cache manager's close cut (its own task cancelled) while it waited for its rates
save left the disk tier's ``close_within`` task unawaited; that close failing later was "Task
exception was never retrieved" in the engine's loop, counted only if some later ``aclose()`` ran
the close anew. Now its end is retrieved, logged, and the failure counted once (the close run anew
sees the same failure of the same tier close).

A cancel of the caller of ``aclose()`` (``asyncio.wait_for`` timing out, the engine's close task
cancelled) stops only that wait: the close's task is shielded (checked here too). Cut here: the
close's task alone, as a cancel that reaches it and not the tier's close task does.

Real: write-behind and the rates save held in the kernel by a frozen ext4 (the tier's close waits
for them); thawed, the tier's close ends, and fails (an ``OSError`` injected at its end: no real
fault of a healthy close was found to make it fail)."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, make_kv, prompt
from loop_probes import cancel_every_task_but_nowait, no_loop_reports, until, until_thread, waiting_in
from test_adv_rates_save_budget_spent import _config, _taught_since_the_last_save

from aiokv import KVCache
from aiokv.storage.disk import DiskTier

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from follow_helpers import open_fds
from fs_helpers import freeze, loop_ext4, thaw

BOUND_S = 30.0
T = LAYOUT.page_tokens


def _aiokv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiokv")]


def _close_withins() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if waiting_in(t, "close_within")]


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("loop_wide", [False, True], ids=["close_task_alone", "loop_wide"])
async def test_a_cut_close_retrieves_the_tier_close_it_left_and_counts_its_late_failure_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, loop_wide: bool) -> None:
    """``loop_wide``: every task but the test's cancelled (an application's SIGTERM handler): that
    reaches the tier's close_within and the tier's own close task too (ended cancelled, nothing to
    retrieve); the tier's close then runs anew (each step may run twice), its failure counted once."""
    caplog.set_level(logging.WARNING, logger="aiokv.cache")
    tier_closes: list[int] = []  # ids only: a reference would keep the tier (and its pages) alive
    real_close = DiskTier._close

    async def failing_close(self: DiskTier) -> None:
        tier_closes.append(id(self))
        await real_close(self)  # held while the file system is frozen
        raise OSError(errno.EIO, "EIO at the end of the tier's close (injected)")

    monkeypatch.setattr(DiskTier, "_close", failing_close)
    async with no_loop_reports("reported to the loop's handler (the tier's close left never retrieved?)") as reports:
        fds_before = open_fds()
        with loop_ext4(tmp_path, 16) as mount:
            cfg = dataclasses.replace(_config(mount / "kv"), close_timeout=BOUND_S)
            cache = KVCache(cfg, LAYOUT, make_kv(1))
            watchdog = threading.Timer(2 * BOUND_S, thaw, args=(mount,))  # nothing stays frozen on a failure
            frozen = False
            try:
                await _taught_since_the_last_save(cache)  # the close's save has rates to write
                manager = cache.manager
                disk = cache.disk
                assert disk is not None and disk.read_only is None
                segment = f"/dev/shm/{cache.pool.name.lstrip('/')}"
                assert await asyncio.to_thread(os.path.exists, segment)
                freeze(mount)
                frozen = True
                watchdog.start()
                tokens = prompt(2, 4 * T)
                await cache.offload(tokens, torch.arange(len(tokens)))  # write-behind held in the kernel
                await until_thread(lambda: disk.statistics().in_flight > 0, "a write held by the freeze", BOUND_S)

                # The caller's wait timing out leaves the close's task running (shielded).
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(cache.aclose(), 0.2)
                first = manager._close_task
                assert first is not None and not first.done(), "a caller's timeout cut the close's task"
                await until(lambda: waiting_in(first, "wait") and len(_close_withins()) == 1, turns=1_000_000)
                [left] = _close_withins()
                assert len(tier_closes) == 1

                if loop_wide:
                    cancel_every_task_but_nowait(asyncio.current_task())
                else:
                    first.cancel()  # the close's task alone: the tier's close_within goes on, unwaited
                closing = asyncio.ensure_future(cache.aclose())  # runs the close anew (await_close)
                await until(lambda: manager._close_task is not first and manager._close_task is not None
                            and waiting_in(manager._close_task, "wait"), turns=1_000_000)
                assert first.cancelled()
                if loop_wide:
                    assert left.cancelled(), "a loop-wide cancel left the tier's close_within running"
                else:
                    assert not left.done(), "the tier's close ended while the file system was frozen"
                thaw(mount)
                frozen = False
                async with asyncio.timeout(BOUND_S):
                    await closing
                    await asyncio.wait({left})
                    await cache.aclose()  # again: returns at once, closes nothing twice
                assert len(tier_closes) == (2 if loop_wide else 1), "the disk tier's close ran again"
                assert disk.io_ended.done()
                assert cache.stats().errors.get("close_failed") == 1, cache.stats().errors  # once, not twice
                assert not await asyncio.to_thread(os.path.exists, segment), "the pool's segment is left"
            finally:
                watchdog.cancel()
                if frozen:
                    thaw(mount)
                async with asyncio.timeout(BOUND_S):
                    await cache.aclose()
            del left, closing  # (each a task whose never-retrieved exception is reported at its collection)
            first = None  # its frame holds the tier close it left
            await until_thread(lambda: not _aiokv_threads(), "no aiokv thread left", BOUND_S)
            await reports.assert_none()  # the tasks left dropped and collected: none "never retrieved"
            messages = [r.getMessage() for r in caplog.records]
            late = sum("a cancelled close left failed later" in m and "EIO" in m for m in messages)
            assert late == (0 if loop_wide else 1), messages
        leaked = open_fds() - fds_before
        assert not leaked, [await asyncio.to_thread(os.readlink, f"/proc/self/fd/{fd}") for fd in leaked]
