"""Review 251: the engine's thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C
at start-up) in ``PageFileStore``'s constructor once the store's open on its loop had ended (the
disk tier started), before the constructor returned.

The constructor's cleanup stopped the store's loop thread, as for a start cut short: but the open
had ended, so the disk tier stayed open for good (its threads, ring, directory lock: a store started
again in this process served the directory read-only) and its staging pool mapped, with nobody to
close them (no finalizer runs after a close). An opened store is now closed as ``close()`` does.

The interrupt is real (a signal to the constructing thread, its handler raising); the test chooses
its moment: the wait for the open (``LoopThread.run``) waits for it once the open returned.
"""

from __future__ import annotations

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


def test_an_interrupt_once_the_open_ended_closes_the_disk_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    main = threading.get_ident()
    waiting = threading.Event()
    signals = 0
    stores: list[PageFileStore] = []
    real_run = LoopThread.run

    def run(self: LoopThread, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        if getattr(coro, "__qualname__", "") != "PageFileStore._open" or waiting.is_set():
            return real_run(self, coro, timeout)
        stores.append(coro.cr_frame.f_locals["self"])  # type: ignore[attr-defined]
        result = real_run(self, coro, timeout)
        waiting.set()
        pause, deadline = threading.Event(), time.monotonic() + BOUND_S
        while not signals and time.monotonic() < deadline:
            pause.wait(0.01)  # the signal lands here (short waits: see review 247's hand-over test)
        return result

    monkeypatch.setattr(LoopThread, "run", run)

    def interrupter() -> None:
        assert waiting.wait(BOUND_S)
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
        disk = store._disk
        assert disk is not None, "the open had not ended"
        assert tier_closed(disk), "the disk tier of the opened store was left open"
        store.thread._thread.join(BOUND_S)
        assert not store.thread._thread.is_alive(), "the store's loop thread was never stopped"
        monkeypatch.undo()
        again = PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)  # its lock was let go
        try:
            assert again.thread.call(lambda: again._started()[1].read_only).result() is None
        finally:
            again.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        helper.join(BOUND_S)
