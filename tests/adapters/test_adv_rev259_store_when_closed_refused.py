"""Review 259: ``PageFileStore.when_closed`` after a death of the store's own loop thread, where the
kernel refuses a new thread (a pids limit reached: ``RuntimeError: can't start new thread``; Python
3.12+ at interpreter shutdown).

A callback waiting for a close that a death cut (its future failed before the dying thread's
finalizer closed the disk tier) was called once that thread ended, from an ``aiokv-store-closed``
thread started by the close future's callback on the dying loop thread. Refused, the start's error
was logged and the callback never ran: vLLM's tier (``shutdown`` interrupted) never let go of its
region. The dying thread now calls it itself at its very end (after its finalizers), no thread started.

The faults are real: the loop thread moved into a pids cgroup (v1) at its limit before its death, a
callback letting ``SystemExit`` out on the loop thread; the close waits for a registration of the
engine's region (its pinning thread held on an event, as its syscall would), so that the death cuts it.
"""

from __future__ import annotations

import asyncio
import mmap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from loop_probes import waiting_in
from store_helpers import PIDS, hold_region_pinning, pids_limited, tier_closed, wait_for

from aiokv.adapters.store import PageFileStore, StoreConfig, page_file_bytes

PAGE = 8192
BOUND_S = 10.0


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


@pytest.fixture
def limited() -> Iterator[Path]:
    """A pids cgroup that admits no new task: a thread moved into it can start no thread."""
    with pids_limited("rev259", BOUND_S) as group:
        yield group


@pytest.mark.root
def test_a_callback_after_a_death_runs_when_no_thread_can_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limited: Path) -> None:
    entered, gate = hold_region_pinning(monkeypatch, BOUND_S)
    config = StoreConfig(directory=tmp_path, capacity_bytes=8 * page_file_bytes(PAGE), queue_depth=2,
                         close_timeout=BOUND_S)
    store = PageFileStore(config, "test", {"model": "m"}, PAGE)
    thread = store.thread
    region = mmap.mmap(-1, 1 << 20)
    closing = threading.Thread(target=store.close, name="test-store-close", daemon=True)
    called: list[tuple[str, bool]] = []  # (thread, the disk tier closed then)
    done = threading.Event()
    try:
        thread.call(lambda: store.register_memory(memoryview(region))).result()
        if not entered.wait(BOUND_S):
            pytest.skip("the disk tier did not register the region (no io_uring here)")
        disk = store._disk
        assert disk is not None
        closing.start()

        def close_waits() -> bool:
            return bool(thread.call(lambda: any(waiting_in(t, "_stop_registering")
                                                for t in asyncio.all_tasks())).result())

        wait_for(close_waits, "the close waiting for the registration", BOUND_S)

        def let_go() -> None:
            called.append((threading.current_thread().name, tier_closed(disk)))
            done.set()

        store.when_closed(let_go)
        future = store._closing
        assert future is not None
        refused = threading.Event()
        future.add_done_callback(lambda _: refused.set())  # after when_closed's own
        (limited / "tasks").write_text(str(thread._thread.native_id))  # from here on it can start no thread
        thread.loop.call_soon_threadsafe(_die)
        assert refused.wait(BOUND_S), "the death did not cut the close"
        assert not called, "called under the open disk tier (its pin held)"
        (PIDS / "tasks").write_text(str(thread._thread.native_id))  # its finalizer may start threads again
        gate.set()
        assert thread.wait_ended(BOUND_S) and thread.dead
        assert tier_closed(disk), "the dying loop's finalizer did not close the disk tier"
        assert done.wait(BOUND_S), "the callback after the close never ran (its thread refused)"
        assert called == [(thread._thread.name, True)], called
        called.clear()
        store.when_closed(let_go)  # once the thread ended: at once, on the caller
        assert called == [(threading.current_thread().name, True)], called
    finally:
        gate.set()
        if thread._thread.is_alive():
            (PIDS / "tasks").write_text(str(thread._thread.native_id))
        closing.join(BOUND_S)
        thread.wait_ended(BOUND_S)
        store.close()
