"""Page pool: shared memory lifecycle, cross-process attach, page table protocol."""

from __future__ import annotations

import asyncio
import os
import stat
import threading

import pytest
import torch
from child_procs import fork_context

from aiokv.layout import KVLayout
from aiokv.pagetable import PageState, ReserveOutcome, StaleHandleError
from aiokv.pool import PagePool, PoolClosedError
from aiokv.shm import SegmentSpaceError, SharedSegment

LAYOUT = KVLayout.mha(2, 2, 16, torch.bfloat16, page_tokens=8)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _attach_and_write(name: str, page: int, value: float) -> None:
    memory = PagePool.attach(name, LAYOUT)
    try:
        memory.pages[page].fill_(value)
    finally:
        memory.close()


def test_budget_sets_page_count_and_small_budget_is_refused() -> None:
    with PagePool.create(LAYOUT, 5 * LAYOUT.page_bytes + 100) as pool:
        assert pool.num_pages == 5
        assert pool.pages.shape == (5, *LAYOUT.page_shape) and pool.pages.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="smaller than one page"):
        PagePool.create(LAYOUT, LAYOUT.page_bytes - 1)
    with pytest.raises(TypeError, match="byte_budget"):
        PagePool.create(LAYOUT, 1.5e9)  # type: ignore[arg-type]


def test_segment_mode_name_and_unlink() -> None:
    pool = PagePool.create(LAYOUT, 4 * LAYOUT.page_bytes)
    path = "/dev/shm" + pool.name
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    other = PagePool.create(LAYOUT, 4 * LAYOUT.page_bytes)
    assert other.name != pool.name
    pool.close()
    pool.close()  # idempotent
    assert not os.path.exists(path)
    other.close()


def test_another_process_attaches_and_writes_a_page() -> None:
    with PagePool.create(LAYOUT, 4 * LAYOUT.page_bytes) as pool:
        pool.wait_ready_blocking()
        pool.pages.zero_()
        proc = fork_context().Process(target=_attach_and_write, args=(pool.name, 2, 3.5))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
        assert torch.all(pool.pages[2] == 3.5)
        assert torch.all(pool.pages[1] == 0)
        # The attacher's exit must not have unlinked the segment.
        assert os.path.exists("/dev/shm" + pool.name)


def test_attach_only_never_unlinks() -> None:
    with PagePool.create(LAYOUT, 2 * LAYOUT.page_bytes) as pool:
        attached = PagePool.attach(pool.name, LAYOUT)
        attached.close()
        attached.close()
        assert os.path.exists("/dev/shm" + pool.name)
    with pytest.raises(ValueError, match="segment name"):
        SharedSegment.attach("no-slash")


def test_too_small_shared_memory_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiokv.shm

    monkeypatch.setattr(aiokv.shm, "shm_free_bytes", lambda: LAYOUT.page_bytes)
    with pytest.raises(SegmentSpaceError, match="shm-size"):
        PagePool.create(LAYOUT, 4 * LAYOUT.page_bytes)


def test_failed_chunk_is_counted_and_its_pages_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.posix_fallocate
    failing_offset = LAYOUT.page_bytes * 2

    def fallocate(fd: int, offset: int, length: int) -> None:
        if offset == failing_offset:
            raise OSError(28, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with PagePool.create(LAYOUT, 4 * LAYOUT.page_bytes, chunk_bytes=2 * LAYOUT.page_bytes) as pool:
        pool.wait_ready_blocking()
        stats = pool.statistics()
        assert (stats.chunks_total, stats.chunks_ready, stats.chunks_failed) == (2, 1, 1)
        results = pool.reserve([key(i) for i in range(4)])
        assert [r.outcome for r in results] == [ReserveOutcome.RESERVED] * 2 + [ReserveOutcome.EXHAUSTED] * 2
        assert {r.handle.page for r in results if r.handle} == {0, 1}
        for r in results:
            if r.handle:
                pool.table.abort(r.handle)


def test_reserve_commit_dedupe_and_handles() -> None:
    with PagePool.create(LAYOUT, 3 * LAYOUT.page_bytes) as pool:
        pool.wait_ready_blocking()
        (a,) = pool.reserve([key(1)])
        assert a.outcome is ReserveOutcome.RESERVED and a.handle is not None
        (again,) = pool.reserve([key(1)])
        assert again.outcome is ReserveOutcome.PENDING and again.handle is None
        pool.tensor(a.handle).fill_(7)
        pool.table.commit(a.handle)
        with pytest.raises(StaleHandleError):
            pool.tensor(a.handle)  # the reservation handle is used up
        (present,) = pool.reserve([key(1)])
        assert present.outcome is ReserveOutcome.PRESENT
        ref = pool.table.acquire(key(1))
        assert ref is not None and torch.all(pool.tensor(ref) == 7)
        pool.table.release(ref)
        with pytest.raises(StaleHandleError):
            pool.table.release(ref)
        pool.table.check_invariants()


def test_eviction_order_and_exhaustion() -> None:
    with PagePool.create(LAYOUT, 2 * LAYOUT.page_bytes) as pool:
        pool.wait_ready_blocking()
        for i in (1, 2):
            (r,) = pool.reserve([key(i)])
            assert r.handle is not None
            pool.table.commit(r.handle)
        held = pool.table.acquire(key(1))  # now key 2 is the least recently used
        assert held is not None
        (r3,) = pool.reserve([key(3)])
        assert r3.outcome is ReserveOutcome.RESERVED
        assert pool.table.state_of(key(2)) is PageState.FREE and pool.table.contains(key(1))
        # Everything is referenced or reserved: a typed outcome, not an exception.
        (r4,) = pool.reserve([key(4)])
        assert r4.outcome is ReserveOutcome.EXHAUSTED
        stale = held
        pool.table.release(held)
        assert r3.handle is not None
        pool.table.abort(r3.handle)
        assert pool.table.evict(10) == [key(1)]
        with pytest.raises(StaleHandleError):
            pool.table.check(stale)
        stats = pool.statistics().pages
        assert (stats.free, stats.ready, stats.exhausted, stats.evictions) == (2, 0, 1, 2)
        pool.table.check_invariants()


@pytest.mark.asyncio
async def test_waiters_wake_on_commit_and_abort() -> None:
    async with PagePool.create(LAYOUT, 2 * LAYOUT.page_bytes) as pool:
        await pool.wait_ready()
        (r,) = pool.reserve([key(1)])
        assert r.handle is not None
        waiters = [asyncio.ensure_future(pool.table.wait_committed(key(1))) for _ in range(3)]
        await asyncio.sleep(0)
        pool.table.commit(r.handle)
        assert await asyncio.gather(*waiters) == [True, True, True]
        (r2,) = pool.reserve([key(2)])
        assert r2.handle is not None
        waiter = asyncio.ensure_future(pool.table.wait_committed(key(2)))
        await asyncio.sleep(0)
        pool.table.abort(r2.handle)
        assert await waiter is False
        assert await pool.table.wait_committed(key(99)) is False


@pytest.mark.asyncio
async def test_cancelled_waiter_leaks_nothing_and_disturbs_no_one() -> None:
    async with PagePool.create(LAYOUT, 2 * LAYOUT.page_bytes) as pool:
        await pool.wait_ready()
        (r,) = pool.reserve([key(1)])
        assert r.handle is not None
        victim = asyncio.ensure_future(pool.table.wait_committed(key(1)))
        survivor = asyncio.ensure_future(pool.table.wait_committed(key(1)))
        await asyncio.sleep(0)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        pool.table.commit(r.handle)
        assert await survivor is True
        pool.table.check_invariants()
        stats = pool.statistics().pages
        assert stats.reserved == 0 and stats.referenced == 0


@pytest.mark.asyncio
async def test_aclose_is_idempotent() -> None:
    pool = PagePool.create(LAYOUT, 2 * LAYOUT.page_bytes)
    await pool.aclose()
    await pool.aclose()
    assert pool.memory.segment.closed


@pytest.mark.asyncio
async def test_a_closed_pool_hands_out_nothing_and_is_never_reopened() -> None:
    pool = await PagePool.open(LAYOUT, 2 * LAYOUT.page_bytes)
    (r,) = pool.reserve([key(1)])
    assert r.handle is not None
    await pool.aclose()
    assert pool.closed
    # Before the fix a closed pool still reserved pages of its unmapped segment.
    with pytest.raises(PoolClosedError):
        pool.reserve([key(2)])
    with pytest.raises(PoolClosedError):
        pool.tensor(r.handle)
    with pytest.raises(PoolClosedError):
        pool.page_view(r.handle)
    with pytest.raises(PoolClosedError):
        _ = pool.pages
    with pytest.raises(PoolClosedError):
        await pool.wait_usable()
    with pytest.raises(PoolClosedError):
        await pool.wait_ready()
    with pytest.raises(PoolClosedError):
        pool.wait_ready_blocking()
    assert pool.statistics().name == pool.name  # statistics stay readable


async def _pool_preparing_its_first_chunk(
        monkeypatch: pytest.MonkeyPatch) -> tuple[PagePool, threading.Event, threading.Event]:
    """A four-chunk pool with one preparation thread, held in chunk 0 until ``release`` is set
    (chunks 1-3 queued behind it); ``second`` is set if a later chunk starts."""
    loop = asyncio.get_running_loop()
    release, second = threading.Event(), threading.Event()
    entered = asyncio.Event()
    real = os.posix_fallocate
    calls = 0

    def slow_fallocate(fd: int, offset: int, length: int) -> None:
        nonlocal calls
        calls += 1
        if calls > 1:
            second.set()
        loop.call_soon_threadsafe(entered.set)
        release.wait(60)
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", slow_fallocate)
    pool = PagePool.create(LAYOUT, 4 * LAYOUT.page_bytes, chunk_bytes=LAYOUT.page_bytes, workers=1)
    await entered.wait()
    return pool, release, second


@pytest.mark.asyncio
async def test_closing_refuses_new_work_at_once_and_every_closer_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, release, second = await _pool_preparing_its_first_chunk(monkeypatch)
    closers = [asyncio.ensure_future(pool.aclose()) for _ in range(2)]
    await asyncio.sleep(0)  # one turn: both closers started and wait for the running chunk
    with pytest.raises(PoolClosedError):
        pool.reserve([key(1)])
    assert not any(c.done() for c in closers)
    release.set()
    # The loop stays blocked (on purpose) while the thread ends chunk 0 and looks for more: a
    # queued chunk still startable once aclose returned control would be started now (regression:
    # the queue was dropped only when the release task first ran, a loop turn later; CI lost the race).
    assert not second.wait(0.5), "a chunk queued at aclose() was started after it"
    await asyncio.gather(*closers)
    assert pool.memory.segment.closed
    stats = pool.statistics()
    assert (stats.chunks_ready, stats.chunks_failed) == (1, 3)  # chunks no thread had started are dropped
    await pool.aclose()


@pytest.mark.asyncio
async def test_close_after_drops_the_queued_chunks_at_once_and_frees_when_the_io_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool, release, second = await _pool_preparing_its_first_chunk(monkeypatch)
    loop = asyncio.get_running_loop()
    io_ended: asyncio.Future[None] = loop.create_future()
    pool.close_after(io_ended)
    release.set()
    assert not second.wait(0.5), "a chunk queued at close_after() was started after it"
    await asyncio.sleep(0.05)
    assert not pool.memory.segment.closed  # the stuck I/O has not ended: the memory stays mapped
    io_ended.set_result(None)
    await pool.wait_freed()
    assert pool.memory.segment.closed
    stats = pool.statistics()
    assert (stats.chunks_ready, stats.chunks_failed) == (1, 3)


def test_run_in_background_uses_the_pools_threads_and_a_closed_pool_refuses() -> None:
    pool = PagePool.create(LAYOUT, 8 * LAYOUT.page_bytes, chunk_bytes=2 * LAYOUT.page_bytes)
    try:
        pool.wait_ready_blocking()
        name = pool.run_in_background(lambda: threading.current_thread().name).result(timeout=10)
        assert name.startswith("aiokv-pool")
        assert pool.chunk_pages == 2
    finally:
        pool.close()
    with pytest.raises(PoolClosedError):
        pool.run_in_background(int)
