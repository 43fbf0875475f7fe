"""Helper 279: ``LoopThread.close()`` interrupted once (a ``KeyboardInterrupt`` from a signal handler:
Ctrl-C) at the first point after it counted the loop closed where a signal's handler runs: before, the
entry of ``loop.call_soon_threadsafe``, the stop never asked. A close made once (SGLang's pools' thread,
a store's own, an owner's) left the loop running for good, counted as closed.

The stop is now asked by a bare thread, handed it by the first call after the mark
(``_thread.start_new_thread``, C code: no signal's handler runs before it); the interrupt lands in the
join that follows, and the loop stops all the same.

The interrupt is real (``SIGUSR1`` to the closing thread, its handler raising), sent by a trace function
(``sys.settrace``: call and line events) at the entry of the first function called after the mark.
"""

from __future__ import annotations

import threading

import pytest
from store_helpers import Interrupted, interrupt_at_first_call_after

from aiokv.adapters.loopthread import LoopThread

BOUND_S = 10.0


def test_one_interrupt_after_the_close_was_marked_still_stops_the_loop() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    thread = LoopThread("test-rev279-close")
    loop = thread.loop
    assert thread.call(lambda: 1).result(BOUND_S) == 1
    try:
        tracing = interrupt_at_first_call_after(LoopThread.close.__code__,
                                                lambda frame: bool(frame.f_locals["self"]._closed))
        with tracing as sent, pytest.raises(Interrupted):
            thread.close()
        assert len(sent) == 1, sent
        assert thread.wait_ended(BOUND_S), f"the loop thread was left running (interrupted at {sent[0]})"
        assert thread.died is None and loop.is_closed()
    finally:
        if not thread.wait_ended(0):
            loop.call_soon_threadsafe(loop.stop)
            thread.wait_ended(BOUND_S)
