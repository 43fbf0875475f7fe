"""Review 254: the store's ``close()`` once the kernel refuses its loop thread a new thread (a pids
limit reached: ``RuntimeError: can't start new thread``; Python 3.12+ refuses it at interpreter
shutdown too, from an ``atexit`` hook).

Since review 251 (4f217ef) the stop of the store's own loop thread is a callback of the close's
future, run on the loop thread, that starts an ``aiokv-store-stop`` thread, and ``close()`` waited
for the loop thread's end without bound: the start refused, nothing ever stopped the loop and
``close()`` (vLLM's ``shutdown()``) hung for good. Since review 259 (c4eb30e) that callback, on the loop
thread, stops the loop there (``LoopThread.close()`` on its own thread acts as ``close_from_loop``): no
thread is started for the stop, none joined; ``close()`` only waits for the thread's end.

The fault is real: the test moves the loop thread into a pids cgroup (v1) whose limit it already
reaches, once the close's run on the loop ended (the disk tier closed), so the kernel refuses the
next ``clone`` of that thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_helpers import pids_limited, tier_closed

from aiokv.adapters.store import PageFileStore, StoreConfig

BOUND_S = 10.0
PAGE_BYTES = 8192


@pytest.fixture
def limited() -> Iterator[Path]:
    """A pids cgroup that admits no new task: a thread moved into it can start no thread."""
    with pids_limited("rev254", BOUND_S) as group:
        yield group


def test_close_stops_its_loop_thread_when_no_thread_can_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              limited: Path) -> None:
    config = StoreConfig.from_options({"disk_dir": str(tmp_path / "cache"), "disk_bytes": 64 * PAGE_BYTES,
                                       "close_timeout": BOUND_S})
    store = PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)
    disk = store._disk
    assert disk is not None
    real_close = store._close

    async def close() -> object:
        stuck = await real_close()
        # The disk tier closed; from here on the loop thread can start no thread.
        (limited / "tasks").write_text(str(threading.get_native_id()))
        return stuck

    monkeypatch.setattr(store, "_close", close)
    errors: list[BaseException] = []

    def closer() -> None:
        try:
            store.close()
        except BaseException as exc:
            errors.append(exc)

    caller = threading.Thread(target=closer, name="test-closer", daemon=True)
    caller.start()
    caller.join(BOUND_S)
    assert not caller.is_alive(), "close() hung: nothing stopped the store's loop thread"
    assert not errors, errors
    assert tier_closed(disk)
    assert not store.thread._thread.is_alive(), "the store's loop thread was never stopped"
