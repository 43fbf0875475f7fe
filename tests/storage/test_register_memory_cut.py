"""A loop-wide cancel (an application's SIGTERM handler, review 205) cutting ``register_memory``
and the close while the caller's region is being pinned.

A cancelled ``UringPageIO.register_memory`` waits for its pinning thread (the ring must outlive the
syscall, the caller's view the pin) and re-raises the cancel; the thread's error was then never
retrieved (the normal path logs it), and "Future exception was never retrieved" came at a test's
teardown or the garbage collector's next pass.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config
from loop_probes import no_loop_reports, until, waiting_in

import aiokv.storage.backends as backends_module
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import UringPageIO

GATE_S = 30.0
REGION_BYTES = 1 << 20


@pytest.mark.asyncio
async def test_a_cut_register_memory_takes_its_threads_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: KVLayout, pool: PagePool,
        caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    gate = threading.Event()
    real = backends_module.update_in_batches

    def held(engine: Any, regions: Sequence[Any], stop: threading.Event, prepare: Any) -> Iterator[list[Any]]:
        if threading.current_thread().name != "aiokv-register-memory":
            yield from real(engine, regions, stop, prepare)  # the pool's own registration, as it is
            return
        loop.call_soon_threadsafe(entered.set)
        assert gate.wait(GATE_S)  # in the registration syscall until the test lets it end
        assert stop.is_set()
        raise OSError(errno.ENOMEM, "pinning refused as the cancel stopped it (injected)")

    monkeypatch.setattr(backends_module, "update_in_batches", held)
    region = mmap.mmap(-1, REGION_BYTES)
    tier = DiskTier(config(tmp_path / "cache", DiskBackend.AUTO), layout, pool)
    await tier.start()
    try:
        io = tier.backend
        if not isinstance(io, UringPageIO):
            pytest.skip("io_uring refused here: nothing is registered")
        await io.wait_registered()
        if not io._table.free:
            pytest.skip("no sparse buffer table here: callers' regions get no slot")
        registering = asyncio.ensure_future(tier.register_memory(memoryview(region)))
        await entered.wait()
        registering.cancel()  # the loop-wide cancel: the registration's caller and the close
        closing = asyncio.ensure_future(tier.aclose())
        await until(lambda: waiting_in(closing, "aclose") and bool(io._ext_jobs) and not closing.done())
        for _ in range(10):
            await asyncio.sleep(0)
        registering.cancel()  # again, as a second loop-wide cancel does
        closing.cancel()
        await asyncio.wait({closing})
        for _ in range(10):
            await asyncio.sleep(0)
        assert not registering.done(), "register_memory ended while its thread was pinning"
        again = asyncio.ensure_future(tier.aclose())
        for _ in range(10):
            await asyncio.sleep(0)
        assert not again.done(), "the close went on (the ring unmapped) under the pinning thread"
        # The thread's error is taken: the garbage collector finds no future holding it unretrieved.
        async with no_loop_reports("the pinning thread's error was never retrieved"):
            gate.set()
            async with asyncio.timeout(GATE_S):
                await again
                await asyncio.wait({registering})
            assert registering.cancelled()
            del registering
        assert f"cannot register {REGION_BYTES} bytes" in caplog.text, caplog.text
    finally:
        gate.set()
        await tier.aclose()
        region.close()
    assert_clean(pool)
