"""Review 243: ``PageFileStore.close()`` waiting for a registration of the engine's memory whose
pinning thread is stuck in the kernel.

The close must wait (the pinning thread may still pin pages of the engine's region; neither it nor
the staging pool may be let go under it), but it waited without a bound and said nothing: a close
(or a dying loop's finalizer) held for good, silently. It now warns every ``close_timeout`` (at
least every ``STUCK_REPORT_MIN_S``) naming what it waits for, and still closes once the pin ended.

The pinning thread waits on an event, as its syscall would.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import mmap
import threading
from pathlib import Path

import pytest
from loop_probes import waiting_in
from store_helpers import hold_region_pinning, wait_for

from aiokv.adapters.store import PageFileStore, StoreConfig, page_file_bytes

PAGE = 8192
BOUND_S = 30.0
CLOSE_S = 0.2


def test_a_close_held_by_a_stuck_registration_warns_and_still_closes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    entered, gate = hold_region_pinning(monkeypatch, BOUND_S)
    caplog.set_level(logging.WARNING, logger="aiokv")
    config = StoreConfig(directory=tmp_path, capacity_bytes=8 * page_file_bytes(PAGE), queue_depth=2,
                         close_timeout=CLOSE_S)
    store = PageFileStore(config, "test", {"model": "m"}, PAGE)
    thread = store.thread
    region = mmap.mmap(-1, 1 << 20)
    closing = threading.Thread(target=store.close, name="test-close", daemon=True)
    try:
        thread.call(lambda: store.register_memory(memoryview(region))).result()
        if not entered.wait(BOUND_S):
            pytest.skip("the disk tier did not register the region (no io_uring here)")
        disk = store._disk
        assert disk is not None
        closing.start()
        wait_for(lambda: bool(thread.call(lambda: any(waiting_in(t, "_stop_registering")
                                                      for t in asyncio.all_tasks())).result()),
                 "the close waiting for the registration", BOUND_S)

        def warned() -> int:
            return sum("registration" in r.getMessage() and "waited" in r.getMessage() for r in caplog.records)

        # Before: no word while it waited, for good.
        wait_for(lambda: warned() >= 2, "two warnings of the close waiting on the stuck registration", BOUND_S)
        assert closing.is_alive(), "the close went on under the pinning thread"
        assert disk._io_ended is None, "the disk tier's close began under the pinning thread"
        gate.set()
        closing.join(BOUND_S)
        assert not closing.is_alive()
        # The bound was spent waiting: the tier's close ends in the background, the thread stops after it.
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive()
        assert disk._io_ended is not None and disk.io_ended.done()
    finally:
        gate.set()
        if closing.ident is not None:
            closing.join(BOUND_S)
        thread._thread.join(BOUND_S)
    gc.collect()
    region.close()
