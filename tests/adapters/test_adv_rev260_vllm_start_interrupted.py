"""Review 260: vLLM's thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C at
start-up, pressed once or twice) in the tier's constructor where the store it made was left open.

- As the store's constructor returned, before the tier held the store (``self._store = PageFileStore(...)``:
  the interrupt lands at the end of that call, before the assignment): the constructor raised with the
  disk tier open for good (its loop thread, ring and directory lock) and nobody to close it. The store
  is now constructed into a list by C code (``list.extend`` over ``map``), inside the ``try`` whose
  cleanup closes it.
- A second interrupt in that cleanup's ``store.close()`` after the close was marked begun, before it
  was handed over to the loop: the store's close leaves it to a later ``close()``, and nobody made one:
  the disk tier open for good, vLLM's region exported (the region was to be let go once that close
  ended, which never ran). The cleanup now calls ``close()`` again, which hands it over. (Since helper
  273 the cleanup runs on a thread of its own: this interrupt lands in vLLM's wait for it.)

The interrupts are real (``SIGUSR1`` to the constructing thread, its handler raising); the test chooses
their moments with a trace function (``sys.settrace``, opcode events where needed) that sends the signal
at the exact point: the first opcode the caller runs once the store's constructor returned, and the
first line of ``PageFileStore.close`` after it marked the close begun.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from store_helpers import Interrupted, exporters, raise_interrupted, tier_closed, unmaps, wait_for

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, offloading_spec

import aiokv.adapters.vllm as vllm_module
from aiokv.adapters.store import PageFileStore
from aiokv.adapters.vllm import AiokvTier

BOUND_S = 10.0

Tracer = Callable[[types.FrameType, str, Any], Any]


@contextmanager
def _signals(count: list[int]) -> Iterator[None]:
    """``SIGUSR1`` raises :class:`Interrupted` in the main thread (counted in ``count[0]``)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")

    def handler(signum: int, frame: object) -> None:
        count[0] += 1
        raise_interrupted(signum, frame)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


@contextmanager
def _traced(tracer: Tracer) -> Iterator[None]:
    """``tracer`` on this thread and on the threads started meanwhile."""
    before = sys.gettrace()
    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(before)
        threading.settrace(None)


def _interrupt_once_constructed(stores: list[PageFileStore]) -> Tracer:
    """A trace function sending ``SIGUSR1`` to this thread at the first opcode its caller runs once
    ``PageFileStore``'s constructor returned (the store is appended to ``stores``). Its handler raises
    there, in the trace function: the exception is raised in the caller at that opcode."""
    main = threading.get_ident()
    armed: list[types.FrameType] = []

    def local(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        if event == "return" and frame.f_code is PageFileStore.__init__.__code__:
            stores.append(frame.f_locals["self"])
            caller = frame.f_back  # C calls (map) have no frame: the Python frame that called
            assert caller is not None
            caller.f_trace, caller.f_trace_opcodes = local, True
            armed.append(caller)
        elif event == "opcode" and armed and frame is armed[0]:
            armed.clear()
            signal.pthread_kill(main, signal.SIGUSR1)  # its handler raises here
        return local

    def calls(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        return local if frame.f_code is PageFileStore.__init__.__code__ else None

    return calls


def test_an_interrupt_as_the_stores_constructor_returned_still_closes_the_store(tmp_path: Path) -> None:
    spec = offloading_spec(tmp_path / "spec-source")
    count = [0]
    stores: list[PageFileStore] = []
    region = mmap.mmap(-1, 4 * CHUNK_BYTES)  # vLLM's region: a mapping it unmaps after shutdown
    view = memoryview(region).cast("B", (4, CHUNK_BYTES))
    try:
        with _signals(count), pytest.raises(Interrupted), _traced(_interrupt_once_constructed(stores)):
            AiokvTier(spec, view, "aiokv", disk_dir=str(tmp_path / "cache"), disk_bytes=64 * CHUNK_BYTES,
                      queue_depth=4, close_timeout=BOUND_S)
        view.release()  # vLLM's own view
        assert count[0] == 1 and len(stores) == 1
        store = stores[0]
        disk = store._disk
        assert disk is not None
        wait_for(lambda: tier_closed(disk), "the disk tier closed: left open by an interrupt as its store was made",
                 BOUND_S)
        store.thread._thread.join(BOUND_S)
        assert not store.thread._thread.is_alive(), "the store's loop thread was never stopped"
        assert unmaps(region), f"the region is still exported: {exporters(region)}"
    finally:
        for store in stores:
            store.close()  # what the test left open (before the fix)


def test_a_second_interrupt_before_the_cleanups_close_reached_the_loop_still_closes_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    spec = offloading_spec(tmp_path / "spec-source")
    count = [0]
    main = threading.get_ident()
    stores: list[PageFileStore] = []
    waiting = threading.Event()

    class Held(logging.LoggerAdapter):  # type: ignore[type-arg]
        def info(self, msg: object, *args: Any, **kwargs: Any) -> None:
            if isinstance(msg, str) and msg.startswith("aiokv tier: %s (") and not waiting.is_set():
                waiting.set()
                pause, deadline = threading.Event(), time.monotonic() + BOUND_S
                while not count[0] and time.monotonic() < deadline:
                    pause.wait(0.01)  # the first signal lands here (short waits: see review 247's hand-over test)
            super().info(msg, *args, **kwargs)

    monkeypatch.setattr(vllm_module, "log", Held(vllm_module.log, {}))
    # The line after ``self._closed = True`` in close(): the close marked begun, not handed over yet.
    lines, first = inspect.getsourcelines(PageFileStore.close)
    marked = first + next(i for i, line in enumerate(lines) if line.strip() == "self._closed = True")

    def local(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        if event == "line" and frame.f_lineno > marked and count[0] == 1 and not stores:
            stores.append(frame.f_locals["self"])
            signal.pthread_kill(main, signal.SIGUSR1)  # on vLLM's thread: its handler raises here
            # Since helper 273 the cleanup runs on a thread of its own (traced through threading.settrace):
            # the signal lands in vLLM's wait for it; the close goes on once it was handled.
            pause, deadline = threading.Event(), time.monotonic() + BOUND_S
            while count[0] == 1 and time.monotonic() < deadline:
                pause.wait(0.01)
        return local

    def calls(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        return local if frame.f_code is PageFileStore.close.__code__ and count[0] == 1 else None

    def interrupter() -> None:
        assert waiting.wait(BOUND_S)
        signal.pthread_kill(main, signal.SIGUSR1)

    helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
    region = mmap.mmap(-1, 4 * CHUNK_BYTES)
    view = memoryview(region).cast("B", (4, CHUNK_BYTES))
    try:
        helper.start()
        with _signals(count), pytest.raises(Interrupted) as raised, _traced(calls):
            AiokvTier(spec, view, "aiokv", disk_dir=str(tmp_path / "cache"), disk_bytes=64 * CHUNK_BYTES,
                      queue_depth=4, close_timeout=BOUND_S)
        helper.join(BOUND_S)
        view.release()
        assert count[0] == 2, "the second interrupt did not land in the cleanup's close"
        assert isinstance(raised.value.__context__, Interrupted)
        del raised
        store = stores[0]
        disk = store._disk
        assert disk is not None
        wait_for(lambda: tier_closed(disk), "the disk tier closed: its close was never handed over", BOUND_S)
        wait_for(lambda: unmaps(region), "the region let go once the close ended", BOUND_S)
        store.thread._thread.join(BOUND_S)
        assert not store.thread._thread.is_alive(), "the store's loop thread was never stopped"
    finally:
        helper.join(BOUND_S)
        for store in stores:
            store.close()
