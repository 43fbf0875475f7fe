"""`PageFileStore.clear()` racing `close()` from another thread raises ``RuntimeError``.

The close cancels the store's clear task (:meth:`PageFileStore.close` stops a clear in flight), and
``clear()`` then took that task's result: its caller, whom nobody cancelled, got
``CancelledError`` instead of the ``RuntimeError`` (or False) its docstring promises. The clear
hangs for real: its deletions on a frozen file system (``fsfreeze -f``), when the engine shuts
down. A watchdog thaws after THAW_S so nothing stays stuck when a check fails. Root only.
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
CLOSE_S = 3.0  # wide: the close must land while clear() still waits for its task
MARGIN_S = 1.5
THAW_S = 15.0
BOUND_S = 10.0


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    wait_for(condition, what, BOUND_S)


def _page() -> list[torch.Tensor]:
    return [torch.arange(PAGE, dtype=torch.int32).to(torch.uint8)]


@pytest.mark.root
def test_close_while_a_clear_hangs_on_a_frozen_fs_makes_it_raise_runtime_error(tmp_path: Path) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        config = StoreConfig(directory=mount / "kv", queue_depth=2, close_timeout=CLOSE_S)
        store = PageFileStore(config, "test", {"model": "m"}, PAGE)  # its own thread, as vLLM's
        segment = store._pool.memory.segment if store._pool is not None else None
        assert segment is not None
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        try:
            assert store.thread.run(store.store(store.key(b"a"), _page()))
            freeze(mount)  # the clear's deletions hang in the kernel
            watchdog.start()
            cleared: concurrent.futures.Future[bool] = store.thread.submit(store.clear())
            _wait_for(lambda: store.thread.call(lambda: store._clear_task is not None).result(), "the clear began")
            assert not cleared.done(), "the clear ended: the freeze did not hold it"
            began = time.perf_counter()
            store.close()
            took = time.perf_counter() - began
            assert took < CLOSE_S + MARGIN_S, f"close() took {took:.1f} s with close_timeout {CLOSE_S} s"
            with pytest.raises(RuntimeError, match="closed"):
                cleared.result(timeout=BOUND_S)
            assert store.clear_timeouts == 0
            thaw(mount)
            store.thread._thread.join(BOUND_S)
            assert not store.thread._thread.is_alive()
            assert segment.closed
        finally:
            watchdog.cancel()
            thaw(mount)
            store.close()
            store.thread.close()
