"""Review 299: the rates save marks the rates saved (``_rates_dirty = False``) before its thread
writes them. A loop-wide cancel (an application's SIGTERM handler cancelling every task) that cut
the close while its save waited ended that save's task too: its thread went on, and whatever it
raised then was dropped (nobody could take it). When it failed (here: another holder kept the
directory's ``flock`` past ``RATES_LOCK_WAIT_S``), the rates learned since the last save were lost
and counted nowhere: the close that ran anew (``await_close``) found nothing to save. Now a save
cut by a cancel leaves the rates unsaved: the next save writes them (or its failure is counted).

Real: the rates file and the directory's lock on a real file system, a real cancel of the close's
task and of its save's task, the close run anew by a later ``aclose()``."""

from __future__ import annotations

import asyncio
import fcntl
import os
import threading
from pathlib import Path

import pytest
from cache_helpers import LAYOUT, make_kv
from loop_probes import until, until_thread, waiting_in
from test_adv_rates_save_budget_spent import _config, _disk_rate, _taught_since_the_last_save

from aiokv import KVCache


def _rates_threads() -> int:
    return sum(t.name == "aiokv-rates" for t in threading.enumerate())


@pytest.mark.asyncio
async def test_a_rates_save_cut_by_a_loop_wide_cancel_leaves_the_rates_to_the_next_save(tmp_path: Path) -> None:
    cache = KVCache(_config(tmp_path / "disk"), LAYOUT, make_kv(1))
    lock_fd = -1
    try:
        rates = await _taught_since_the_last_save(cache)
        learned = cache.manager.costs.disk.rate
        manager = cache.manager
        # Another holder of the directory's lock (a stopped process's save): the close's save waits.
        lock_fd = os.open(rates.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)

        def saves() -> list[asyncio.Task[object]]:
            return [t for t in asyncio.all_tasks() if waiting_in(t, "_save_rates")]

        closing = asyncio.ensure_future(cache.aclose())
        await until(lambda: manager._close_task is not None and len(saves()) == 1)
        await until_thread(lambda: _rates_threads() == 1, "the close's save waiting for the lock")
        cut, (save,) = manager._close_task, saves()
        assert cut is not None
        for task in (cut, save):  # as a loop-wide cancel does (the close's task and its save's)
            task.cancel()
        await closing  # the close runs anew (await_close)
        assert cut.cancelled() and save.cancelled()
        # The lock held until every save's thread gave up on it (RATES_LOCK_WAIT_S).
        await until_thread(lambda: _rates_threads() == 0, "a rates thread was left")
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        saved = _disk_rate(rates) == pytest.approx(learned)
        counted = cache.stats().errors.get("rates_not_saved", 0)
        assert saved or counted >= 1, (
            f"the rates learned since the last save were lost uncounted: {cache.stats().errors}")
        assert not saved and counted == 1, (saved, cache.stats().errors)  # the new close's save, counted once
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
        await cache.aclose()
