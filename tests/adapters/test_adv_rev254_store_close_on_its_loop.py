"""Review 254: the store's ``close()`` called on its own loop thread (a callback or coroutine of the
loop closing the store: a misuse its docstring names) handed the close over to that loop and waited
there for its result, which only that thread could make: it hung for good, silently, and with it
every call of the engine into the store. It now raises ``RuntimeError`` (as ``LoopThread.run`` does
on its own loop), the store left open for a close from another thread; once closed, a close there
returns as anywhere (idempotent).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aiokv.adapters.loopthread import LoopThread
from aiokv.adapters.store import PageFileStore, StoreConfig

BOUND_S = 10.0
PAGE_BYTES = 8192


@pytest.mark.parametrize("loop", ["own", "shared"])
def test_close_on_the_stores_loop_thread_raises_instead_of_hanging(tmp_path: Path, loop: str) -> None:
    config = StoreConfig.from_options({"disk_dir": str(tmp_path / "cache"), "disk_bytes": 64 * PAGE_BYTES,
                                       "close_timeout": BOUND_S})
    shared = LoopThread("aiokv-test-shared") if loop == "shared" else None
    store = PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES, thread=shared)
    hung = True  # the loop thread waits in close() for good: nothing can close or stop it
    try:
        # Before: TimeoutError here (the loop thread waiting in close() for good).
        with pytest.raises(RuntimeError, match="its loop thread"):
            store.thread.call(store.close).result(BOUND_S)
        hung = False
        assert store.thread.call(lambda: store._started()[1].read_only).result(BOUND_S) is None  # still open
        store.close()
        if shared is not None:  # the shared loop still runs: a close there once closed returns
            assert store.thread.call(store.close).result(BOUND_S) is None
    finally:
        if not hung:
            store.close()
            if shared is not None:
                shared.close()
