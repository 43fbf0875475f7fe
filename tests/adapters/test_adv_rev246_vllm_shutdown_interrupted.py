"""Review 246: vLLM's thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C at
shutdown) while the tier's ``shutdown()`` waits in the disk tier's close.

The store's close raises the interrupt at once and goes on on its loop (review 242), but
``shutdown()`` released its view of vLLM's region only after the close returned: the release was
skipped, and a second ``shutdown()`` returned at once (``_shut`` was set). The region stayed
exported for good (vLLM cannot unmap it: ``mmap.close`` raises ``BufferError``). Now the view is let
go once the close ended (never before: until then the close may still pin the region for io_uring),
on the loop thread or by a second ``shutdown()``, which waits ``close_timeout`` for that end.

The interrupt is real (a signal to the thread in ``shutdown()``, its handler raising); the region's
registration is held in its pinning thread (waiting on an event, as its syscall would), so that the
close waits in ``_stop_registering``.
"""

from __future__ import annotations

import asyncio
import gc
import mmap
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from loop_probes import waiting_in
from store_helpers import Interrupted, hold_region_pinning, raise_interrupted, unmaps, wait_for

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, offloading_spec

from aiokv.adapters.vllm import AiokvTier

BOUND_S = 30.0
EARLY_CLOSE_S = 1.0  # close_timeout where a second shutdown comes while the close is still held


@pytest.fixture
def spec(tmp_path: Path) -> Any:
    return offloading_spec(tmp_path / "spec-source")


@pytest.mark.parametrize("after", ["loop", "second_shutdown", "second_shutdown_early"])
def test_an_interrupted_shutdown_lets_go_of_the_region_once_the_close_ended(
    spec: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: str
) -> None:
    """``loop``: nothing calls again, the view goes once the close ended; ``second_shutdown``: a
    second call after that end lets go of it; ``second_shutdown_early``: one while the close is
    still held raises after ``close_timeout``, holding on to the region, and a third lets go."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    entered, gate = hold_region_pinning(monkeypatch, BOUND_S)
    region = mmap.mmap(-1, 4 * CHUNK_BYTES)  # vLLM's region: a mapping it unmaps after shutdown
    view = memoryview(region).cast("B", (4, CHUNK_BYTES))
    tier = AiokvTier(spec, view, "aiokv", disk_dir=str(tmp_path / "cache"), disk_bytes=64 * CHUNK_BYTES,
                     queue_depth=4, close_timeout=EARLY_CLOSE_S if after == "second_shutdown_early" else BOUND_S)
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
        # The pin's own views export the region meanwhile; the tier's view must not go either.
        assert not unmaps(region) and tier._bytes_view.nbytes, "let go while the close may still pin the region"
        if after == "second_shutdown_early":
            with pytest.raises(RuntimeError, match="still running"):
                tier.shutdown()
            assert not unmaps(region) and tier._bytes_view.nbytes, "let go while the close may still pin the region"
        gate.set()
        if after == "loop":
            wait_for(lambda: unmaps(region), "the region let go once the close ended", BOUND_S)
        else:
            if after == "second_shutdown_early":
                assert store.wait_closed(BOUND_S)  # its close_timeout is short
            tier.shutdown()  # waits for the close's end; before: returned at once, the region exported
            assert unmaps(region), "the region is still exported after a second shutdown"
        tier.shutdown()  # returns at once
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the store's loop thread was never stopped"
    finally:
        signal.signal(signal.SIGUSR1, previous)
        gate.set()
        helper.join(BOUND_S)
        thread._thread.join(BOUND_S)
    gc.collect()
