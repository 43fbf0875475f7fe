"""Review 242: the engine's thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C
at shutdown) while ``PageFileStore.close()`` waits for its close on the store's own loop thread.

``close()`` then stopped that thread at once (``LoopThread.close``), whose end cancels every task:
the close was cut before the disk tier closed (here: waiting for a registration of the engine's
region), and nothing ran it again (no death, so no finalizer; a second ``close()`` returns at once).
The tier was left open for good: its checksum and preparation threads running, its ring, directory
descriptors and lock held, the staging pool mapped (since 5e22465; freed under the open tier
before). The interrupt now reaches the caller at once and the close goes on to its end on the loop,
which is stopped after it.

The interrupt is real (a signal to the thread in ``close()``, its handler raising); the registration's
pinning thread waits on an event, as its syscall would.
"""

from __future__ import annotations

import asyncio
import gc
import mmap
import os
import signal
import threading
from pathlib import Path

import pytest
from loop_probes import waiting_in
from store_helpers import Interrupted, hold_region_pinning, raise_interrupted, wait_for

from aiokv.adapters.store import PageFileStore, StoreConfig, page_file_bytes

PAGE = 8192
BOUND_S = 30.0


def test_an_interrupted_close_still_closes_the_disk_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    entered, gate = hold_region_pinning(monkeypatch, BOUND_S)
    config = StoreConfig(directory=tmp_path, capacity_bytes=8 * page_file_bytes(PAGE), queue_depth=2)
    store = PageFileStore(config, "test", {"model": "m"}, PAGE)
    thread = store.thread
    region = mmap.mmap(-1, 1 << 20)
    returned = threading.Event()
    main = threading.get_ident()

    def interrupter() -> None:
        def close_waits() -> bool:
            return bool(thread.call(lambda: any(waiting_in(t, "_stop_registering")
                                                for t in asyncio.all_tasks())).result())

        wait_for(close_waits, "the close waiting for the registration", BOUND_S)
        signal.pthread_kill(main, signal.SIGUSR1)
        # Before: close() went on to stop the loop thread, whose end waits for the registration.
        wait_for(lambda: returned.is_set() or thread._ending, "close() interrupted", BOUND_S)
        gate.set()

    previous = signal.signal(signal.SIGUSR1, raise_interrupted)
    helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
    try:
        thread.call(lambda: store.register_memory(memoryview(region))).result()
        if not entered.wait(BOUND_S):
            pytest.skip("the disk tier did not register the region (no io_uring here)")
        pool, disk = store._pool, store._disk
        assert pool is not None and disk is not None
        segment = f"/dev/shm/{pool.name.lstrip('/')}"
        helper.start()
        with pytest.raises(Interrupted):
            store.close()
        returned.set()
        helper.join(BOUND_S)
        gate.set()
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the store's loop thread was never stopped"
        assert disk._io_ended is not None and disk.io_ended.done(), "the disk tier was left open"
        assert pool._released, "the staging pool was never freed"
        assert not os.path.exists(segment)
        # The pool's idle preparation threads exit by themselves (shut down without a wait).
        wait_for(lambda: not any(t.name.startswith("aiokv-") for t in threading.enumerate()),
                 "the store's threads ended", BOUND_S)
        store.close()  # returns at once
    finally:
        signal.signal(signal.SIGUSR1, previous)
        gate.set()
        helper.join(BOUND_S)
        thread._thread.join(BOUND_S)
    gc.collect()
    region.close()
