"""Review 266: the loop thread of disk tiers dies after their store's close returned with disk I/O
stuck in the kernel (a frozen file system), SGLang's backend closed, the pools' loop kept running
until that I/O ends; then a callback lets ``SystemExit`` out on that loop before the thaw.

The death's end cancels every task, the tier's close going on in the background among them, without
waiting for the stuck I/O (the backup call in flight is answered at once, every key failed), then
runs the store's finalizer, ``PageFileStore._close``: bounded by ``close_timeout``, its
``close_within`` gives up again while the disk is still frozen and returns, and the dying thread
closes its loop with the tier's close (run anew) and the staging pool's ``close_after`` still
pending there. Nothing runs them any more: after the thaw the disk tier stays
open for good (its threads, io_uring ring, directory lock) and the staging pool mapped, where a death
seen with calls in flight (review 256) holds the end until the I/O ended and then closes both.
Fixed (helper 269): the finalizer waits, without bound, until that I/O ended, the tier closed and the
pool was freed; the backend's stop of the loop found dead joins it within ``close_timeout``.

The faults are real: an ext4 loop mount frozen (``fsfreeze -f``) under writes the tier has in flight,
and a ``SystemExit`` let out by a callback on the loop thread, posted as the backend's close reaches
its stop of the loop. A watchdog thaws after THAW_S. Root only.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from store_helpers import tier_closed, wait_for

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make engines installs it)")
sglang_helpers = pytest.importorskip("sglang_helpers")

import aiokv.adapters.sglang as sglang_module  # noqa: E402 (needs SGLang: skipped above without it)

CLOSE_S = 1.0
MARGIN_S = 3.0
THAW_S = 15.0
BOUND_S = 10.0


def _exit() -> None:
    raise SystemExit("injected: the pools' loop thread ends")


@pytest.mark.root
def test_a_death_after_a_close_left_io_stuck_still_closes_the_tier_and_frees_the_pool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backends: list[Any]) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    h = sglang_helpers
    real_stop = sglang_module._stop_when_settled

    def stop_when_settled(thread: Any, stores: Any, report_s: float) -> None:
        # The stores' close returned with I/O stuck, the pools' loop kept for it: that loop thread dies now.
        thread.loop.call_soon_threadsafe(_exit)
        wait_for(lambda: thread.died is not None, "the loop thread's death", BOUND_S)
        real_stop(thread, stores, report_s)

    answers: list[object] = []
    monkeypatch.setattr(sglang_module, "_stop_when_settled", stop_when_settled)
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        pool = h.host_pool(8)
        for p in range(8):
            h.fill(pool, p, seed=p)
        backend = h.attach(backends, mount / "kv", pool, True, options={"close_timeout": CLOSE_S})

        def write() -> None:
            try:
                answers.append(backend.batch_set_v1([f"k{p}" for p in range(1, 8)], h.indices(list(range(1, 8)))))
            except BaseException as exc:  # answered or not, the call must end
                answers.append(exc)

        writer = threading.Thread(target=write, name="sglang-backup", daemon=True)
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        thread = None
        try:
            assert backend.batch_set_v1(["k0"], h.indices([0])) == [True]
            thread = backend._loop()
            stores = [p.store for p in backend._pools.values() if p.store is not None]
            disks = [s._disk for s in stores]
            freeze(mount)
            watchdog.start()
            writer.start()
            wait_for(lambda: backend.statistics()["in_flight"] != 0,
                     "a write in flight: the freeze did not bite", BOUND_S)
            began = time.monotonic()
            backend.close()
            took = time.monotonic() - began
            assert watchdog.is_alive(), "the watchdog thawed the disk before close() returned"
            assert thread.died is not None, "the loop thread did not die during the close"
            assert took < len(stores) * CLOSE_S + MARGIN_S, f"close() took {took:.1f} s"
            assert any(s.io_stuck for s in stores), "the close left no I/O stuck: the freeze did not hold the writes"
            thaw(mount)
            thread._thread.join(BOUND_S)
            assert not thread._thread.is_alive(), "the dying loop thread never ended after the thaw"
            assert all(tier_closed(d) for d in disks), "the disk tier was left open for good after the death"
            assert all(s._pool is None or s._pool.memory.segment.closed for s in stores), \
                "the staging pool was left mapped for good after the death"
            writer.join(BOUND_S)
            assert not writer.is_alive(), "the write held by the freeze never answered"
        finally:
            watchdog.cancel()
            thaw(mount)
            if thread is not None:
                thread.close()
