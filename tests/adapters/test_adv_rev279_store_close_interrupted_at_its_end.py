"""Helper 279: the engine's thread interrupted once (a ``KeyboardInterrupt`` from a signal handler:
Ctrl-C at shutdown) as a ``PageFileStore``'s ``close()`` ended, at the first point of its ``finally``
where a signal's handler runs: before, the entry of ``_after_close``, which let go of the engine's
memory first. The close itself had ended, but the store kept its views of the engine's registered
region for good: the region stayed exported (vLLM cannot unmap it: ``mmap.close`` raises
``BufferError``) by a store nobody closes again (a later ``close()`` returns at once).

The ``finally`` now lets go of them by its first call (``list.clear``, C code: no signal's handler runs
before it); the interrupt lands at ``_after_close``'s entry after it.

The interrupt is real (``SIGUSR1`` to this thread, its handler raising), sent by a trace function
(``sys.settrace``: call and line events) at the entry of the first function called after the
``finally``'s first line.
"""

from __future__ import annotations

import inspect
import mmap
import os
import threading
import types
from pathlib import Path

import pytest
from store_helpers import Interrupted, exporters, interrupt_at_first_call_after, tier_closed, unmaps, wait_for

from aiokv.adapters.store import PageFileStore, StoreConfig

BOUND_S = 10.0
PAGE_BYTES = 8192


def _finally_line() -> int:
    """The line of ``close()``'s ``finally`` clause's first statement."""
    lines, first = inspect.getsourcelines(PageFileStore.close)
    at = next(i for i, line in enumerate(lines) if line.strip() == "finally:")
    return first + at + 1


def _segments() -> set[str]:
    """This process's aiokv segments in /dev/shm (named ``aiokv-<pid>-...``)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"aiokv-{os.getpid()}-")}


def test_one_interrupt_as_the_close_ended_lets_go_of_the_engines_memory(tmp_path: Path) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    before = _segments()
    config = StoreConfig.from_options({"disk_dir": str(tmp_path / "cache"), "disk_bytes": 64 * PAGE_BYTES,
                                       "close_timeout": BOUND_S})
    store = PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)
    region = mmap.mmap(-1, 4 * PAGE_BYTES)  # the engine's memory
    view = memoryview(region)
    store.thread.call(lambda: store.register_memory(view)).result(BOUND_S)
    store.thread.run(store.wait_registered(), BOUND_S)
    disk = store._disk
    assert disk is not None and store.registered_regions == 1
    line = _finally_line()

    def at_the_finally(frame: types.FrameType) -> bool:
        return frame.f_lineno == line

    try:
        tracing = interrupt_at_first_call_after(PageFileStore.close.__code__, at_the_finally)
        with tracing as sent, pytest.raises(Interrupted):
            store.close()
        assert len(sent) == 1, sent
        assert tier_closed(disk), "the close had not ended"
        view.release()  # the engine's own view
        assert store.registered_regions == 0, f"the store still holds the engine's memory (interrupted at {sent[0]})"
        assert unmaps(region), f"the engine's region is still exported: {exporters(region)}"
        store.thread._thread.join(BOUND_S)
        assert not store.thread._thread.is_alive(), "the store's own loop thread was left running"
        wait_for(lambda: not any(t.name.startswith("aiokv-test") for t in threading.enumerate()),
                 "the store's threads ended", BOUND_S)
        assert _segments() <= before, "a staging segment was left in /dev/shm"
        store.close()  # returns at once
    finally:
        store.close()
        store.thread.close()
