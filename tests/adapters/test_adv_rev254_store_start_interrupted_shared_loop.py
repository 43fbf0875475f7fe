"""Review 254: the engine's thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C
at start-up) in ``PageFileStore``'s constructor while its open still ran on a loop thread the store
shares (SGLang's pools share one: the store does not own it).

The constructor raised and left the open running: it ended on the shared loop with the disk tier
started, the store object gone, nobody to close it (SGLang's cleanup closes the pools it holds, then
stops the loop: no finalizer runs after a close): the tier open for good (its threads, ring and
directory lock: a store started again in this process served the directory read-only), its staging
pool mapped. An open whose caller is gone now closes what it opened, before its future answers (the
shared loop's owner waits for that, ``LoopThread.wait_answered``, before it stops the loop).
Review 251 (42570dd) closed a store only when the interrupt came once the open had ended.

The interrupt is real (a signal to the constructing thread, its handler raising); the test chooses
its moment: the disk tier's start waits on the loop until the signal was handled.
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
from store_helpers import Interrupted, raise_interrupted, tier_closed

from aiokv.adapters.loopthread import LoopThread
from aiokv.adapters.store import PageFileStore, StoreConfig

BOUND_S = 30.0
PAGE_BYTES = 8192


def test_an_interrupt_during_the_open_on_a_shared_loop_closes_the_disk_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    main = threading.get_ident()
    entered = threading.Event()
    signals = 0
    stores: list[PageFileStore] = []
    real_start = PageFileStore._start_disk
    real_run = LoopThread.run
    shared = LoopThread("aiokv-test-shared")
    gate = shared.call(asyncio.Event).result()  # the disk tier's start waits for it (loop only)

    async def start_disk(self: PageFileStore, pool: Any) -> Any:
        if not stores:
            stores.append(self)
            entered.set()
            await gate.wait()
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

    monkeypatch.setattr(PageFileStore, "_start_disk", start_disk)
    monkeypatch.setattr(LoopThread, "run", run)

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
            PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES, thread=shared)
        helper.join(BOUND_S)
        assert signals == 1 and len(stores) == 1
        store = stores[0]
        assert store._disk is None, "the open had ended before the interrupt"
        shared.loop.call_soon_threadsafe(gate.set)
        # The shared loop's owner (SGLang's close): the calls in flight answered, then the loop stopped.
        assert shared.wait_answered(BOUND_S)
        disk = store._disk
        assert disk is not None, "the open did not end"
        assert tier_closed(disk), "the disk tier the interrupted open started was left open"
        shared.close()
        monkeypatch.undo()
        again = PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)  # its lock was let go
        try:
            assert again.thread.call(lambda: again._started()[1].read_only).result() is None
        finally:
            again.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        helper.join(BOUND_S)
        shared.close()
