"""A pool of very many chunks: chunk completions reach the loop in batches, not one wake-up per
chunk, and a pool is prepared in at most ``MAX_CHUNKS`` chunks (a tiny ``chunk_bytes`` was taken
as given: 16,384 chunks stalled the loop for 3 s at start)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

import aiokv.pool
from aiokv.layout import KVLayout
from aiokv.pool import MAX_CHUNKS, PagePool
from aiokv.shm import ChunkResult, SharedSegment

SMALL = KVLayout.mha(1, 1, 16, torch.bfloat16, page_tokens=8)  # 4 KiB pages


def _run_counted(coro_fn: Callable[[], Coroutine[Any, Any, None]], calls: list[int]) -> None:
    """Runs ``coro_fn()`` on a fresh asyncio loop counting ``call_soon_threadsafe`` (a thread waking it)."""
    class Loop(asyncio.SelectorEventLoop):
        def call_soon_threadsafe(self, *args: object, **kwargs: object) -> asyncio.Handle:  # type: ignore[override]
            calls[0] += 1
            return super().call_soon_threadsafe(*args, **kwargs)  # type: ignore[arg-type]

    loop = Loop()
    try:
        loop.run_until_complete(coro_fn())
    finally:
        loop.close()


def test_chunk_completions_wake_the_loop_a_few_times_not_once_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aiokv.pool, "MAX_CHUNKS", 1 << 20)  # 2,048 chunks of one page each, as asked
    calls = [0]
    stats: list[aiokv.pool.PoolStatistics] = []
    waits: list[int] = []

    async def main() -> None:
        pool = await PagePool.open(SMALL, 2048 * SMALL.page_bytes, register_cuda=False, chunk_bytes=SMALL.page_bytes)
        try:
            before = calls[0]
            await pool.wait_ready()
            waits.append(calls[0] - before)
            stats.append(pool.statistics())
            assert pool.ready
            # Every page is usable: the runs of neighbouring chunks were handed over whole.
            assert pool.table.statistics().free == 2048
        finally:
            await pool.aclose()

    _run_counted(main, calls)
    assert stats[0].chunks_total == stats[0].chunks_ready == 2048 and stats[0].chunks_failed == 0
    # One wake-up for the creation thread's result, one for wait_usable, one for wait_ready, a few for
    # the loop's own executor; it was one per chunk per waiter (4,096+).
    assert calls[0] < 20, calls[0]
    assert waits[0] <= 1


def test_a_tiny_chunk_size_is_raised_to_at_most_max_chunks() -> None:
    pages = 4 * MAX_CHUNKS + 3
    with PagePool.create(SMALL, pages * SMALL.page_bytes, register_cuda=False, chunk_bytes=SMALL.page_bytes) as pool:
        pool.wait_ready_blocking()
        stats = pool.statistics()
        assert stats.chunks_total <= MAX_CHUNKS
        assert pool.chunk_pages == 5  # ceil(pages / MAX_CHUNKS)
        assert stats.chunks_ready == stats.chunks_total and pool.table.statistics().free == pages


@pytest.mark.asyncio
async def test_a_cancelled_wait_is_not_woken_and_later_waits_still_end() -> None:
    pool = await PagePool.open(SMALL, 256 * SMALL.page_bytes, register_cuda=False, chunk_bytes=SMALL.page_bytes)
    try:
        waiting = asyncio.ensure_future(pool.wait_ready())
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await pool.wait_ready()
        assert pool.ready and pool._waiters == []
    finally:
        await pool.aclose()


@pytest.mark.asyncio
async def test_waits_cancelled_while_waiting_leave_no_waiter(monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression (review): asyncio cancels the awaited future first, so a wait cancelled mid-way
    # looked "done" and stayed registered, woken later (one wake-up per cancelled wait).
    gate = threading.Event()
    real = SharedSegment.prepare_chunk

    def held(self: SharedSegment, index: int, offset: int, length: int, register_cuda: bool) -> ChunkResult:
        if index > 0:
            assert gate.wait(30), "the test never released the chunks"
        return real(self, index, offset, length, register_cuda)

    monkeypatch.setattr(SharedSegment, "prepare_chunk", held)
    pool = await PagePool.open(SMALL, 4 * SMALL.page_bytes, register_cuda=False, chunk_bytes=SMALL.page_bytes)
    try:
        for _ in range(20):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.001):
                    await pool.wait_ready()
        assert pool._waiters == []
    finally:
        gate.set()
        await pool.wait_ready()
        await pool.aclose()


def test_wait_ready_blocking_counts_every_chunk_before_it_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression (review): a future is done before its done-callbacks run, so waiting on the futures
    # alone could return before the last chunk was queued for the page table (ready False, a page short).
    real = PagePool._chunk_done

    def late(self: PagePool, future: concurrent.futures.Future[ChunkResult]) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)  # the callback of a chunk finished on a preparation thread runs late
        real(self, future)

    monkeypatch.setattr(PagePool, "_chunk_done", late)
    with PagePool.create(SMALL, 8 * SMALL.page_bytes, register_cuda=False, chunk_bytes=SMALL.page_bytes) as pool:
        pool.wait_ready_blocking()
        assert pool.ready
        assert pool.statistics().chunks_ready == 8 and pool.table.statistics().free == 8


@pytest.mark.asyncio
async def test_background_work_submitted_from_the_loop_starts_no_thread_there(monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression (GPU host, 16 CPUs): a one-chunk pool's executor allowed 15 threads; a job handed
    # to it from the loop while the chunk's thread was busy started a second thread on the loop's
    # thread, which waits there until the new thread runs (ms under load).
    import aiokv.shm

    monkeypatch.setattr(aiokv.shm, "_cpus", lambda: 16)
    gate, entered = threading.Event(), threading.Event()
    real = SharedSegment.prepare_chunk

    def held(self: SharedSegment, index: int, offset: int, length: int, register_cuda: bool) -> ChunkResult:
        entered.set()
        assert gate.wait(30), "the test never released the chunk"
        return real(self, index, offset, length, register_cuda)

    monkeypatch.setattr(SharedSegment, "prepare_chunk", held)
    # create, not open: open returns only once the first (here the only) chunk is ready.
    pool = await asyncio.to_thread(PagePool.create, SMALL, 4 * SMALL.page_bytes, register_cuda=False)
    loop_thread = threading.get_ident()
    started: list[str] = []
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if threading.get_ident() == loop_thread:
            started.append(self.name)
        real_start(self)

    try:
        assert entered.wait(30)
        monkeypatch.setattr(threading.Thread, "start", start)
        job = pool.run_in_background(lambda: threading.current_thread().name)
        assert started == [], started
        gate.set()
        assert (await asyncio.wrap_future(job)).startswith("aiokv-pool")
    finally:
        gate.set()
        await pool.wait_ready()
        await pool.aclose()
    assert started == [], started
