"""Review 251: vLLM's thread interrupted twice in the store's ``close()`` (two ``KeyboardInterrupt``
from a signal handler: Ctrl-C pressed twice at shutdown): the first in the hand-over of the close
to the loop, the second in the hand-over ``close()``'s ``finally`` makes again (review 247).

``unscheduled``: the second landed before the close was scheduled: no close ran, the store
counted it begun, and a later ``close()`` (vLLM's second ``shutdown()``) returned at once: the disk
tier open for good (its ring with vLLM's region registered, its loop thread running) and the region
held (the second ``shutdown()`` raised after ``close_timeout``, again and again). A later ``close()``
now makes the hand-over again (the loop runs the close once).
``scheduled``: the second landed after it was scheduled: the close ran, but the ``finally`` never
arranged the stop of the store's own loop thread, left running for good. The stop now follows the
close's future, arranged when it is made.

The interrupts are real (a signal to the thread in ``shutdown()``, its handler raising); the test
chooses their moments: the hand-over (``LoopThread.submit``) waits on an event before (or for the
second, after) it schedules.
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
from store_helpers import Interrupted, raise_interrupted, refuse_thread, released, tier_closed, unmaps, wait_for

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, offloading_spec

import aiokv.adapters.vllm as vllm_module
from aiokv.adapters.vllm import AiokvTier

BOUND_S = 30.0
CLOSE_S = 5.0  # close_timeout: how long a second shutdown waits for a close that never runs (before the fix)


@pytest.mark.parametrize("second", ["unscheduled", "scheduled"])
def test_a_second_interrupt_in_the_remade_hand_over_still_closes_the_disk_tier_and_stops_its_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    spec = offloading_spec(tmp_path / "spec-source")
    region = mmap.mmap(-1, 4 * CHUNK_BYTES)  # vLLM's region: a mapping it unmaps after shutdown
    view = memoryview(region).cast("B", (4, CHUNK_BYTES))
    tier = AiokvTier(spec, view, "aiokv", disk_dir=str(tmp_path / "cache"), disk_bytes=64 * CHUNK_BYTES,
                     queue_depth=4, close_timeout=CLOSE_S)
    store = tier._store
    thread = store.thread
    disk = store._disk
    assert disk is not None
    main = threading.get_ident()
    real = thread.submit
    hand_overs = 0
    waiting, pause = threading.Semaphore(0), threading.Event()
    signals = 0  # handled so far

    def hold() -> None:
        """Wait for the next signal in short waits (see review 247's hand-over test)."""
        handled = signals
        waiting.release()
        deadline = time.monotonic() + BOUND_S
        while signals == handled and time.monotonic() < deadline:
            pause.wait(0.01)

    def submit(coro: Coroutine[Any, Any, Any]) -> Any:
        nonlocal hand_overs
        if not coro.__qualname__.startswith("PageFileStore._close"):
            return real(coro)
        hand_overs += 1
        if hand_overs > 2:
            return real(coro)
        if hand_overs == 2 and second == "scheduled":
            handed = real(coro)  # the close runs; the second signal lands before its future is returned
            hold()
            return handed
        try:
            hold()  # a signal lands here, before the close is scheduled
        except BaseException:
            coro.close()
            raise
        return real(coro)

    monkeypatch.setattr(thread, "submit", submit)
    # Since helper 279 shutdown() closes the store on a thread of its own, which no interrupt reaches: made
    # on vLLM's thread here, as where no thread may start (a pids limit), the case this test is about.
    monkeypatch.setattr(vllm_module, "_thread", types.SimpleNamespace(start_new_thread=refuse_thread))

    def interrupter() -> None:
        for _ in range(2):
            assert waiting.acquire(timeout=BOUND_S)
            signal.pthread_kill(main, signal.SIGUSR1)

    def handler(signum: int, frame: object) -> None:
        nonlocal signals
        signals += 1
        raise_interrupted(signum, frame)

    previous = signal.signal(signal.SIGUSR1, handler)
    helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
    try:
        helper.start()
        with pytest.raises(Interrupted) as raised:
            tier.shutdown()
        assert isinstance(raised.value.__context__, Interrupted), "the second interrupt did not land in the finally"
        del raised
        helper.join(BOUND_S)
        assert hand_overs == 2
        view.release()  # vLLM's own view
        if second == "unscheduled":
            # Nothing runs the close now: the region is held until a later shutdown() closed the tier.
            assert not tier_closed(disk) and not released(tier._bytes_view)
            tier.shutdown()  # makes the hand-over again; before: raised after close_timeout, the close never run
            assert tier_closed(disk), "the disk tier was never closed"
            assert unmaps(region), "the region is still exported after a second shutdown"
        else:
            wait_for(lambda: tier_closed(disk), "the disk tier closed", BOUND_S)
            wait_for(lambda: unmaps(region), "the region let go once the close ended", BOUND_S)
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the store's loop thread was never stopped"
        tier.shutdown()  # returns at once
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a signal still to come (a failure) is not raised here
        waiting.release(2)
        helper.join(BOUND_S)
        signal.signal(signal.SIGUSR1, previous)
        store.close()  # whatever the test left: the close handed over, the thread stopped
        thread._thread.join(BOUND_S)
