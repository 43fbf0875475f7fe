"""Helper 273: the constructing thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C
at start-up) as ``open_thread`` returned a ``PageFileStore``'s own loop thread, before the store kept it:
the constructor raised with that thread running for good (idle, holding nothing). ``open_thread`` now
constructs it into a list of the caller's by C code (``list.extend`` over ``map``: no signal handler runs
between the constructor's return and the append), and the constructor stops it when interrupted there.

The interrupt is real (``SIGUSR1`` to the constructing thread, its handler raising), sent by a trace
function (``sys.settrace``) at ``open_thread``'s return event: raised there, it discards what the
function returns, as an interrupt handled at the end of that call did.
"""

from __future__ import annotations

import signal
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from store_helpers import Interrupted, raise_interrupted

from aiokv.adapters import store as store_module
from aiokv.adapters.loopthread import LoopThread
from aiokv.adapters.store import PageFileStore, StoreConfig

BOUND_S = 10.0
PAGE_BYTES = 8192

Tracer = Callable[[types.FrameType, str, Any], Any]


def test_an_interrupt_as_the_stores_own_thread_was_made_stops_it(tmp_path: Path) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    main = threading.get_ident()
    made: list[LoopThread] = []
    signals = [0]

    def handler(signum: int, frame: object) -> None:
        signals[0] += 1
        raise_interrupted(signum, frame)

    def local(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        if event != "return":
            return local
        if frame.f_code is LoopThread.__init__.__code__:
            made.append(frame.f_locals["self"])
        elif frame.f_code is store_module.open_thread.__code__ and made and not signals[0]:
            signal.pthread_kill(main, signal.SIGUSR1)  # its handler raises here, as open_thread returns
        return local

    def calls(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        return local if frame.f_code in (LoopThread.__init__.__code__, store_module.open_thread.__code__) else None

    config = StoreConfig.from_options({"disk_dir": str(tmp_path / "cache"), "disk_bytes": 64 * PAGE_BYTES})
    previous, tracing = signal.signal(signal.SIGUSR1, handler), sys.gettrace()
    try:
        sys.settrace(calls)
        try:
            with pytest.raises(Interrupted):
                PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)
        finally:
            sys.settrace(tracing)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert signals[0] == 1 and len(made) == 1
    thread = made[0]
    try:
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the store's own loop thread was left running"
    finally:
        thread.close()  # what the test left running (before the fix)
    store = PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)  # nothing was opened: it starts
    store.close()
