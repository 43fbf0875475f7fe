"""No thread the disk tier starts is started from the loop's thread (#11): ``Thread.start`` waits
there until the new thread runs (ms on a loaded machine). The threads backend's workers, the
registration of a caller's memory and the checksum threads' join at close each start their thread
without the loop waiting; a cancelled call still waits for what it started. Real tiers, real
files, real threads (a start that cannot happen is ``Thread.start`` raising, as it does when the
process has no thread left)."""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, payload, reserve, thread_starts_on_the_loop

import aiokv.storage.checksum as checksum_module
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import HeaderSlots, ThreadPageIO, UringPageIO
from aiokv.storage.checksum import Checksums
from aiokv.storage.layoutdir import LOCK_NAME
from aiokv.storage.pagefile import HEADER_BYTES, PageFiles

BOUND_S = 30.0
"""Longest any wait here may take (a gated thread, a start): they end within milliseconds."""


def _alive(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def _lock_is_free(directory: Path, layout: KVLayout) -> bool:
    fd = os.open(PageFiles(directory, layout).layout_dir / LOCK_NAME, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


async def _round_trip(tier: DiskTier, pool: PagePool, keys: range) -> None:
    """Write a page per key, read each back and compare bit for bit."""
    stored = {}
    for i in keys:
        handle = fill(pool, key_of(i), i)
        stored[i] = payload(pool, handle)
        assert await tier.write(key_of(i), handle)
        pool.table.release(handle)
    for i in keys:
        into = reserve(pool, key_of(1000 + i))
        try:
            if await tier.read(key_of(i), into):
                assert torch.equal(payload(pool, into), stored[i])
        finally:
            pool.table.abort(into)


# -- the whole life of a tier, every backend ---------------------------------------------------


@pytest.mark.asyncio
async def test_a_tier_starts_no_thread_on_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """Regression: the threads backend ran its jobs in a ``ThreadPoolExecutor``, which starts a
    worker (``aiokv-disk_<i>``) inside ``submit``, on the loop; the checksum threads were joined at
    close through ``asyncio.to_thread`` (the default executor's first use: its thread started on
    the loop). Start, writes that evict (unlinks), reads, large pages hashed in the checksum thread,
    close: not one ``Thread.start`` on the loop's thread."""
    monkeypatch.setattr(checksum_module, "INLINE_CHECKSUM_BYTES", 0)  # reads hashed in the thread
    file_bytes = HEADER_BYTES + layout.page_bytes
    started = thread_starts_on_the_loop(monkeypatch)
    tier = DiskTier(config(tmp_path / "cache", backend, capacity=4 * file_bytes), layout, pool)
    await tier.start()
    try:
        await _round_trip(tier, pool, range(8))
        stats = tier.statistics()
        assert stats.evictions > 0, stats  # unlinks ran
        assert stats.backend is backend
    finally:
        await tier.aclose()
    monkeypatch.undo()
    assert started == [], started
    assert _alive("aiokv-disk_") == [] and _alive("aiokv-checksum") == []
    assert_clean(pool)


# -- the threads backend's workers -------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_worker_that_cannot_start_fails_the_start_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: KVLayout, pool: PagePool) -> None:
    """The second worker cannot start (``RuntimeError``: no thread left): the start raises it, the
    first worker has ended, the directory's lock is released; the next start works."""
    real = threading.Thread.start

    def second_fails(self: threading.Thread) -> None:
        if self.name == "aiokv-disk_1":
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", second_fails)
    directory = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="can't start new thread"):
        async with asyncio.timeout(BOUND_S):
            await DiskTier(config(directory, DiskBackend.THREADS), layout, pool).start()
    monkeypatch.undo()
    assert _alive("aiokv-disk_") == []  # joined before the error came back
    assert _lock_is_free(directory, layout)
    async with DiskTier(config(directory, DiskBackend.THREADS), layout, pool) as again:
        await _round_trip(again, pool, range(2))
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_start_cancelled_while_its_workers_start_waits_for_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: KVLayout, pool: PagePool, cancels: int) -> None:
    """A start cancelled (``cancels`` times) while its first worker is being started: it waits for
    the starting thread, then until the workers have ended, releases the lock, then raises
    ``CancelledError``; the next start works."""
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    gate = threading.Event()
    real = threading.Thread.start

    def gated(self: threading.Thread) -> None:
        if self.name == "aiokv-disk_0":
            loop.call_soon_threadsafe(entered.set)
            assert gate.wait(BOUND_S)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", gated)
    directory = tmp_path / "cache"
    start = asyncio.create_task(DiskTier(config(directory, DiskBackend.THREADS), layout, pool).start())
    try:
        async with asyncio.timeout(BOUND_S):
            await entered.wait()  # never, where the workers started at the first job (old code)
        for _ in range(cancels):
            start.cancel()
            await asyncio.sleep(0)
        assert not start.done()  # it waits for the starting thread
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(BOUND_S):
                await asyncio.shield(start)
        assert start.cancelled()
    finally:
        gate.set()
        monkeypatch.undo()
    assert _alive("aiokv-disk_") == []  # both workers started, then stopped and joined
    assert _lock_is_free(directory, layout)
    async with DiskTier(config(directory, DiskBackend.THREADS), layout, pool) as again:
        await _round_trip(again, pool, range(2))
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_cancelled_close_of_the_threads_backend_waits_for_its_workers(
        pool: PagePool, cancels: int) -> None:
    """A close cancelled (``cancels`` times) while a worker still runs a job: it waits until the job
    is done and the workers have ended, then raises ``CancelledError``; the job's outcome arrives."""
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    gate = threading.Event()

    def held() -> int:
        loop.call_soon_threadsafe(entered.set)
        assert gate.wait(BOUND_S)
        return 5

    slots = HeaderSlots(2)
    io = await ThreadPageIO.open(pool, slots, False, 2)
    try:
        job = io._start(held)
        closing = asyncio.create_task(io.aclose())
        async with asyncio.timeout(BOUND_S):
            await entered.wait()
        for _ in range(cancels):
            closing.cancel()
            await asyncio.sleep(0)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not closing.done()  # the worker still runs the job
        assert _alive("aiokv-disk_")
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(BOUND_S):
                await asyncio.shield(closing)
        assert job.result() == 5
        assert _alive("aiokv-disk_") == []
        async with asyncio.timeout(BOUND_S):
            await io.aclose()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            io._start(held)
    finally:
        gate.set()
        slots.close()


# -- registering a caller's memory -------------------------------------------------------------


@pytest.mark.asyncio
async def test_registering_memory_starts_no_thread_on_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: KVLayout, pool: PagePool) -> None:
    """Regression: ``register_memory`` pinned the caller's region through ``asyncio.to_thread``,
    whose first call started the default executor's thread on the loop."""
    region = mmap.mmap(-1, 8 * layout.page_bytes)
    whole = memoryview(region)
    try:
        async with DiskTier(config(tmp_path / "cache", DiskBackend.AUTO), layout, pool) as tier:
            io = tier.backend
            if not isinstance(io, UringPageIO):
                pytest.skip("io_uring refused here: nothing to register")
            await io.wait_registered()
            started = thread_starts_on_the_loop(monkeypatch)
            await tier.register_memory(whole)
            monkeypatch.undo()
            assert tier.statistics().memory_unregistered == 0  # registered, by a thread of its own
            assert started == [], started
            assert io._ext_regions  # used by the tier
    finally:
        whole.release()
        region.close()
    assert_clean(pool)


# -- the checksum threads' join at close -------------------------------------------------------


@pytest.mark.asyncio
async def test_closing_the_checksums_starts_no_thread_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: ``Checksums.aclose`` joined its threads through ``asyncio.to_thread``."""
    sums = Checksums(inline_bytes=0, threads=2)
    data = bytearray(range(256)) * 64
    assert await sums.checksum(memoryview(data)) == checksum_module.payload_checksum(memoryview(data))
    started = thread_starts_on_the_loop(monkeypatch)
    async with asyncio.timeout(BOUND_S):
        await sums.aclose()
    monkeypatch.undo()
    assert started == [], started
    assert _alive("aiokv-checksum") == []  # joined
    await sums.aclose()  # idempotent


@pytest.mark.asyncio
@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_cancelled_checksum_close_waits_for_its_threads(monkeypatch: pytest.MonkeyPatch,
                                                                cancels: int) -> None:
    """A close cancelled (``cancels`` times) while a thread still hashes a queued page: it waits
    until the threads have ended (the page is hashed and delivered), then raises
    ``CancelledError``; a later close returns at once."""
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    gate = threading.Event()
    real = checksum_module.payload_checksum

    def slow(view: memoryview) -> int:
        loop.call_soon_threadsafe(entered.set)
        assert gate.wait(BOUND_S)
        return real(view)

    monkeypatch.setattr(checksum_module, "payload_checksum", slow)
    sums = Checksums(inline_bytes=0, threads=1)
    data = bytearray(8192)
    results: list[int | BaseException] = []
    sums.start(memoryview(data), results.append)
    closing = asyncio.create_task(sums.aclose())
    try:
        async with asyncio.timeout(BOUND_S):
            await entered.wait()
        for _ in range(cancels):
            closing.cancel()
            await asyncio.sleep(0)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not closing.done()  # the thread still hashes
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(BOUND_S):
                await asyncio.shield(closing)
    finally:
        gate.set()
    assert _alive("aiokv-checksum") == []
    for _ in range(5):  # the result's delivery, scheduled by the thread before it ended
        await asyncio.sleep(0)
    assert results == [real(memoryview(data))]
    async with asyncio.timeout(BOUND_S):
        await sums.aclose()

