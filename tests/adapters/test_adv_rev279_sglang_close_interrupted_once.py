"""Helper 279: SGLang's thread interrupted once (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C at
shutdown) as the backend's ``close()`` began, at the first point after its entry where a signal's handler
runs: before, the entry of ``_close_pools``, after ``close()`` had marked the backend closed and before
the close thread started. The interrupt skipped the whole close, which SGLang makes once: the disk tier
open for good (threads, ring, directory lock), its staging pool mapped, the loop thread running.

``close()``'s first call now hands the close over to a thread of its own (``_thread.start_new_thread``,
C code: no signal's handler runs before it), and the first such point is the wait for it: the interrupt
is raised there and the close goes on to its end.

The interrupt is real (``SIGUSR1`` to SGLang's thread, its handler raising), sent by a trace function
(``sys.settrace``) at the entry of the first function ``close()`` calls.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from store_helpers import Interrupted, interrupt_at_first_call_after, tier_closed, wait_for

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make engines installs it)")
sglang_helpers = pytest.importorskip("sglang_helpers")

from aiokv.adapters.sglang import AiokvHiCacheStorage  # noqa: E402  (after the skip: SGLang is imported)

BOUND_S = 10.0


def _segments() -> set[str]:
    """This process's aiokv segments in /dev/shm (named ``aiokv-<pid>-...``)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"aiokv-{os.getpid()}-")}


def test_one_interrupt_as_close_began_still_closes_every_pool(tmp_path: Path, backends: list[Any]) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    h = sglang_helpers
    before = _segments()
    pool = h.host_pool(4)
    backend = h.attach(backends, tmp_path / "kv", pool, True, options={"close_timeout": BOUND_S})
    h.fill(pool, 0, seed=0)
    assert backend.batch_set_v1(["p0"], h.indices([0])) == [True]
    thread = backend._loop()
    stores = [p.store for p in backend._pools.values() if p.store is not None]
    disks = [s._disk for s in stores]
    assert stores and all(d is not None for d in disks)
    tracing = interrupt_at_first_call_after(AiokvHiCacheStorage.close.__code__, lambda frame: True)
    with tracing as sent, pytest.raises(Interrupted):
        backend.close()
    assert len(sent) == 1, sent
    # The close goes on on its thread (before: nothing closes them).
    wait_for(lambda: all(tier_closed(d) for d in disks), f"every disk tier closed (interrupted at {sent[0]})",
             BOUND_S)
    # The staging pool is let go once its tier's close ended, a step later on the loop: waited for (an
    # assert right after the tiers' close failed once in a full run).
    wait_for(lambda: all(s._pool is None or s._pool.memory.segment.closed for s in stores),
             "every staging pool let go", BOUND_S)
    thread._thread.join(BOUND_S)
    assert not thread._thread.is_alive(), "the pools' loop thread was left running"
    assert backend._thread is None and not backend._stores
    wait_for(lambda: not any(t.name.startswith("aiokv-") for t in threading.enumerate()),
             "the backend's threads ended", BOUND_S)
    assert _segments() <= before, "a staging segment was left in /dev/shm"
    backend.close()  # returns at once
    again = h.attach(backends, tmp_path / "kv", h.host_pool(4), True)  # its directory lock was let go
    assert again.batch_exists(["p0"]) == 1
    assert again.batch_set_v1(["p1"], h.indices([1])) == [True], "the directory is still locked (read-only)"
