"""Review 266: SGLang's backend closed with disk writes stuck in the kernel (a frozen file system):
the pools' loop thread stops once that I/O ended (``_stop_when_settled``), and what it waits for
meanwhile is warned every ``close_timeout`` (at least every second), never silently (1018515).

Only its second wait warned (tasks still running, ``_others_ended``): the first, for the stores'
stuck I/O to settle (``wait_io_settled``), waited silently for as long as the disk hung, the loop
thread and the staging pools kept with no word after the close's one error. It now warns as the
second does.

The fault is real: an ext4 loop mount frozen (``fsfreeze -f``) under writes in flight, thawed once
the warning came (a watchdog thaws after THAW_S). Root only.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from store_helpers import wait_for

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make engines installs it)")
sglang_helpers = pytest.importorskip("sglang_helpers")

CLOSE_S = 1.0
THAW_S = 15.0
BOUND_S = 10.0
WARNED_S = 4 * CLOSE_S


@pytest.mark.root
def test_the_loops_wait_for_stuck_io_after_close_is_warned(
        tmp_path: Path, backends: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    h = sglang_helpers
    caplog.set_level(logging.WARNING, logger="aiokv.adapters.sglang")
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        pool = h.host_pool(8)
        for p in range(8):
            h.fill(pool, p, seed=p)
        backend = h.attach(backends, mount / "kv", pool, True, options={"close_timeout": CLOSE_S})
        writer = threading.Thread(target=lambda: backend.batch_set_v1(
            [f"k{p}" for p in range(1, 8)], h.indices(list(range(1, 8)))), name="sglang-backup", daemon=True)
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        thread = None
        try:
            assert backend.batch_set_v1(["k0"], h.indices([0])) == [True]
            thread = backend._loop()
            freeze(mount)
            watchdog.start()
            writer.start()
            wait_for(lambda: backend.statistics()["in_flight"] != 0,
                     "a write in flight: the freeze did not bite", BOUND_S)
            stores = [p.store for p in backend._pools.values() if p.store is not None]
            backend.close()
            assert any(s.io_stuck for s in stores), "the close left no I/O stuck: the freeze did not hold the writes"
            wait_for(lambda: any("before it stops" in r.getMessage() for r in caplog.records),
                     "a warning of the loop's wait for the stuck I/O before it stops", WARNED_S)
            assert watchdog.is_alive() and thread._thread.is_alive(), "the disk thawed or the loop stopped early"
            thaw(mount)
            writer.join(BOUND_S)
            thread._thread.join(BOUND_S)
            assert not thread._thread.is_alive(), "the pools' loop thread was left running after the thaw"
        finally:
            watchdog.cancel()
            thaw(mount)
            if thread is not None:
                thread.close()
