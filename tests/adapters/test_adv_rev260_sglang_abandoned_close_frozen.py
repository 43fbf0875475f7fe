"""Review 260: SGLang's backend closed (its ``_open_all`` cleanup here) while an open its caller's
interrupt cut short still closes what it opened on the pools' shared loop, that close held by disk
I/O stuck in the kernel (a frozen file system).

A store whose constructor was interrupted on a shared loop closes what its open opened, on that loop
(review 254), bounded by ``close_timeout``: past it the disk tier's close goes on in the background
until the stuck I/O ended, then the staging pool is freed. The backend's close knew nothing of that
store (its constructor raised): it waited ``close_timeout`` for the calls in flight and stopped the
loop, under the tier's close: the tier open for good (its threads, ring and directory lock), its
staging pool mapped. It now stops the loop only once nothing runs on it any more (as after its own
stores' stuck I/O), without waiting for that itself.

The faults are real: an ext4 loop mount frozen (``fsfreeze -f``) under a write the tier has in flight,
and ``SIGUSR1`` to the constructing thread, its handler raising, sent once that write is held. A
watchdog thaws after THAW_S. Root only.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from store_helpers import Interrupted, frozen_write_then_interrupt, raise_interrupted, tier_closed, wait_for

from aiokv.adapters.store import PageFileStore

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make engines installs it)")
sglang_helpers = pytest.importorskip("sglang_helpers")

CLOSE_S = 1.0
MARGIN_S = 2.0
THAW_S = 20.0
BOUND_S = 10.0


@pytest.mark.root
def test_the_loop_outlives_an_abandoned_opens_close_held_by_a_frozen_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backends: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    h = sglang_helpers
    main = threading.get_ident()
    count = [0]
    held: dict[str, Any] = {}
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))

        def freeze_fs() -> None:
            freeze(mount)
            watchdog.start()

        start_disk = frozen_write_then_interrupt(held, freeze_fs, main, lambda: count[0] > 0, BOUND_S,
                                                 first_only=True)

        def handler(signum: int, frame: object) -> None:
            count[0] += 1
            held["interrupted"] = time.monotonic()
            raise_interrupted(signum, frame)

        monkeypatch.setattr(PageFileStore, "_start_disk", start_disk)
        backend = h.attach(backends, mount / "kv", h.host_pool(4), True, options={"close_timeout": CLOSE_S})
        previous = signal.signal(signal.SIGUSR1, handler)
        try:
            with pytest.raises(Interrupted):
                backend.on_host_pools_registered()  # the cleanup closes the pools, stopping their loop
            took = time.monotonic() - held["interrupted"]
            assert count[0] == 1
            store, disk = held["store"], held["disk"]
            thread = store.thread
            assert took < CLOSE_S + MARGIN_S, \
                f"the cleanup's close took {took:.1f} s: it stopped the loop under the stuck close and joined it"
            assert watchdog.is_alive() and not held["write"].done(), "the freeze did not hold the write"
            assert thread._thread.is_alive(), "the loop was stopped under the abandoned open's close (I/O stuck)"
            wait_for(lambda: store._closed, "the abandoned open closing what it opened", BOUND_S)
            assert not tier_closed(disk)
            caplog.set_level(logging.WARNING, logger="aiokv.adapters.sglang")
            wait_for(lambda: any("task(s) to end before it stops" in r.getMessage() for r in caplog.records),
                     "the loop's stop warning of what it waits for", BOUND_S)
            thaw(mount)
            wait_for(lambda: tier_closed(disk), "the abandoned open's disk tier closed after the thaw", BOUND_S)
            wait_for(lambda: store._pool.memory.segment.closed, "its staging pool freed", BOUND_S)
            thread._thread.join(BOUND_S)
            assert not thread._thread.is_alive(), "the pools' loop thread was left running after the thaw"
            assert held["write"].done()
        finally:
            signal.signal(signal.SIGUSR1, previous)
            watchdog.cancel()
            thaw(mount)
            if "store" in held:
                held["store"].thread.close()
