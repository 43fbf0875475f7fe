"""`PageFileStore.close()` keeps ``close_timeout`` while page-file writes hang in the kernel.

Its close waited for the disk tier's close without a bound: with writes stuck on a frozen file
system (``fsfreeze -f``) it returned only at the thaw. Now it returns after ``close_timeout``,
counted (``close_timeouts``); the staging pool stays mapped while the stuck writes may still use
it, and is freed (the store's own thread stopped) once the thaw lets them end. A watchdog thaws
after THAW_S so nothing stays stuck when the check fails. Root only.
"""

from __future__ import annotations

import concurrent.futures
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



def _wait_for(condition: Callable[[], bool], what: str) -> None:
    wait_for(condition, what, BOUND_S)


@pytest.mark.root
@pytest.mark.parametrize("zero_copy", [True, False], ids=["direct", "staged"])
def test_store_close_keeps_close_timeout_while_writes_hang_and_frees_the_pool_after_the_thaw(
        tmp_path: Path, zero_copy: bool) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        config = StoreConfig(directory=mount / "kv", queue_depth=4, zero_copy=zero_copy, close_timeout=CLOSE_S)
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
            _wait_for(lambda: store.thread.call(lambda: store.statistics().in_flight).result() > 0,
                      "a write in flight: the freeze did not bite")
            began = time.perf_counter()
            store.close()
            took = time.perf_counter() - began
            assert took < CLOSE_S + MARGIN_S, f"close() took {took:.1f} s with close_timeout {CLOSE_S} s"
            assert store.close_timeouts == 1
            assert not segment.closed, "the staging pool was unmapped while writes stuck in the kernel may use it"
            assert not any(f.done() for f in stores), "a write ended: the freeze did not hold them"
            thaw(mount)
            for future in stores:
                future.result(timeout=BOUND_S)  # the stuck writes end (stored or dropped)
            store.thread._thread.join(BOUND_S)  # the store's own thread stops once the pool is freed
            assert not store.thread._thread.is_alive()
            assert segment.closed
            store.close()  # idempotent
            assert store.close_timeouts == 1
        finally:
            watchdog.cancel()
            thaw(mount)
            store.close()
            store.thread.close()


def test_close_timeout_option() -> None:
    assert StoreConfig.from_options({"close_timeout": 2}).close_timeout == 2.0
    with pytest.raises(ValueError, match="close_timeout"):
        StoreConfig(directory=Path("x"), close_timeout=float("inf"))
    with pytest.raises(TypeError, match="close_timeout"):
        StoreConfig(directory=Path("x"), close_timeout="1")  # type: ignore[arg-type]
