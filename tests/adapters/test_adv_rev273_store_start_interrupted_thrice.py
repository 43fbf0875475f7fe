"""Helper 273: Ctrl-C pressed three times as a ``PageFileStore`` started (three ``KeyboardInterrupt``
from a signal handler on the constructing thread): the first once the open had ended, the second in
the ``close()`` its cleanup makes (before the close began), the third as that cleanup went back to make
its steps again (the back jump of ``_clean_up_start``'s retry, a point where a signal's handler runs,
outside its ``try``).

Made on the constructing thread, the cleanup's retry let the third out: no close began, the disk tier
was left open for good (its threads, ring and directory lock: a store started again in this process
served the directory read-only), the staging pool mapped, the store's own loop thread running, with
nobody holding the store. The cleanup now runs on a thread of its own, handed over by the first call of
the constructor's ``except`` clause (C code: no signal's handler runs before it); the constructor
waits for it, and the second interrupt lands in that wait (the cleanup goes on to its end).

The interrupts are real (``SIGUSR1`` to the constructing thread, its handler raising): the first two
as review 259's test sends them, the third by a trace function (``sys.settrace``, line events) at the
retry's ``continue``, should the constructing thread reach it.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from store_helpers import Interrupted, raise_interrupted, tier_closed

from aiokv.adapters.loopthread import LoopThread
from aiokv.adapters.store import PageFileStore, StoreConfig

BOUND_S = 30.0
PAGE_BYTES = 8192

Tracer = Callable[[types.FrameType, str, Any], Any]


def _retry_line() -> int:
    """The line of ``_clean_up_start``'s ``continue`` (the retry's back jump), or 0 when it has none."""
    lines, first = inspect.getsourcelines(PageFileStore._clean_up_start)
    for offset, line in enumerate(lines):
        if line.strip() == "continue":
            return first + offset
    return 0


def _segments() -> set[str]:
    """This process's aiokv segments in /dev/shm (named ``aiokv-<pid>-...``)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"aiokv-{os.getpid()}-")}


def test_a_third_interrupt_at_the_cleanups_retry_still_closes_and_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    main = threading.get_ident()
    signals = 0
    waiting = threading.Semaphore(0)  # a point where the next signal is to land was reached
    stores: list[PageFileStore] = []
    real_run = LoopThread.run
    real_in_loop = LoopThread.in_loop_thread
    retry = _retry_line()

    def hold(handled: int) -> None:
        """Until the signal after ``handled`` was handled, in short waits (see review 247's test)."""
        waiting.release()
        pause, deadline = threading.Event(), time.monotonic() + BOUND_S
        while signals == handled and time.monotonic() < deadline:
            pause.wait(0.01)

    def run(self: LoopThread, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        if getattr(coro, "__qualname__", "") != "PageFileStore._open" or stores:
            return real_run(self, coro, timeout)
        stores.append(coro.cr_frame.f_locals["self"])  # type: ignore[attr-defined]
        future = self.submit(coro)
        future.result(timeout)  # the open ended
        hold(0)  # the first signal lands here
        return future.result(timeout)

    def in_loop_thread(self: LoopThread) -> bool:
        answer = real_in_loop(self)
        if signals == 1 and not answer:
            hold(1)  # close()'s first look, on whichever thread makes the cleanup: the second signal
        return answer

    def local(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        if event == "line" and frame.f_lineno == retry and signals == 2:
            signal.pthread_kill(main, signal.SIGUSR1)  # on this (the main) thread: its handler raises here
        return local

    def calls(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        return local if frame.f_code is PageFileStore._clean_up_start.__code__ else None

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
    before = _segments()
    previous, tracing = signal.signal(signal.SIGUSR1, handler), sys.gettrace()
    helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
    try:
        helper.start()
        sys.settrace(calls)
        try:
            with pytest.raises(Interrupted) as raised:
                PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)
        finally:
            sys.settrace(tracing)
        assert isinstance(raised.value.__context__, Interrupted), "the second interrupt did not land in the start"
        del raised
        helper.join(BOUND_S)
        assert signals >= 2 and len(stores) == 1
        store = stores[0]
        store.thread._thread.join(BOUND_S)
        assert not store.thread._thread.is_alive(), "the store's own loop thread was left running"
        disk = store._disk
        assert disk is not None, "the open had not ended"
        assert tier_closed(disk), "the disk tier of the interrupted start was left open"
        assert store._pool is None or store._pool.memory.segment.closed, "its staging pool left mapped"
        for thread in threading.enumerate():
            if thread.name.startswith("aiokv-test"):
                thread.join(BOUND_S)
                assert not thread.is_alive(), f"{thread.name} was left running"
        assert _segments() <= before, "a staging segment was left in /dev/shm"
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
            if store.thread._thread.is_alive():  # left running (a failure): closed here
                store.close()
            store.thread.close()
