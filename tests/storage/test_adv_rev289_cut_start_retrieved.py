"""Review 289 (the leftover of review 284's fix): ``memory.wait_uncancelled``, the wait of the
threads backend's start, of the uring backend's forced registration, of the joins at close, did
not retrieve the job's outcome (``jobs.wait_uncancelled`` did since review 284). A start that a
loop-wide cancel cut while its thread ran, and whose thread failed afterwards — no thread left for
a worker, a registration refused — left that failure unread: asyncio logged "Future exception was
never retrieved" in the engine's loop. One wait now serves every caller, and it retrieves it.

Real tiers, real threads; the failures are the ones the code meets: ``Thread.start`` raising as
it does when the process has no thread left, the registration's ``OSError``."""

from __future__ import annotations

import asyncio
import errno
import threading
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config
from loop_probes import cancel_every_task_but_nowait, no_loop_reports

import aiokv.storage.memory as memory_module
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

BOUND_S = 30.0


def _gate_thread_start(monkeypatch: pytest.MonkeyPatch, loop: asyncio.AbstractEventLoop, entered: asyncio.Event,
                       gate: threading.Event) -> None:
    """The first worker's start waits for ``gate``, then fails as with no thread left."""
    real = threading.Thread.start

    def refused(self: threading.Thread) -> None:
        if self.name == "aiokv-disk_0":
            loop.call_soon_threadsafe(entered.set)
            assert gate.wait(BOUND_S)
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", refused)


def _gate_registration(monkeypatch: pytest.MonkeyPatch, loop: asyncio.AbstractEventLoop, entered: asyncio.Event,
                       gate: threading.Event) -> None:
    """The pool's registration waits for ``gate`` (in its syscall), then the kernel refuses it."""

    def refused(engine: Any, spans: Any) -> Any:
        loop.call_soon_threadsafe(entered.set)
        assert gate.wait(BOUND_S)
        raise OSError(errno.ENOMEM, "registration refused after the cut (injected)")

    monkeypatch.setattr(memory_module, "populate_then_register", refused)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.THREADS, DiskBackend.URING_FIXED])
async def test_a_cut_starts_failure_is_never_left_unretrieved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              layout: KVLayout, pool: PagePool,
                                                              backend: DiskBackend) -> None:
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    gate = threading.Event()
    if backend is DiskBackend.THREADS:
        _gate_thread_start(monkeypatch, loop, entered, gate)
    else:
        _gate_registration(monkeypatch, loop, entered, gate)
    directory = tmp_path / "cache"
    try:
        async with no_loop_reports():
            start = asyncio.create_task(DiskTier(config(directory, backend), layout, pool).start())
            try:
                async with asyncio.timeout(BOUND_S):
                    await entered.wait()
                if backend is DiskBackend.URING_FIXED and start.done():
                    pytest.skip(f"io_uring refused here: {start.exception()!r}")
                cancel_every_task_but_nowait(asyncio.current_task())  # cut while the thread runs
                for _ in range(3):
                    await asyncio.sleep(0)
                assert not start.done()  # it waits for its thread
            finally:
                gate.set()  # the thread fails now, after the cut
            with pytest.raises(asyncio.CancelledError):
                async with asyncio.timeout(BOUND_S):
                    await start
    finally:
        monkeypatch.undo()
    async with DiskTier(config(directory, backend), layout, pool):  # nothing of the cut start is left
        pass
    assert_clean(pool)
