"""A loop-wide cancel (an application's SIGTERM handler, review 205) cutting the close while the
pool's background registration thread is in its syscall.

The backend's close cancels the registration, whose task then waits for that thread (the ring must
outlive the syscall). A second cancel cut that wait: the task ended, the next close unmapped the
ring under the thread, and the thread's error (seen as EINVAL from IORING_REGISTER_BUFFERS_UPDATE
once in a full run) was a future nobody retrieved.
"""

from __future__ import annotations

import asyncio
import errno
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config
from loop_probes import until, waiting_in

import aiokv.storage.backends as backends_module
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

GATE_S = 30.0


@pytest.mark.asyncio
async def test_a_cut_close_waits_for_the_registration_and_takes_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: KVLayout, pool: PagePool,
        caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    gate = threading.Event()

    def held(engine: Any, regions: Sequence[Any], stop: threading.Event, prepare: Any) -> Iterator[list[Any]]:
        loop.call_soon_threadsafe(entered.set)
        assert gate.wait(GATE_S)  # in the registration syscall until the test lets it end
        assert stop.is_set()
        raise OSError(errno.EINVAL, "registration refused as the close stopped it (injected)")
        yield []  # (a generator, as update_in_batches)

    monkeypatch.setattr(backends_module, "update_in_batches", held)
    tier = DiskTier(config(tmp_path / "cache", DiskBackend.AUTO), layout, pool)
    await tier.start()
    try:
        io = tier._io
        registering = getattr(io, "_registering", None)
        if registering is None:
            pytest.skip("no background registration (io_uring or a sparse buffer table refused here)")
        await entered.wait()
        closing = asyncio.ensure_future(tier.aclose())
        await until(lambda: waiting_in(registering, "wait_uncancelled") or waiting_in(registering, "wait"))
        assert not closing.done()
        registering.cancel()  # the loop-wide cancel: the close's tasks and the registration's
        closing.cancel()
        await asyncio.wait({closing})
        for _ in range(10):
            await asyncio.sleep(0)
        assert not registering.done(), "the registration's task ended while its thread was in the syscall"
        again = asyncio.ensure_future(tier.aclose())
        for _ in range(10):
            await asyncio.sleep(0)
        assert not again.done(), "the close went on (the ring unmapped) under the registration's syscall"
        gate.set()
        async with asyncio.timeout(GATE_S):
            await again
        assert "registering the pool as fixed buffers failed as the close stopped it" in caplog.text
    finally:
        gate.set()
        await tier.aclose()
    assert_clean(pool)
