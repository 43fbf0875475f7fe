"""Review 257: SGLang's backend once the kernel refuses a new thread (a pids limit reached:
``RuntimeError: can't start new thread``; Python 3.12+ refuses it at interpreter shutdown too).

- ``close()`` closes the pools' stores on an ``aiokv-sglang-close`` thread (review 243); the start
  refused raised out of ``close()`` with nothing closed: the disk tiers open for good, the staging
  pools mapped, the loop thread running. It now closes them on the calling thread.
- After a ``close()`` that returned with disk writes stuck in the kernel (a frozen file system), the
  pools' loop thread is stopped by a callback on that loop once the I/O ended, which started an
  ``aiokv-sglang-stop`` thread; refused, it raised in the callback and the loop thread ran for good
  after the close (the store's own thread had the same fault, f1d8596). The loop now stops itself.

The faults are real: the thread concerned moved into a pids cgroup (v1) at its limit, and an ext4 loop
mount frozen (``fsfreeze -f``) under writes in flight. Root only.
"""

from __future__ import annotations

import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from store_helpers import PIDS, pids_limited, tier_closed, wait_for

from aiokv.adapters.store import PageFileStore

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw

sglang_helpers = pytest.importorskip("sglang_helpers")

CLOSE_S = 1.0
THAW_S = 15.0
BOUND_S = 10.0


@pytest.fixture
def limited() -> Iterator[Path]:
    """A pids cgroup that admits no new task: a thread moved into it can start no thread."""
    with pids_limited("rev257", BOUND_S) as group:
        yield group


@pytest.mark.root
def test_close_closes_every_pool_when_no_close_thread_can_start(tmp_path: Path, limited: Path) -> None:
    h = sglang_helpers
    made: list[Any] = []
    pool = h.host_pool(4)
    backend = h.attach(made, tmp_path / "kv", pool, True, options={"close_timeout": BOUND_S})
    h.fill(pool, 0, seed=0)
    assert backend.batch_set_v1(["p0"], h.indices([0])) == [True]
    thread = backend._loop()
    stores = [p.store for p in backend._pools.values() if p.store is not None]
    disks = [s._disk for s in stores]
    assert stores and all(d is not None for d in disks)
    errors: list[BaseException] = []

    def closer() -> None:
        (limited / "tasks").write_text(str(threading.get_native_id()))  # from here on no thread may start
        try:
            backend.close()
        except BaseException as exc:
            errors.append(exc)

    caller = threading.Thread(target=closer, name="test-closer", daemon=True)
    try:
        caller.start()
        caller.join(BOUND_S)
        assert not caller.is_alive(), "close() hung"
        assert not errors, errors
        assert all(tier_closed(d) for d in disks), "a pool's disk tier was left open"
        assert all(s._pool is None or s._pool.memory.segment.closed for s in stores), "a staging pool left mapped"
        assert not thread._thread.is_alive(), "the pools' loop thread was left running"
    finally:
        backend.close()  # a failed close left them open (made's clean-up is the test's own here)
        thread.close()


@pytest.mark.root
def test_the_loop_thread_ends_after_stuck_io_when_no_stop_thread_can_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limited: Path) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    h = sglang_helpers
    real_settled = PageFileStore.wait_io_settled

    async def wait_io_settled(self: PageFileStore) -> None:
        await real_settled(self)
        # The stuck I/O ended, the staging pool freed; from here on the loop thread can start no thread.
        (limited / "tasks").write_text(str(threading.get_native_id()))

    monkeypatch.setattr(PageFileStore, "wait_io_settled", wait_io_settled)
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        made: list[Any] = []
        pool = h.host_pool(8)
        for p in range(8):
            h.fill(pool, p, seed=p)
        backend = h.attach(made, mount / "kv", pool, True, options={"close_timeout": CLOSE_S})
        answers: list[list[bool]] = []
        writer = threading.Thread(target=lambda: answers.append(backend.batch_set_v1(
            [f"k{p}" for p in range(1, 8)], h.indices(list(range(1, 8))))), name="sglang-backup", daemon=True)
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
            thaw(mount)
            writer.join(BOUND_S)
            assert not writer.is_alive(), "the write held by the freeze never answered"
            thread._thread.join(BOUND_S)
            assert not thread._thread.is_alive(), "the pools' loop thread was left running after the close"
        finally:
            watchdog.cancel()
            thaw(mount)
            if thread is not None:
                if thread._thread.is_alive():
                    (PIDS / "tasks").write_text(str(thread._thread.native_id))
                thread.close()
            backend.close()
