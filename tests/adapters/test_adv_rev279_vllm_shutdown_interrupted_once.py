"""Helper 279: vLLM's thread interrupted once (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C at
shutdown) in the tier's ``shutdown()`` at the first point after it marked itself shut where a signal's
handler runs: before, the entry of the store's ``close()``, no close begun. vLLM shuts a tier down
once: the disk tier was left open for good (its loop thread, ring and directory lock) and vLLM's region
exported (review 247's second ``shutdown()`` closed them; none comes).

The store's close and the region's release now run on a thread of their own, handed over by the first
call after the mark (``_thread.start_new_thread``, C code: no signal's handler runs before it); the
interrupt lands in the wait for it, and the close goes on to its end.

The interrupt is real (``SIGUSR1`` to vLLM's thread, its handler raising), sent by a trace function
(``sys.settrace``: call and line events) at the entry of the first function called after the mark.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import pytest
from store_helpers import Interrupted, exporters, interrupt_at_first_call_after, tier_closed, unmaps, wait_for

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, offloading_spec

from aiokv.adapters.vllm import AiokvTier

BOUND_S = 10.0


def _segments() -> set[str]:
    """This process's aiokv segments in /dev/shm (named ``aiokv-<pid>-...``)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"aiokv-{os.getpid()}-")}


def test_one_interrupt_after_the_tier_was_marked_shut_still_closes_it(tmp_path: Path) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    before = _segments()
    spec = offloading_spec(tmp_path / "spec-source")
    region = mmap.mmap(-1, 4 * CHUNK_BYTES)  # vLLM's region: a mapping it unmaps after shutdown
    view = memoryview(region).cast("B", (4, CHUNK_BYTES))
    config = {"disk_dir": str(tmp_path / "cache"), "disk_bytes": 64 * CHUNK_BYTES, "queue_depth": 4,
              "close_timeout": BOUND_S}
    tier = AiokvTier(spec, view, "aiokv", **config)
    store = tier._store
    thread = store.thread
    disk = store._disk
    assert disk is not None
    try:
        tracing = interrupt_at_first_call_after(AiokvTier.shutdown.__code__,
                                                lambda frame: bool(frame.f_locals["self"]._shut))
        with tracing as sent, pytest.raises(Interrupted):
            tier.shutdown()
        assert len(sent) == 1, sent
        view.release()  # vLLM's own view
        # The close goes on on its thread (before: none began, and nobody calls shutdown() again).
        wait_for(lambda: tier_closed(disk), f"the disk tier closed (interrupted at {sent[0]})", BOUND_S)
        wait_for(lambda: tier._released, "vLLM's region let go", BOUND_S)
        assert unmaps(region), f"the region is still exported: {exporters(region)}"
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the store's loop thread was left running"
        wait_for(lambda: not any(t.name.startswith("aiokv-") for t in threading.enumerate()),
                 "the tier's threads ended", BOUND_S)
        assert _segments() <= before, "a staging segment was left in /dev/shm"
        region2 = mmap.mmap(-1, 4 * CHUNK_BYTES)
        tier2 = AiokvTier(spec, memoryview(region2).cast("B", (4, CHUNK_BYTES)), "aiokv", **config)
        try:
            disk2 = tier2._store._disk
            assert disk2 is not None and disk2.read_only is None, "the directory lock was never let go"
        finally:
            tier2.shutdown()
    finally:
        if not tier_closed(disk):  # left open (before the fix): closed here
            tier.shutdown()
        thread._thread.join(BOUND_S)
