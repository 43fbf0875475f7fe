"""Helper 273: the constructing thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C
at start-up) in ``LoopThread``'s constructor once its thread started: in ``threading.Thread.start``'s own
wait for the thread, or in the wait for the loop. The first closed the loop under the starting thread
(``RuntimeError`` "Cannot close a running event loop" raised instead of the interrupt), the second was
outside the ``try``: either way the loop thread ran for good, idle, held by nobody. It is now stopped
(by a bare thread handed the stop by the clause's first call, C code) and the interrupt is raised.

The interrupts are real (``SIGUSR1`` to this thread, its handler raising), sent by a trace function
(``sys.settrace``) at ``Thread.start``'s return event (raised there, as one handled at the end of that
call) or at the line of the wait for the loop.
"""

from __future__ import annotations

import inspect
import signal
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest
from store_helpers import Interrupted, raise_interrupted

from aiokv.adapters.loopthread import LoopThread

BOUND_S = 10.0

Tracer = Callable[[types.FrameType, str, Any], Any]


@pytest.mark.parametrize("where", ["thread_start", "loop_start"])
def test_an_interrupt_once_the_thread_started_stops_it(where: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    main = threading.get_ident()
    made: list[LoopThread] = []
    signals = [0]
    lines, first = inspect.getsourcelines(LoopThread.__init__)
    wait_line = first + next(i for i, line in enumerate(lines) if line.strip() == "self._started.wait()")

    def handler(signum: int, frame: object) -> None:
        signals[0] += 1
        raise_interrupted(signum, frame)

    def local(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        if signals[0]:
            return None
        if frame.f_code is LoopThread.__init__.__code__:
            if not made:
                made.append(frame.f_locals["self"])
            if where == "loop_start" and event == "line" and frame.f_lineno == wait_line:
                signal.pthread_kill(main, signal.SIGUSR1)  # its handler raises here, before the wait
        elif where == "thread_start" and event == "return" and frame.f_locals["self"].name == "test-loop":
            signal.pthread_kill(main, signal.SIGUSR1)  # its handler raises here, as start() returns
        return local

    def calls(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        return local if frame.f_code in (LoopThread.__init__.__code__, threading.Thread.start.__code__) else None

    previous, tracing = signal.signal(signal.SIGUSR1, handler), sys.gettrace()
    try:
        sys.settrace(calls)
        try:
            with pytest.raises(Interrupted):
                LoopThread("test-loop")
        finally:
            sys.settrace(tracing)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert signals[0] == 1 and len(made) == 1
    thread = made[0]
    try:
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the loop thread was left running"
        assert thread.died is None and thread.loop.is_closed()
    finally:
        thread.close()  # what the test left running (before the fix)
