"""Review 247: vLLM's thread interrupted (a ``KeyboardInterrupt`` from a signal handler) while the
tier's ``shutdown()`` waits in the disk tier's close, and the store's loop thread dying before that
close ended (review 246 lets go of the region once the close ended).

The death's end cancels the close (its future fails with ``LoopDied``) before its finalizer closes
the disk tier, which still holds vLLM's region (its registration pinning it, its views). The tier
let go of the region at that cancel, on the loop thread: under the open disk tier, or, its view
still exported by the pin, never (the callback's release failed and nothing called it again).
Now the release waits for the dying thread's end (its finalizer closed the tier).

The interrupt and the death are real (a signal to the thread in ``shutdown()``; a callback letting
``SystemExit`` out on the loop thread); the region's registration is held in its pinning thread
(waiting on an event, as its syscall would), so that the close waits in ``_stop_registering``.
"""

from __future__ import annotations

import asyncio
import gc
import mmap
import signal
import threading
from pathlib import Path

import pytest
from loop_probes import waiting_in
from store_helpers import Interrupted, hold_region_pinning, raise_interrupted, released, tier_closed, unmaps, wait_for

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, offloading_spec

from aiokv.adapters.vllm import AiokvTier

BOUND_S = 30.0


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


@pytest.mark.parametrize("after", ["loop", "second_shutdown"])
def test_a_death_cutting_an_interrupted_shutdowns_close_lets_go_of_the_region_after_the_finalizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: str
) -> None:
    """``loop``: nothing calls again, the view goes once the dying thread ended; ``second_shutdown``:
    a second call waits for that end (its finalizer closed the disk tier) and lets go of it."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    spec = offloading_spec(tmp_path / "spec-source")  # (its own tier registers freely)
    entered, gate = hold_region_pinning(monkeypatch, BOUND_S)
    region = mmap.mmap(-1, 4 * CHUNK_BYTES)  # vLLM's region: a mapping it unmaps after shutdown
    view = memoryview(region).cast("B", (4, CHUNK_BYTES))
    tier = AiokvTier(spec, view, "aiokv", disk_dir=str(tmp_path / "cache"),
                     disk_bytes=64 * CHUNK_BYTES, queue_depth=4, close_timeout=BOUND_S)
    store = tier._store
    thread = store.thread
    main = threading.get_ident()

    def interrupter() -> None:
        def close_waits() -> bool:
            return bool(thread.call(lambda: any(waiting_in(t, "_stop_registering")
                                                for t in asyncio.all_tasks())).result())

        wait_for(close_waits, "the close waiting for the registration", BOUND_S)
        signal.pthread_kill(main, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, raise_interrupted)
    helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
    try:
        if not entered.wait(BOUND_S):
            pytest.skip("the disk tier did not register the region (no io_uring here)")
        helper.start()
        with pytest.raises(Interrupted):
            tier.shutdown()
        helper.join(BOUND_S)
        view.release()  # vLLM's own view
        closing = store._closing
        assert closing is not None, "the interrupt came after the close ended"
        cut = threading.Event()
        closing.add_done_callback(lambda _: cut.set())  # after the tier's own callback
        thread.loop.call_soon_threadsafe(_die)
        assert cut.wait(BOUND_S), "the death did not cut the close"
        assert thread.died is not None and not thread.dead  # its end waits for the held pin
        disk = store._disk
        assert disk is not None and not tier_closed(disk), "the disk tier closed before the pin ended"
        # The disk tier is still open (the finalizer runs once the pin ended): the region is its.
        assert not released(tier._bytes_view), "let go of the region under the open disk tier"
        assert not unmaps(region)
        if after == "second_shutdown":
            assert not store.wait_closed(0.1), "the close counted as ended under the open disk tier"
        gate.set()
        if after == "loop":
            wait_for(lambda: unmaps(region), "the region let go once the dying thread ended", BOUND_S)
        else:
            tier.shutdown()  # waits for the dying thread's end
            assert unmaps(region), "the region is still exported after a second shutdown"
        assert tier_closed(disk), "the dying loop's finalizer did not close the disk tier"
        tier.shutdown()  # returns at once
        assert thread.wait_ended(BOUND_S)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        gate.set()
        helper.join(BOUND_S)
        thread._thread.join(BOUND_S)
    gc.collect()
