"""Review 296: the rates save the close gave up (counted ``rates_not_saved``, left to end on its
own) handles its own ``OSError`` and ``RuntimeError``; anything else it raised later was never
retrieved, and the engine's loop reported "Task exception was never retrieved". Now its end is
retrieved and logged, the save counted once.

Real: the save is held behind another save of the rates that a frozen file system holds in the
kernel (it owns the rates lock); meanwhile a rate the encoding refuses (NaN: JSON has none) is
planted in the meter; thawed, the given-up save encodes it and raises ``ValueError``."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from cache_helpers import LAYOUT, make_kv
from loop_probes import no_loop_reports, until, until_thread, waiting_in
from test_adv_rates_save_budget_spent import LAST_S, PAGE, _config, _taught_since_the_last_save

from aiokv import KVCache

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw


def _rates_threads() -> int:
    return sum(t.name == "aiokv-rates" for t in threading.enumerate())


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_given_up_rates_save_that_raises_later_is_retrieved_logged_and_counted_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiokv.cache")
    async with no_loop_reports("reported to the loop's handler (a dropped save's failure?)") as reports:
        with loop_ext4(tmp_path, 16) as mount:
            cache = KVCache(_config(mount / "kv"), LAYOUT, make_kv(1))
            frozen = False
            try:
                await _taught_since_the_last_save(cache)
                manager = cache.manager
                freeze(mount)
                frozen = True
                # A background save due now (as RATES_SAVE_INTERVAL_S after the last one): it takes
                # the rates lock and its thread is held in the kernel by the frozen file system.
                manager._rates_saved_at = None
                manager.costs.disk.update(PAGE, LAST_S)
                held = manager._rates_task
                assert held is not None
                await until_thread(lambda: _rates_threads() == 1, "the background save's thread")
                manager.costs.disk.update(PAGE, LAST_S)  # changed since: the close's save has work
                manager.costs.disk._rate = math.nan  # planted: the encoding refuses it (allow_nan=False)
                await cache.aclose()
                assert cache.stats().errors.get("rates_not_saved") == 1, cache.stats().errors
                saves = [t for t in asyncio.all_tasks() if t is not held and waiting_in(t, "_save_rates")]
                assert len(saves) == 1, saves  # the close's, given up, waiting for the lock
            finally:
                if frozen:
                    thaw(mount)
                await cache.aclose()
            done, _ = await asyncio.wait([held, *saves], timeout=30.0)
            assert len(done) == 2, "the saves did not end once thawed"
            # Its outcome not asked here (that would retrieve it): dropped, as the close drops it.
            del done, saves, held
            await until_thread(lambda: _rates_threads() == 0, "a rates thread was left")
            await reports.assert_none()  # the dropped saves collected: none reported unretrieved
            assert cache.stats().errors.get("rates_not_saved") == 1, cache.stats().errors  # counted once
            messages = [r.getMessage() for r in caplog.records]
            assert any("failed later (counted then)" in m and "ValueError" in m for m in messages), messages


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_rates_save_left_by_a_cancelled_close_that_raises_later_is_retrieved_and_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The close's own task cut by a loop-wide cancel while it waited for its save (the close runs
    anew): that save, left unwaited and uncounted, raises later: retrieved, logged, counted then;
    the new close's save, given up, counted at the close. Two saves, two counts."""
    caplog.set_level(logging.WARNING, logger="aiokv.cache")
    async with no_loop_reports("reported to the loop's handler (a dropped save's failure?)") as reports:
        with loop_ext4(tmp_path, 16) as mount:
            cache = KVCache(_config(mount / "kv"), LAYOUT, make_kv(1))
            frozen = False
            try:
                await _taught_since_the_last_save(cache)
                manager = cache.manager
                freeze(mount)
                frozen = True
                manager._rates_saved_at = None  # a background save due now, held in the kernel
                manager.costs.disk.update(PAGE, LAST_S)
                held = manager._rates_task
                assert held is not None
                await until_thread(lambda: _rates_threads() == 1, "the background save's thread")
                manager.costs.disk.update(PAGE, LAST_S)
                manager.costs.disk._rate = math.nan  # planted: the encoding refuses it

                def close_saves(background: asyncio.Task[None] = held) -> list[asyncio.Task[Any]]:
                    return [t for t in asyncio.all_tasks() if t is not background and waiting_in(t, "_save_rates")]

                closing = asyncio.ensure_future(cache.aclose())
                await until(lambda: manager._close_task is not None and waiting_in(manager._close_task, "wait")
                            and len(close_saves()) == 1)
                cut = manager._close_task
                assert cut is not None
                cut.cancel()  # as a loop-wide cancel does: the close runs anew (await_close)
                await closing
                assert cut.cancelled()
                saves = close_saves()
                assert len(saves) == 2, saves  # the cut close's and the new close's
                assert cache.stats().errors.get("rates_not_saved") == 1, cache.stats().errors  # the new one's
            finally:
                if frozen:
                    thaw(mount)
                await cache.aclose()
            done, _ = await asyncio.wait([held, *saves], timeout=30.0)
            assert len(done) == 3, "the saves did not end once thawed"
            del done, saves, held, cut, closing
            await until_thread(lambda: _rates_threads() == 0, "a rates thread was left")
            await reports.assert_none()  # the dropped saves collected: none reported unretrieved
            assert cache.stats().errors.get("rates_not_saved") == 2, cache.stats().errors
            messages = [r.getMessage() for r in caplog.records]
            assert sum("failed later (counted now)" in m and "ValueError" in m for m in messages) == 1, messages
            assert sum("failed later (counted then)" in m and "ValueError" in m for m in messages) == 1, messages
