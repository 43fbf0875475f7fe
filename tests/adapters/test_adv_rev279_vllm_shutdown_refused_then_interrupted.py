"""Helper 279: vLLM's ``shutdown()`` where no thread may start (a pids limit reached: ``RuntimeError:
can't start new thread``), interrupted once (a ``KeyboardInterrupt`` from a signal handler) at the
entry of the inline close it then makes, before that close began. A later ``shutdown()`` must close the
disk tier and let go of vLLM's region, as before the close moved to a thread of its own: waiting only
for the first call's close thread (which never ran), it raised ``RuntimeError`` ("still running") at
every call, the tier open for good. It now makes that close itself when it never began.

The faults are real: vLLM's thread moved into a pids cgroup (v1) at its limit, and ``SIGUSR1`` sent to
it (its handler raising) by a trace function (``sys.settrace``: call and line events) at the entry of the
first function called after the tier was marked shut. Root only.
"""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import pytest
from store_helpers import PIDS, Interrupted, interrupt_at_first_call_after, pids_limited, tier_closed, unmaps

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, offloading_spec

from aiokv.adapters.vllm import AiokvTier

BOUND_S = 10.0


@pytest.mark.root
def test_a_later_shutdown_closes_what_an_interrupted_inline_close_never_began(tmp_path: Path) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    spec = offloading_spec(tmp_path / "spec-source")
    region = mmap.mmap(-1, 4 * CHUNK_BYTES)  # vLLM's region: a mapping it unmaps after shutdown
    view = memoryview(region).cast("B", (4, CHUNK_BYTES))
    tier = AiokvTier(spec, view, "aiokv", disk_dir=str(tmp_path / "cache"), disk_bytes=64 * CHUNK_BYTES,
                     queue_depth=4, close_timeout=BOUND_S)
    store = tier._store
    thread = store.thread
    disk = store._disk
    assert disk is not None
    try:
        with pids_limited("rev279", BOUND_S) as group:
            (group / "tasks").write_text(str(threading.get_native_id()))  # from here on no thread may start
            try:
                tracing = interrupt_at_first_call_after(AiokvTier.shutdown.__code__,
                                                        lambda frame: bool(frame.f_locals["self"]._shut))
                with tracing as sent, pytest.raises(Interrupted):
                    tier.shutdown()
            finally:
                (PIDS / "tasks").write_text(str(threading.get_native_id()))
        assert sent == ["Aside.run"], sent
        assert not tier_closed(disk), "the inline close began: not the case this test is about"
        view.release()  # vLLM's own view
        tier.shutdown()  # before: RuntimeError after close_timeout, at every call
        assert tier_closed(disk), "the disk tier was never closed"
        assert unmaps(region), "vLLM's region is still exported after a second shutdown"
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the store's loop thread was left running"
        tier.shutdown()  # returns at once
    finally:
        if not tier_closed(disk):
            store.close()
        thread._thread.join(BOUND_S)
