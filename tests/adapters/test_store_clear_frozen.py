"""`PageFileStore.clear()` keeps ``close_timeout`` on a frozen file system (``fsfreeze -f``).

Its clear closed the disk tier without a bound and deleted the files in a thread it waited for
without one: with page-file writes stuck in the kernel, or with none in flight (the deletions
themselves block on a frozen file system), it returned only at the thaw. Now it returns False after
``close_timeout``, counted (``clear_timeouts``), and the clear goes on in the background: after the
thaw the files are gone and a fresh tier serves. A ``close()`` meanwhile keeps its own bound and
frees the staging pool only once the stuck work ended. A watchdog thaws after THAW_S so nothing
stays stuck when a check fails. Root only.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aiokv.adapters.store import PageFileStore, StoreConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw
from store_helpers import wait_for

PAGE = 8192
STORES = 6
CLOSE_S = 1.0
MARGIN_S = 1.5
THAW_S = 15.0
BOUND_S = 10.0

pytestmark = pytest.mark.root


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    wait_for(condition, what, BOUND_S)


def _page_files(store: PageFileStore) -> list[str]:
    """Names of the page files under the store's directory (not its lock files)."""
    found = []
    for _root, _dirs, files in os.walk(store.directory):
        found += [name for name in files if not name.startswith(".")]
    return found


def _open(mount: Path) -> PageFileStore:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    config = StoreConfig(directory=mount / "kv", queue_depth=4, close_timeout=CLOSE_S)
    return PageFileStore(config, "test", {"model": "m"}, PAGE)


def _timed_clear(store: PageFileStore) -> bool:
    began = time.perf_counter()
    cleared = store.thread.submit(store.clear()).result(timeout=CLOSE_S + MARGIN_S)
    took = time.perf_counter() - began
    assert took < CLOSE_S + MARGIN_S, f"clear() took {took:.1f} s with close_timeout {CLOSE_S} s"
    return cleared


def test_clear_keeps_close_timeout_while_writes_hang_and_ends_after_the_thaw(tmp_path: Path) -> None:
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        store = _open(mount)
        pages = [[torch.full((PAGE,), i, dtype=torch.uint8)] for i in range(STORES + 1)]  # alive until written
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        stores: list[concurrent.futures.Future[bool]] = []
        try:
            before = store.key(b"before")
            assert store.thread.run(store.store(before, pages[0]))
            assert _page_files(store)
            freeze(mount)
            watchdog.start()
            stores = [store.thread.submit(store.store(store.key(b"k%d" % i), pages[i + 1])) for i in range(STORES)]
            _wait_for(lambda: store.thread.call(lambda: store.statistics().in_flight).result() > 0,
                      "a write in flight: the freeze did not bite")
            assert _timed_clear(store) is False
            assert store.clear_timeouts == 1
            assert not any(f.done() for f in stores), "a write ended: the freeze did not hold them"
            # Meanwhile the closed tier refuses writes at once; it never waits behind the stuck ones.
            late = store.thread.submit(store.store(store.key(b"late"), pages[0]))
            assert late.result(timeout=BOUND_S) is False
            thaw(mount)
            for future in stores:
                future.result(timeout=BOUND_S)  # the stuck writes end (stored or dropped)
            # The clear ends by itself after the thaw; another clear() waits for it (or runs anew).
            assert store.thread.submit(store.clear()).result(timeout=BOUND_S) is True
            assert store.clear_timeouts == 1
            assert store.contains([before]) == [False]
            assert _page_files(store) == [], "page files outlived the clear"
            # A fresh tier serves again.
            assert store.thread.run(store.store(store.key(b"after"), pages[0]))
            got = [torch.zeros(PAGE, dtype=torch.uint8)]
            assert store.thread.run(store.load(store.key(b"after"), got))
            assert torch.equal(got[0], pages[0][0])
            store.close()
            assert store.close_timeouts == 0
        finally:
            watchdog.cancel()
            thaw(mount)
            store.close()
            store.thread.close()


@pytest.mark.parametrize("busy", [True, False], ids=["writes-stuck", "idle"])
def test_close_while_a_clear_is_stuck_keeps_its_bound_and_frees_the_pool_after_the_thaw(
        tmp_path: Path, busy: bool) -> None:
    with loop_ext4(tmp_path, 320) as mount:
        store = _open(mount)
        segment = store._pool.memory.segment if store._pool is not None else None
        assert segment is not None
        pages = [[torch.full((PAGE,), i, dtype=torch.uint8)] for i in range(STORES + 1)]
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        stores: list[concurrent.futures.Future[bool]] = []
        try:
            assert store.thread.run(store.store(store.key(b"before"), pages[0]))
            freeze(mount)  # idle: no I/O in flight, the deletions themselves hang
            watchdog.start()
            if busy:
                stores = [store.thread.submit(store.store(store.key(b"k%d" % i), pages[i + 1]))
                          for i in range(STORES)]
                _wait_for(lambda: store.thread.call(lambda: store.statistics().in_flight).result() > 0,
                          "a write in flight: the freeze did not bite")
            assert _timed_clear(store) is False
            assert store.clear_timeouts == 1
            began = time.perf_counter()
            store.close()
            took = time.perf_counter() - began
            assert took < CLOSE_S + MARGIN_S, f"close() took {took:.1f} s with close_timeout {CLOSE_S} s"
            if busy:
                # The writes stuck in the kernel may still use the staging pool: mapped until they end.
                assert store.close_timeouts == 1
                assert not segment.closed, "the staging pool was unmapped while stuck writes may use it"
                assert not any(f.done() for f in stores), "a write ended: the freeze did not hold them"
            else:
                # Stuck in deleting files only: nothing touches the pool, which is freed at once.
                assert store.close_timeouts == 0
                assert segment.closed
            thaw(mount)
            for future in stores:
                future.result(timeout=BOUND_S)
            store.thread._thread.join(BOUND_S)  # the store's own thread stops once the pool is freed
            assert not store.thread._thread.is_alive()
            assert segment.closed
            # The deletions the clear had started finish after the thaw (the close stopped the rest).
            if not busy:
                _wait_for(lambda: not _page_files(store), "the clear's deletions to end after the thaw")
        finally:
            watchdog.cancel()
            thaw(mount)
            store.close()
            store.thread.close()
