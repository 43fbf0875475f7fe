"""Helper 273: vLLM's thread interrupted three times as the tier started (three ``KeyboardInterrupt`` from
a signal handler: Ctrl-C pressed three times at start-up): the first once the store was made, the
second in the cleanup's ``store.close()`` before the close began (its first look), the third as that
cleanup went on to call ``close()`` again (review 260's answer to the second).

Made on vLLM's thread, the cleanup let the third out before its second ``close()``: no close began,
the disk tier was left open for good (its threads, ring and directory lock), the store's loop thread
running and vLLM's region exported, with nobody holding the store. The cleanup now runs on a thread of
its own, handed over by the first call of the constructor's ``except`` clause (C code: no signal's
handler runs before it); the constructor waits for it, and the second interrupt lands in that wait.

The interrupts are real (``SIGUSR1`` to vLLM's thread, its handler raising): the first as review 260's
test sends it, the second while close()'s first look is held, the third by a trace function
(``sys.settrace``, line events) in the tier's constructor once the second was handled, at the guard of
its second ``close()`` (since the change, no such line: the second lands in the wait, and no third comes).
"""

from __future__ import annotations

import inspect
import logging
import mmap
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from store_helpers import Interrupted, exporters, raise_interrupted, tier_closed, unmaps, wait_for

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, offloading_spec

import aiokv.adapters.vllm as vllm_module
from aiokv.adapters.loopthread import LoopThread
from aiokv.adapters.store import PageFileStore
from aiokv.adapters.vllm import AiokvTier

BOUND_S = 10.0

Tracer = Callable[[types.FrameType, str, Any], Any]


def test_a_third_interrupt_before_the_cleanups_close_again_still_closes_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    spec = offloading_spec(tmp_path / "spec-source")
    main = threading.get_ident()
    signals = 0
    third = [0]  # line where the third signal was sent (0: none)
    waiting = threading.Semaphore(0)  # a point where the next of the first two signals is to land was reached
    stores: list[PageFileStore] = []
    real_in_loop = LoopThread.in_loop_thread
    real_close = PageFileStore.close

    def hold(handled: int) -> None:
        """Until the signal after ``handled`` was handled, in short waits (see review 247's test)."""
        waiting.release()
        pause, deadline = threading.Event(), time.monotonic() + BOUND_S
        while signals == handled and time.monotonic() < deadline:
            pause.wait(0.01)

    class Held(logging.LoggerAdapter):  # type: ignore[type-arg]
        def info(self, msg: object, *args: Any, **kwargs: Any) -> None:
            if isinstance(msg, str) and msg.startswith("aiokv tier: %s (") and signals == 0:
                hold(0)  # the store made: the first signal lands here
            super().info(msg, *args, **kwargs)

    def in_loop_thread(self: LoopThread) -> bool:
        answer = real_in_loop(self)
        if signals == 1 and not answer:
            hold(1)  # close()'s first look, before the close began, on the thread making the cleanup
        return answer

    def close(self: PageFileStore) -> None:
        if self not in stores:
            stores.append(self)
        real_close(self)

    # Lines of the constructor where the cleanup, interrupted in its close, went on to call close()
    # again (review 260's answer to the second interrupt; gone since the cleanup runs aside).
    lines, first = inspect.getsourcelines(AiokvTier.__init__)
    again = {first + i for i, line in enumerate(lines) if line.strip().startswith("with contextlib.suppress(")}

    def local(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        if event == "line" and frame.f_lineno in again and signals == 2 and not third[0]:
            third[0] = frame.f_lineno
            signal.pthread_kill(main, signal.SIGUSR1)  # on this (vLLM's) thread: its handler raises here
        return local

    def calls(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        return local if frame.f_code is AiokvTier.__init__.__code__ else None

    def interrupter() -> None:
        for _ in range(2):
            assert waiting.acquire(timeout=BOUND_S)
            signal.pthread_kill(main, signal.SIGUSR1)

    def handler(signum: int, frame: object) -> None:
        nonlocal signals
        signals += 1
        raise_interrupted(signum, frame)

    monkeypatch.setattr(vllm_module, "log", Held(vllm_module.log, {}))
    monkeypatch.setattr(LoopThread, "in_loop_thread", in_loop_thread)
    monkeypatch.setattr(PageFileStore, "close", close)
    region = mmap.mmap(-1, 4 * CHUNK_BYTES)  # vLLM's region: a mapping it unmaps after shutdown
    view = memoryview(region).cast("B", (4, CHUNK_BYTES))
    previous, tracing = signal.signal(signal.SIGUSR1, handler), sys.gettrace()
    helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
    try:
        helper.start()
        sys.settrace(calls)
        try:
            with pytest.raises(Interrupted) as raised:
                AiokvTier(spec, view, "aiokv", disk_dir=str(tmp_path / "cache"), disk_bytes=64 * CHUNK_BYTES,
                          queue_depth=4, close_timeout=BOUND_S)
        finally:
            sys.settrace(tracing)
        helper.join(BOUND_S)
        view.release()  # vLLM's own view
        assert signals >= 2 and len(stores) == 1, "the second interrupt did not land in the cleanup's close"
        assert isinstance(raised.value.__context__, Interrupted)
        del raised
        store = stores[0]
        disk = store._disk
        assert disk is not None
        wait_for(lambda: tier_closed(disk), f"the disk tier closed (third signal at line {third[0]})", BOUND_S)
        wait_for(lambda: unmaps(region), "the region let go once the close ended", BOUND_S)
        store.thread._thread.join(BOUND_S)
        assert not store.thread._thread.is_alive(), "the store's loop thread was never stopped"
        for thread in threading.enumerate():
            if thread.name == "aiokv-vllm-cleanup":
                thread.join(BOUND_S)
                assert not thread.is_alive(), "the cleanup's thread was left running"
        assert unmaps(region), f"the region is still exported: {exporters(region)}"
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a signal still to come (a failure) is not raised here
        waiting.release(2)
        helper.join(BOUND_S)
        signal.signal(signal.SIGUSR1, previous)
        monkeypatch.undo()
        for store in stores:
            store.close()  # what the test left open (before the fix)
