"""Review 259: ``LoopThread.close()`` interrupted (a ``KeyboardInterrupt`` from a signal handler) after
it counted the loop closed, before it asked the loop to stop: a later ``close()`` (a cleanup made
again after the interrupt: ``PageFileStore``'s constructor) returned at once, the loop running for
good. Each ``close()`` now asks for the stop.

The interrupt is real (a signal to the closing thread, its handler raising); the test chooses its
moment: the hand-over of the stop waits until the signal was handled, before it is made. Since helper
279 the stop is asked by a bare thread (see test_adv_rev279_loopthread_close_interrupted_once.py) and is
asked on the closing thread only where no thread may start (a pids limit): that refusal is what
``_thread.start_new_thread`` answers here.
"""

from __future__ import annotations

import signal
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
from store_helpers import Interrupted, raise_interrupted

from aiokv.adapters import loopthread
from aiokv.adapters.loopthread import LoopThread

BOUND_S = 30.0


def test_a_close_made_again_after_an_interrupt_before_the_stop_stops_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")

    def refused(fn: Callable[..., Any], args: tuple[Any, ...]) -> int:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(loopthread, "_thread", types.SimpleNamespace(start_new_thread=refused))
    main = threading.get_ident()
    thread = LoopThread("test-rev259-close")
    loop = thread.loop
    real = loop.call_soon_threadsafe
    waiting = threading.Event()
    signals = 0

    def call_soon_threadsafe(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == main and fn == loop.stop and not signals:
            waiting.set()
            pause, deadline = threading.Event(), time.monotonic() + BOUND_S
            while not signals and time.monotonic() < deadline:
                pause.wait(0.01)  # the signal lands here, before the stop is handed over
        return real(fn, *args, **kwargs)

    loop.call_soon_threadsafe = call_soon_threadsafe  # type: ignore[method-assign]

    def interrupter() -> None:
        assert waiting.wait(BOUND_S)
        signal.pthread_kill(main, signal.SIGUSR1)

    def handler(signum: int, frame: object) -> None:
        nonlocal signals
        signals += 1
        raise_interrupted(signum, frame)

    previous = signal.signal(signal.SIGUSR1, handler)
    helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
    try:
        helper.start()
        with pytest.raises(Interrupted):
            thread.close()
        helper.join(BOUND_S)
        assert signals == 1
        thread.close()  # made again
        assert thread.wait_ended(BOUND_S), "the loop thread was left running after a second close()"
        assert thread.died is None and loop.is_closed()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        helper.join(BOUND_S)
        if not thread.wait_ended(0):
            real(loop.stop)
            thread.wait_ended(BOUND_S)
