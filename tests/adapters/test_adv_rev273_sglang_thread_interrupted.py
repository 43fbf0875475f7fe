"""Helper 273: SGLang's thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C at
start-up) as ``open_thread`` returned the pools' loop thread to the backend's open (``_open_all``),
before the backend kept it: the open raised with the loop thread running for good (idle, holding
nothing, unknown to ``close()``). ``open_thread`` now constructs it into a list of the caller's by C
code (``list.extend`` over ``map``: no signal handler runs between the constructor's return and the
append), inside the ``try`` whose cleanup stops it.

The interrupt is real (``SIGUSR1`` to SGLang's thread, its handler raising), sent by a trace function
(``sys.settrace``) at ``open_thread``'s return event: raised there, it discards what the function
returns, as an interrupt handled at the end of that call did.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from store_helpers import Interrupted, interrupt_as_open_thread_returns

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make engines installs it)")
sglang_helpers = pytest.importorskip("sglang_helpers")

BOUND_S = 10.0



def test_an_interrupt_as_the_loop_thread_was_made_stops_it(tmp_path: Path, backends: list[Any]) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    h = sglang_helpers
    backend = h.attach(backends, tmp_path / "kv", h.host_pool(4), True, options={"close_timeout": BOUND_S})
    with interrupt_as_open_thread_returns() as (made, signals), pytest.raises(Interrupted):
        backend.on_host_pools_registered()  # SGLang's controller: opens the pools' files
    assert signals[0] == 1 and len(made) == 1
    thread = made[0]
    try:
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the pools' loop thread was left running"
        assert backend._thread is None and not backend._pools and not backend._stores
        for other in threading.enumerate():
            if other.name == "aiokv-sglang-close":
                other.join(BOUND_S)
                assert not other.is_alive(), "the cleanup's thread was left running"
    finally:
        thread.close()  # what the test left running (before the fix)
