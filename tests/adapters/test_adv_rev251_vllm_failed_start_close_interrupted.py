"""Review 251: a vLLM tier whose start failed once its region's registration began (here a first
interrupt, Ctrl-C at start-up), its cleanup's store close interrupted in turn (a second one).

The cleanup let go of the tier's view of vLLM's region at once, in a ``finally``, while the
store's close went on on its loop (review 242), which may still pin the region for io_uring (it
waits for the registration's pinning thread): the same rule as ``shutdown()`` now holds, the
view is let go only once that close ended (``PageFileStore.when_closed``).

Both interrupts are real (a signal to the thread in the tier's constructor, its handler raising);
the test chooses their moments: the first once the registration was handed over (its pinning
held, waiting on an event as its syscall would), the second once the close waits for that pin.
"""

from __future__ import annotations

import asyncio
import mmap
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
from loop_probes import waiting_in
from store_helpers import Interrupted, hold_region_pinning, raise_interrupted, released, tier_closed, unmaps, wait_for

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, offloading_spec

from aiokv.adapters.loopthread import LoopThread
from aiokv.adapters.vllm import AiokvTier

BOUND_S = 30.0


def _tier_of(tb: TracebackType | None) -> AiokvTier:
    """The tier whose constructor raised (its frame is in the exception's traceback)."""
    while tb is not None:
        found = tb.tb_frame.f_locals.get("self")
        if isinstance(found, AiokvTier):
            return found
        tb = tb.tb_next
    raise AssertionError("no AiokvTier frame in the traceback")


def test_an_interrupted_close_of_a_failed_start_lets_go_of_the_region_only_once_it_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    spec = offloading_spec(tmp_path / "spec-source")
    entered, gate = hold_region_pinning(monkeypatch, BOUND_S)
    main = threading.get_ident()
    stores: list[Any] = []
    first, interrupted = threading.Event(), threading.Event()
    real_call = LoopThread.call

    def call(self: LoopThread, fn: Callable[[], Any]) -> Any:
        handed = real_call(self, fn)
        if first.is_set() or "AiokvTier.__init__" not in fn.__qualname__:
            return handed
        handed.result()  # the registration began
        stores.append(self)
        first.set()
        if entered.wait(BOUND_S):  # its pinning is held: the close will wait for it
            deadline = time.monotonic() + BOUND_S
            while not interrupted.wait(0.01) and time.monotonic() < deadline:
                pass  # the first signal lands here (short waits: see review 247's hand-over test)
        return handed

    monkeypatch.setattr(LoopThread, "call", call)

    def interrupter() -> None:
        assert first.wait(BOUND_S)
        if not entered.wait(BOUND_S):
            return
        signal.pthread_kill(main, signal.SIGUSR1)
        thread = stores[0]

        def close_waits() -> bool:
            return bool(thread.call(lambda: any(waiting_in(t, "_stop_registering")
                                                for t in asyncio.all_tasks())).result())

        wait_for(close_waits, "the cleanup's close waiting for the registration", BOUND_S)
        signal.pthread_kill(main, signal.SIGUSR1)

    def handler(signum: int, frame: object) -> None:
        interrupted.set()
        raise_interrupted(signum, frame)

    previous = signal.signal(signal.SIGUSR1, handler)
    helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
    region = mmap.mmap(-1, 4 * CHUNK_BYTES)  # vLLM's region: a mapping it unmaps after shutdown
    view = memoryview(region).cast("B", (4, CHUNK_BYTES))
    try:
        helper.start()
        with pytest.raises(Interrupted) as raised:
            AiokvTier(spec, view, "aiokv", disk_dir=str(tmp_path / "cache"), disk_bytes=64 * CHUNK_BYTES,
                      queue_depth=4, close_timeout=BOUND_S)
        helper.join(BOUND_S)
        if not entered.is_set():
            pytest.skip("the disk tier did not register the region (no io_uring here)")
        assert isinstance(raised.value.__context__, Interrupted), "the second interrupt did not land in the cleanup"
        tier = _tier_of(raised.tb)
        del raised
        view.release()  # vLLM's own view
        disk = tier._store._disk
        thread = tier._store.thread
        # The pin's own views export the region meanwhile; the tier's view must not go either.
        assert not tier_closed(disk) and not released(tier._bytes_view), \
            "let go of the region while the failed start's close may still pin it"
        assert not unmaps(region)
        gate.set()
        wait_for(lambda: tier_closed(disk), "the disk tier closed", BOUND_S)
        wait_for(lambda: unmaps(region), "the region let go once the close ended", BOUND_S)
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the store's loop thread was never stopped"
    finally:
        signal.signal(signal.SIGUSR1, previous)
        gate.set()
        helper.join(BOUND_S)
        for thread in stores:
            thread._thread.join(BOUND_S)
