"""Review 251: vLLM's thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C at
start-up) in the tier's constructor after its store started and vLLM's region was registered, in
the bookkeeping that followed (here in its last call, the log line saying the tier started).

Only the store's start and the region's registration were in the ``try`` whose cleanup closes the
store: the constructor raised with the disk tier open for good (its loop thread, ring with the region
registered, directory lock) and nobody left to close it (vLLM never got the tier), the region
exported for good. Now everything after the store's start is in that ``try``.

The interrupt is real (a signal to the constructing thread, its handler raising); the test chooses
its moment: the tier's log line waits for it.
"""

from __future__ import annotations

import logging
import mmap
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from store_helpers import Interrupted, raise_interrupted, tier_closed, unmaps, wait_for

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, offloading_spec

import aiokv.adapters.vllm as vllm_module
from aiokv.adapters.loopthread import LoopThread
from aiokv.adapters.store import PageFileStore
from aiokv.adapters.vllm import AiokvTier

BOUND_S = 30.0


def test_an_interrupt_after_the_stores_start_still_closes_it_and_lets_go_of_the_region(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    spec = offloading_spec(tmp_path / "spec-source")
    main = threading.get_ident()
    waiting = threading.Event()
    signals = 0
    stores: list[PageFileStore] = []
    real_init = PageFileStore.__init__

    def init(self: PageFileStore, *args: Any, **kwargs: Any) -> None:
        stores.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(PageFileStore, "__init__", init)

    class Held(logging.LoggerAdapter):  # type: ignore[type-arg]
        def info(self, msg: object, *args: Any, **kwargs: Any) -> None:
            if isinstance(msg, str) and msg.startswith("aiokv tier: %s (") and not waiting.is_set():
                waiting.set()
                pause, deadline = threading.Event(), time.monotonic() + BOUND_S
                while not signals and time.monotonic() < deadline:
                    pause.wait(0.01)  # the signal lands here (short waits: see review 247's hand-over test)
            super().info(msg, *args, **kwargs)

    monkeypatch.setattr(vllm_module, "log", Held(vllm_module.log, {}))

    def interrupter() -> None:
        assert waiting.wait(BOUND_S)
        signal.pthread_kill(main, signal.SIGUSR1)

    def handler(signum: int, frame: object) -> None:
        nonlocal signals
        signals += 1
        raise_interrupted(signum, frame)

    previous = signal.signal(signal.SIGUSR1, handler)
    helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
    region = mmap.mmap(-1, 4 * CHUNK_BYTES)  # vLLM's region: a mapping it unmaps after shutdown
    view = memoryview(region).cast("B", (4, CHUNK_BYTES))
    thread: LoopThread | None = None
    try:
        helper.start()
        with pytest.raises(Interrupted):
            AiokvTier(spec, view, "aiokv", disk_dir=str(tmp_path / "cache"), disk_bytes=64 * CHUNK_BYTES,
                      queue_depth=4, close_timeout=BOUND_S)
        helper.join(BOUND_S)
        view.release()  # vLLM's own view
        assert signals == 1 and len(stores) == 1
        store = stores[0]
        thread = store.thread
        disk = store._disk
        wait_for(lambda: tier_closed(disk), "the disk tier closed after the interrupted start", BOUND_S)
        wait_for(lambda: unmaps(region), "the region let go once the close ended", BOUND_S)
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the store's loop thread was never stopped"
    finally:
        signal.signal(signal.SIGUSR1, previous)
        helper.join(BOUND_S)
        for store in stores:
            store.close()  # what the test left open (before the fix)
