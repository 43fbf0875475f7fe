"""Review 247: vLLM's thread interrupted (a ``KeyboardInterrupt`` from a signal handler) in the
store's ``close()`` after it marked itself begun and before the hand-over of its close to the loop
returned.

No close ran then: ``close()`` stopped the store's loop (the disk tier left open for good: its
ring with vLLM's region registered, its threads and lock), ``wait_closed`` answered True and the
tier let go of vLLM's region at once, under that open disk tier. The close's future is now the
store's, made before the close is marked begun, and an interrupted hand-over is made again: the
close runs to its end on the loop, then the region is let go and the thread stopped.

The interrupt is real (a signal to the thread in ``shutdown()``, its handler raising); the test
chooses its moment: the hand-over (``LoopThread.submit``) waits on an event before or after it
schedules. (Scheduled, the interrupt had ``close()`` stop the loop under the running close.)
Since helper 279 ``shutdown()`` closes the store on a thread of its own, which no interrupt reaches: the
test has it close the store on vLLM's thread, as where no thread may start (a pids limit).
"""

from __future__ import annotations

import mmap
import signal
import threading
import time
import types
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from store_helpers import Interrupted, raise_interrupted, refuse_thread, tier_closed, unmaps, wait_for

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, offloading_spec

import aiokv.adapters.vllm as vllm_module
from aiokv.adapters.vllm import AiokvTier

BOUND_S = 30.0


def _hold(held: threading.Event) -> None:
    """Wait for ``held`` in short waits: after another file's test, the signal sent while this thread
    waited in one long ``Event.wait`` ran its handler only once that wait timed out (30 s; cause
    not found: no mask, nothing pending, the thread back in its futex), so the interrupt landed
    after the hand-over, not in it. A short wait's return runs the handler within 10 ms."""
    deadline = time.monotonic() + BOUND_S
    while not held.wait(0.01) and time.monotonic() < deadline:
        pass


@pytest.mark.parametrize("when", ["unscheduled", "scheduled"])
def test_an_interrupt_in_the_hand_over_of_the_close_still_closes_the_disk_tier_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """``unscheduled``: the signal lands before the close was scheduled on the loop (the hand-over is
    made again); ``scheduled``: after (the close runs, and runs once although handed over again)."""
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
    real, waiting, held = thread.submit, threading.Event(), threading.Event()

    def submit(coro: Coroutine[Any, Any, Any]) -> Any:
        if waiting.is_set() or not coro.__qualname__.startswith("PageFileStore._close"):
            return real(coro)
        if when == "scheduled":
            handed = real(coro)  # the close runs; the signal lands before its future is returned
            waiting.set()
            _hold(held)
            return handed
        waiting.set()
        try:
            _hold(held)  # the signal lands here, before the close is scheduled
        except BaseException:
            coro.close()
            raise
        return real(coro)

    monkeypatch.setattr(thread, "submit", submit)
    # Since helper 279 shutdown() closes the store on a thread of its own, which no interrupt reaches: made
    # on vLLM's thread here, as where no thread may start (a pids limit), the case this test is about.
    monkeypatch.setattr(vllm_module, "_thread", types.SimpleNamespace(start_new_thread=refuse_thread))

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
        wait_for(lambda: tier_closed(disk), "the disk tier closed after the interrupted hand-over", BOUND_S)
        wait_for(lambda: unmaps(region), "the region let go once the close ended", BOUND_S)
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the store's loop thread was never stopped"
        tier.shutdown()  # returns at once
    finally:
        signal.signal(signal.SIGUSR1, previous)
        held.set()
        helper.join(BOUND_S)
        thread._thread.join(BOUND_S)
