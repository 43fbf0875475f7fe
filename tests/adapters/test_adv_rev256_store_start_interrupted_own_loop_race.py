"""Review 256: the engine's thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C
at start-up) in ``PageFileStore``'s constructor while its open still ran on the store's own loop
thread, the open ending between the constructor's look at it and its stop of the loop.

The constructor looked (``self._disk is None``: not opened) on its own thread, then stopped the loop
(``LoopThread.close``): an open ending in between (the engine's thread losing the GIL there to the
loop thread, or a reader's staleness-check join between the two) left the disk tier started under a
loop stopped by a close, which runs no finalizer: its threads, ring and directory lock held for good
(a store started again in this process served the directory read-only), the staging pool mapped.
The decision is now taken on the loop, where the open runs: an open still running is cancelled there
(nothing opened once the loop stops), one that ended is closed as ``close()`` does.

The interrupt is real (a signal to the constructing thread, its handler raising); the test chooses
its moment: the disk tier's start waits on the loop until the signal was handled, and the loop's
stop waits until the start went on (to its end, or cut).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from store_helpers import Interrupted, raise_interrupted, tier_closed, wait_for

from aiokv.adapters.loopthread import LoopThread
from aiokv.adapters.store import PageFileStore, StoreConfig

BOUND_S = 30.0
PAGE_BYTES = 8192


def test_an_open_ending_before_the_own_loop_stops_is_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    main = threading.get_ident()
    entered = threading.Event()
    released = threading.Event()
    cut = threading.Event()  # the held start was cancelled
    signals = 0
    stores: list[PageFileStore] = []
    gates: list[asyncio.Event] = []
    real_start = PageFileStore._start_disk
    real_run = LoopThread.run
    real_close = LoopThread.close

    async def start_disk(self: PageFileStore, pool: Any) -> Any:
        if not stores:
            stores.append(self)
            gates.append(asyncio.Event())
            entered.set()
            try:
                await gates[0].wait()
            except asyncio.CancelledError:
                cut.set()
                raise
        return await real_start(self, pool)

    def run(self: LoopThread, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        if getattr(coro, "__qualname__", "") != "PageFileStore._open" or signals:
            return real_run(self, coro, timeout)
        future = self.submit(coro)
        assert entered.wait(BOUND_S)
        pause, deadline = threading.Event(), time.monotonic() + BOUND_S
        while not signals and time.monotonic() < deadline:
            pause.wait(0.01)  # the signal lands here, the open held (short waits: see review 247's test)
        return future.result(timeout)

    def close(self: LoopThread) -> None:
        if stores and self is stores[0].thread and signals and not released.is_set():
            # The worst moment: the open goes on (to its end, or cut) before the loop is stopped.
            released.set()
            self.loop.call_soon_threadsafe(gates[0].set)
            store = stores[0]
            wait_for(lambda: store._disk is not None or cut.is_set(), "the held start went on", BOUND_S)
        real_close(self)

    monkeypatch.setattr(PageFileStore, "_start_disk", start_disk)
    monkeypatch.setattr(LoopThread, "run", run)
    monkeypatch.setattr(LoopThread, "close", close)

    def interrupter() -> None:
        assert entered.wait(BOUND_S)
        signal.pthread_kill(main, signal.SIGUSR1)

    def handler(signum: int, frame: object) -> None:
        nonlocal signals
        signals += 1
        raise_interrupted(signum, frame)

    config = StoreConfig.from_options({"disk_dir": str(tmp_path / "cache"), "disk_bytes": 64 * PAGE_BYTES,
                                       "close_timeout": BOUND_S})
    previous = signal.signal(signal.SIGUSR1, handler)
    helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
    try:
        helper.start()
        with pytest.raises(Interrupted):
            PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)
        helper.join(BOUND_S)
        assert signals == 1 and len(stores) == 1
        store = stores[0]
        assert not store.thread._thread.is_alive(), "the store's own loop thread was left running"
        disk = store._disk
        assert disk is None or tier_closed(disk), "the disk tier the interrupted open started was left open"
        monkeypatch.undo()
        again = PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)  # its lock was let go
        try:
            assert again.thread.call(lambda: again._started()[1].read_only).result() is None
        finally:
            again.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        helper.join(BOUND_S)
        if stores and not released.is_set() and gates:
            stores[0].thread.loop.call_soon_threadsafe(gates[0].set)
