"""Review 256: the store's own loop thread, once a ``close()`` returned with disk writes stuck in the
kernel (a frozen file system), is stopped when that I/O ended and the staging pool was freed: a
callback on the loop thread started an ``aiokv-store-stop`` thread for it. The kernel refusing that
thread (a pids limit reached: ``RuntimeError: can't start new thread``) raised in the callback and
nothing ever stopped the loop: its thread ran for good after the close (review 254 made
``close()`` stop it itself where nothing was stuck; here ``close()`` had returned). The loop thread
now ends by itself when the stop thread is refused.

The faults are real: an ext4 loop mount frozen (``fsfreeze -f``) under writes in flight, and the
loop thread moved into a pids cgroup (v1) at its limit once the pool was freed after the thaw. Root only.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aiokv.adapters.store import PageFileStore, StoreConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw
from store_helpers import PIDS, pids_limited, wait_for

PAGE = 8192
STORES = 4
CLOSE_S = 1.0
THAW_S = 15.0
BOUND_S = 10.0


@pytest.fixture
def limited() -> Iterator[Path]:
    """A pids cgroup that admits no new task: a thread moved into it can start no thread."""
    with pids_limited("rev256", BOUND_S) as group:
        yield group


@pytest.mark.root
def test_the_loop_thread_ends_after_stuck_io_when_no_stop_thread_can_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limited: Path) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        config = StoreConfig(directory=mount / "kv", queue_depth=4, close_timeout=CLOSE_S)
        store = PageFileStore(config, "test", {"model": "m"}, PAGE)
        real_freed = store._pool_freed

        async def pool_freed(io_ended: Any) -> None:
            await real_freed(io_ended)
            # The stuck I/O ended, the staging pool freed; from here on the loop thread can start no thread.
            (limited / "tasks").write_text(str(threading.get_native_id()))

        monkeypatch.setattr(store, "_pool_freed", pool_freed)
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
            store.close()
            assert store.io_stuck, "the close left no I/O stuck: the freeze did not hold the writes"
            thaw(mount)
            for future in stores:
                future.result(timeout=BOUND_S)  # the stuck writes end (stored or dropped)
            wait_for(lambda: segment.closed, "the staging pool freed after the thaw", BOUND_S)
            store.thread._thread.join(BOUND_S)
            assert not store.thread._thread.is_alive(), "the store's loop thread was left running after its close"
        finally:
            watchdog.cancel()
            thaw(mount)
            if store.thread._thread.is_alive():
                (PIDS / "tasks").write_text(str(store.thread._thread.native_id))
            store.thread.close()
