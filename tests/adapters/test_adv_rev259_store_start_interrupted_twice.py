"""Review 259: the engine's thread interrupted twice in ``PageFileStore``'s constructor (two
``KeyboardInterrupt`` from a signal handler: Ctrl-C pressed twice at start-up), the second landing in
the cleanup of the first.

``cut_open``: the first while the open still ran on the store's own loop thread, the second in the
wait for its cut there (``_cut_open``): the cleanup's stop of the loop thread was skipped, which ran
for good with nobody holding the store.
``close``: the first once the open had ended, the second in the ``close()`` that cleanup makes,
before the close began: none began, the disk tier left open for good (its threads, ring and
directory lock: a store started again in this process served the directory read-only), the staging
pool mapped, the loop thread running.

The cleanup now makes its steps again after an interrupt (each may be made twice), then raises it.
Since helper 273 it runs on a thread of its own (no signal's handler runs there): the second interrupt
lands in the constructor's wait for it, and it goes on to its end.
The interrupts are real (a signal to the constructing thread, its handler raising); the test
chooses their moments: the first as review 256's and 251's tests do, the second while the cut waits
on the loop (``cut_open``) or in close()'s first look (``close``) until it was handled.
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


@pytest.mark.parametrize("second", ["cut_open", "close"])
def test_a_second_interrupt_in_the_cleanup_still_closes_and_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    main = threading.get_ident()
    signals = 0
    waiting = threading.Semaphore(0)  # a point where the next signal is to land was reached
    stores: list[PageFileStore] = []
    gates: list[asyncio.Event] = []
    real_start = PageFileStore._start_disk
    real_cut = PageFileStore._cut_open
    real_run = LoopThread.run
    real_in_loop = LoopThread.in_loop_thread

    def hold(handled: int) -> None:
        """Until the signal after ``handled`` was handled, in short waits (see review 247's test)."""
        waiting.release()
        pause, deadline = threading.Event(), time.monotonic() + BOUND_S
        while signals == handled and time.monotonic() < deadline:
            pause.wait(0.01)

    async def start_disk(self: PageFileStore, pool: Any) -> Any:
        if second == "cut_open" and not gates:
            gates.append(asyncio.Event())
            await gates[0].wait()  # the open held until cut (the cleanup's _cut_open cancels it)
        return await real_start(self, pool)

    def run(self: LoopThread, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        if getattr(coro, "__qualname__", "") != "PageFileStore._open" or stores:
            return real_run(self, coro, timeout)
        stores.append(coro.cr_frame.f_locals["self"])  # type: ignore[attr-defined]
        future = self.submit(coro)
        if second == "close":
            future.result(timeout)  # the open ended
        hold(0)  # the first signal lands here
        return future.result(timeout)

    async def cut_open(self: PageFileStore) -> None:
        # On the loop: the constructor waits for its answer; the second signal lands there.
        if signals == 1:
            waiting.release()
            pause, deadline = threading.Event(), time.monotonic() + BOUND_S
            while signals == 1 and time.monotonic() < deadline:
                pause.wait(0.01)
        await real_cut(self)

    def in_loop_thread(self: LoopThread) -> bool:
        answer = real_in_loop(self)
        if signals == 1 and not answer:
            # close()'s first look, before the close began, on the thread making the cleanup (the
            # constructor's own before helper 273's change, where the second signal lands; since, a
            # thread of the cleanup's own: it lands in the constructor's wait for it)
            hold(1)
        return answer

    monkeypatch.setattr(PageFileStore, "_start_disk", start_disk)
    monkeypatch.setattr(PageFileStore, "_cut_open", cut_open)
    monkeypatch.setattr(LoopThread, "run", run)
    monkeypatch.setattr(LoopThread, "in_loop_thread", in_loop_thread)

    def interrupter() -> None:
        for _ in range(2):
            assert waiting.acquire(timeout=BOUND_S)
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
        with pytest.raises(Interrupted) as raised:
            PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)
        assert isinstance(raised.value.__context__, Interrupted), "the second interrupt did not land in the cleanup"
        del raised
        helper.join(BOUND_S)
        assert signals == 2 and len(stores) == 1
        store = stores[0]
        store.thread._thread.join(BOUND_S)
        assert not store.thread._thread.is_alive(), "the store's own loop thread was left running"
        disk = store._disk
        if second == "close":
            assert disk is not None, "the open had not ended"
        assert disk is None or tier_closed(disk), "the disk tier of the interrupted start was left open"
        monkeypatch.undo()
        again = PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)  # its lock was let go
        try:
            assert again.thread.call(lambda: again._started()[1].read_only).result() is None
        finally:
            again.close()
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a signal still to come (a failure) is not raised here
        waiting.release(2)
        helper.join(BOUND_S)
        signal.signal(signal.SIGUSR1, previous)
        for store in stores:
            if gates and not store.thread.loop.is_closed():
                store.thread.loop.call_soon_threadsafe(gates[0].set)
            if store.thread._thread.is_alive():  # left running (a failure): closed here
                store.close()
            store.thread.close()
