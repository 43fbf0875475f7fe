"""Review 256: ``PageFileStore.close()`` keeps ``close_timeout`` after its own loop thread died while
page-file writes hang in the kernel (a frozen file system, ``fsfreeze -f``).

The death's end cancels the writes in flight and waits for their I/O, then its finalizer closes the
disk tier: that thread ends only at the thaw. ``close()`` found the loop dead and joined it without a
bound, returning only at the thaw (vLLM's shutdown held as long). It now waits for that end within
``close_timeout`` only and returns (logged); the dying thread ends by itself, its finalizer closing
the tier and the staging pool. A watchdog thaws after THAW_S so nothing stays stuck when the check
fails. The death is real: a callback lets ``SystemExit`` out on the loop thread. Root only.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from aiokv.adapters.store import PageFileStore, StoreConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw
from store_helpers import wait_for

PAGE = 8192
STORES = 4
CLOSE_S = 1.0
MARGIN_S = 1.5
THAW_S = 15.0
BOUND_S = 10.0


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


@pytest.mark.root
def test_close_after_a_death_over_stuck_writes_keeps_close_timeout(tmp_path: Path) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        config = StoreConfig(directory=mount / "kv", queue_depth=4, close_timeout=CLOSE_S)
        store = PageFileStore(config, "test", {"model": "m"}, PAGE)
        segment = store._pool.memory.segment if store._pool is not None else None
        assert segment is not None
        pages = [[torch.full((PAGE,), i, dtype=torch.uint8)] for i in range(STORES)]  # alive until the writes end
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        stores: list[concurrent.futures.Future[bool]] = []
        try:
            assert store.thread.run(store.store(store.key(b"before"), pages[0]))
            freeze(mount)
            watchdog.start()
            stores = [store.thread.submit(store.store(store.key(b"k%d" % i), pages[i])) for i in range(STORES)]
            wait_for(lambda: store.thread.call(lambda: store.statistics().in_flight).result() > 0,
                     "a write in flight: the freeze did not bite", BOUND_S)
            store.thread.loop.call_soon_threadsafe(_die)
            wait_for(lambda: store.thread.died is not None, "the loop thread died", BOUND_S)
            assert not store.thread.dead, "its end did not wait for the stuck writes: the freeze did not hold them"
            began = time.perf_counter()
            store.close()
            took = time.perf_counter() - began
            assert took < CLOSE_S + MARGIN_S, f"close() took {took:.1f} s with close_timeout {CLOSE_S} s"
            assert not segment.closed, "the staging pool was unmapped while writes stuck in the kernel may use it"
            assert not any(f.done() for f in stores), "a write ended: the freeze did not hold them"
            thaw(mount)
            store.thread._thread.join(BOUND_S)  # the dying thread ends once the writes did
            assert store.thread.dead
            assert all(f.done() for f in stores), "a write's caller was left waiting"
            assert segment.closed, "the dying thread's finalizer did not free the staging pool"
            assert store.wait_closed(0)
            store.close()  # idempotent
        finally:
            watchdog.cancel()
            thaw(mount)
            store.close()
            store.thread.close()
