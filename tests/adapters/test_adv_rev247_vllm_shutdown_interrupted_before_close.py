"""Review 247: vLLM's thread interrupted (a ``KeyboardInterrupt`` from a signal handler) in the
tier's ``shutdown()`` after it marked itself shut and before the store's close began.

The tier asked the store to call back once its close ended (review 246), and the store, no close
running, called at once: the tier let go of vLLM's region with the disk tier still open (its ring
with the region registered, its loop and threads running), and a second ``shutdown()`` returned at
once: the disk tier was never closed. Now the callback waits for a close to end, and a second
``shutdown()`` closes the store, then lets go of the region. Since helper 279 the store's close runs on
a thread of its own that ``shutdown()`` hands it to: the interrupt lands in the wait for it, the close
held on that thread, and the second ``shutdown()`` waits for its end.

The interrupt is real (a signal to the thread in ``shutdown()``, its handler raising); the test
chooses its moment: the store's ``close()`` waits on an event before it runs.
"""

from __future__ import annotations

import mmap
import signal
import threading
from pathlib import Path

import pytest
from store_helpers import Interrupted, raise_interrupted, released, tier_closed, unmaps

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, offloading_spec

from aiokv.adapters.vllm import AiokvTier

BOUND_S = 30.0


def test_an_interrupt_before_the_stores_close_began_holds_the_region_until_a_shutdown_closed_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
    main = threading.get_ident()
    real, waiting, held = store.close, threading.Event(), threading.Event()

    def close() -> None:
        if not waiting.is_set():
            waiting.set()
            held.wait(BOUND_S)  # the signal lands here, before the close began
        real()

    monkeypatch.setattr(store, "close", close)

    def interrupter() -> None:
        assert waiting.wait(BOUND_S)
        signal.pthread_kill(main, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, raise_interrupted)
    helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
    try:
        helper.start()
        with pytest.raises(Interrupted):
            tier.shutdown()
        helper.join(BOUND_S)
        view.release()  # vLLM's own view
        assert not tier_closed(disk) and thread._thread.is_alive()
        assert not released(tier._bytes_view), "let go of the region before the disk tier's close began"
        assert not unmaps(region)
        held.set()  # since helper 279 the close goes on on a thread of its own: now it begins
        tier.shutdown()  # waits for that close (before: closed the store now), then lets go
        assert tier_closed(disk), "the disk tier was never closed"
        assert unmaps(region), "the region is still exported after a second shutdown"
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the store's loop thread was never stopped"
        tier.shutdown()  # returns at once
    finally:
        signal.signal(signal.SIGUSR1, previous)
        held.set()
        helper.join(BOUND_S)
        thread._thread.join(BOUND_S)
