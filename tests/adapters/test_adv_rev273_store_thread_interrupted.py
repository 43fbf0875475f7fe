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

import threading
from pathlib import Path

import pytest
from store_helpers import Interrupted, interrupt_as_open_thread_returns

from aiokv.adapters.store import PageFileStore, StoreConfig

BOUND_S = 10.0
PAGE_BYTES = 8192



def test_an_interrupt_as_the_stores_own_thread_was_made_stops_it(tmp_path: Path) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    config = StoreConfig.from_options({"disk_dir": str(tmp_path / "cache"), "disk_bytes": 64 * PAGE_BYTES})
    with interrupt_as_open_thread_returns() as (made, signals), pytest.raises(Interrupted):
        PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)
    assert signals[0] == 1 and len(made) == 1
    thread = made[0]
    try:
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the store's own loop thread was left running"
    finally:
        thread.close()  # what the test left running (before the fix)
    store = PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)  # nothing was opened: it starts
    store.close()
