"""Hashes finished in the checksum thread reach the loop through the ring's eventfd (#14).

Before, each batch of results woke the loop through ``call_soon_threadsafe`` (a socket write in
the thread, a wake-up, two ``recv`` and a turn of the loop of their own), besides the eventfd
wake-ups of the page's completions. With io_uring the thread now writes the ring's eventfd: one
wake-up drains the completions and delivers the hashes. Without a ring (the threads backend), or
once it closes, the results go the old way; a wake-up that fails never kills the thread."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
from pathlib import Path

import pytest
from disk_helpers import BACKENDS, assert_clean, config, fill, key_of, payload, reserve

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage import checksum as checksum_module
from aiokv.storage.backends import UringPageIO
from aiokv.storage.checksum import Checksums
from aiokv.storage.pagefile import HEADER_BYTES, payload_checksum
from aiokv.storage.uring import UringEngine

URING = [b for b in BACKENDS if b is not DiskBackend.THREADS]


def _all_to_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum_module, "INLINE_CHECKSUM_BYTES", 0)
    monkeypatch.setattr(checksum_module, "INLINE_WRITE_CHECKSUM_BYTES", 0)


def _threadsafe_calls_from_checksum_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the checksum threads' ``call_soon_threadsafe`` calls on the running loop."""
    loop = asyncio.get_running_loop()
    real = loop.call_soon_threadsafe
    calls: list[str] = []

    def spy(*args: object, **kwargs: object) -> asyncio.Handle:
        name = threading.current_thread().name
        if name.startswith("aiokv-checksum"):
            calls.append(name)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "call_soon_threadsafe", spy)
    return calls


def _flip_payload_byte(path: Path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 1, HEADER_BYTES + 100)), HEADER_BYTES + 100)
    finally:
        os.close(fd)


async def _read_back(tier: DiskTier, pool: PagePool, count: int) -> list[bool]:
    handles = [reserve(pool, key_of(1000 + i)) for i in range(count)]
    try:
        async with asyncio.timeout(20):
            return list(await asyncio.gather(*(tier.read(key_of(i), h) for i, h in enumerate(handles))))
    finally:
        for h in handles:
            pool.table.abort(h)


@pytest.mark.asyncio
async def test_thread_hashes_wake_the_loop_through_the_ring(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                            pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    _all_to_the_thread(monkeypatch)
    calls = _threadsafe_calls_from_checksum_threads(monkeypatch)
    count = 8
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        io = tier.backend
        hooks = 0
        if isinstance(io, UringPageIO):
            real = io.engine.on_wake
            assert real is not None

            def counting(deadline: float) -> None:
                nonlocal hooks
                hooks += 1
                real(deadline)

            io.engine.on_wake = counting
        expect = []
        for i in range(count):
            h = fill(pool, key_of(i), i)
            expect.append(payload(pool, h).clone())
            assert await tier.write(key_of(i), h)
            pool.table.release(h)
        pool.table.evict(pool.num_pages)
        handles = [reserve(pool, key_of(1000 + i)) for i in range(count)]
        oks = await asyncio.gather(*(tier.read(key_of(i), h) for i, h in enumerate(handles)))
        assert all(oks)
        for h, want in zip(handles, expect, strict=True):
            assert payload(pool, h).equal(want)
            pool.table.abort(h)
        # A payload changed on disk is still refused: the hash that came back through the ring is checked.
        _flip_payload_byte(tier.files.path(key_of(3)))
        oks = await _read_back(tier, pool, 4)
        assert oks == [True, True, True, False]
        stats = tier.statistics()
        assert stats.corrupt == 1
        assert stats.hits == count + 3
    if backend is DiskBackend.THREADS:
        assert calls, "without a ring the results wake the loop through call_soon_threadsafe"
    else:
        # Before: one call_soon_threadsafe per batch of results (2 * count pages hashed here).
        assert calls == []
        assert hooks > 0
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
async def test_a_failing_ring_wake_up_falls_back_and_the_thread_lives_on(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    _all_to_the_thread(monkeypatch)
    tier = DiskTier(config(disk_dir, backend), layout, pool)
    await tier.start()
    sums = tier._checksums
    assert sums is not None
    failures = 0

    def refused() -> bool:  # the eventfd refusing the write (injected errno)
        nonlocal failures
        failures += 1
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    sums.wake_through(refused)
    try:
        with caplog.at_level(logging.ERROR, logger=checksum_module.__name__):
            for i in range(4):
                h = fill(pool, key_of(i), i)
                async with asyncio.timeout(20):
                    assert await tier.write(key_of(i), h)
                pool.table.release(h)
            pool.table.evict(pool.num_pages)
            assert await _read_back(tier, pool, 4) == [True] * 4
    except TimeoutError:
        # Before: the thread died at the first failure and the write's job never ended (a close
        # would wait for it for good: the tier is left as it is).
        pytest.fail(f"a page never came back from the checksum thread (alive: {[t.is_alive() for t in sums._threads]})")
    assert failures > 0
    assert all(t.is_alive() for t in sums._threads)
    assert "checksum wake-up failed" in caplog.text
    await tier.aclose()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_results_announced_through_the_eventfd_are_delivered_by_the_close() -> None:
    engine = UringEngine.open(8)
    sums = Checksums(inline_bytes=0, threads=1)
    announced = threading.Event()

    def wake() -> bool:
        woken = engine.wake_threadsafe()
        announced.set()
        return woken

    sums.wake_through(wake)
    engine.on_wake = sums.deliver
    data = bytes(range(256)) * 64
    got: list[int | BaseException] = []
    try:
        sums.start(memoryview(data), got.append)
        # Hold the loop (no await) until the thread wrote the eventfd: the reader never sees it.
        assert announced.wait(10)
        old = engine._efd
        await engine.aclose()  # nothing in flight: it does not yield to the loop
        assert got == [payload_checksum(memoryview(data))]
        # Closed: a wake-up never writes into whatever file took the eventfd's number since.
        reused = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            assert not engine.wake_threadsafe()
            if reused == old:
                with pytest.raises(BlockingIOError):
                    os.eventfd_read(reused)
        finally:
            os.close(reused)
        # Later results go the loop's own way (call_soon_threadsafe).
        future = asyncio.get_running_loop().create_future()
        sums.start(memoryview(data), future.set_result)
        async with asyncio.timeout(10):
            assert await future == got[0]
    finally:
        await engine.aclose()
        await sums.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
async def test_completions_alone_do_not_run_the_hook(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                     pool: PagePool) -> None:
    # Pages hashed on the loop (small here): no thread announces anything, so the completions'
    # wake-ups skip the checksums' hook (a flag, where it cost a Python call per wake-up).
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        io = tier.backend
        assert isinstance(io, UringPageIO)
        real = io.engine.on_wake
        assert real is not None
        hooks = 0

        def counting(deadline: float) -> None:
            nonlocal hooks
            hooks += 1
            real(deadline)

        io.engine.on_wake = counting
        wakeups = 0
        on_eventfd = io.engine._on_eventfd

        def counting_wakeups() -> None:
            nonlocal wakeups
            wakeups += 1
            on_eventfd()

        loop = asyncio.get_running_loop()
        loop.remove_reader(io.engine._efd)
        loop.add_reader(io.engine._efd, counting_wakeups)
        try:
            for i in range(4):
                h = fill(pool, key_of(i), i)
                assert await tier.write(key_of(i), h)
                pool.table.release(h)
            pool.table.evict(pool.num_pages)
            assert await _read_back(tier, pool, 4) == [True] * 4
        finally:
            loop.remove_reader(io.engine._efd)
            loop.add_reader(io.engine._efd, on_eventfd)
        assert wakeups >= 4
        assert hooks == 0
    assert_clean(pool)
