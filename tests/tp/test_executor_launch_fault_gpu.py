"""A CUDA rank whose copies fail to queue part-way reports only once what it did queue is done.

The manager aborts the pages of a failed offload (and a failed load's slots go back to the engine)
as soon as the report arrives: a copy still queued then could write an aborted page after it was
reserved again. The fault is a real CUDA error (an invalid pitch on the second run copy).
Skipped without CUDA.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from cuda_executor import CUDA_ONLY, LAYOUT, T
from tp_helpers import expected_page, full_kv, new_pool, rank_kv

import aiokv.cuda
from aiokv.cuda import CompletionBridge
from aiokv.kernels import TransferPath
from aiokv.layout import KVBuffer, TPSlice
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankExecutor, RankStatus, TPConfig, TransferSpec

pytestmark = CUDA_ONLY


@pytest.mark.asyncio
async def test_a_launch_failing_part_way_reports_after_the_queued_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    real = aiokv.cuda.memcpy2d_async
    calls = []

    def second_fails(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                     stream: torch.cuda.Stream) -> None:
        calls.append(dst)
        # The second copy gets a pitch below its width: the runtime refuses it (a real CUDA error).
        real(dst, 1 if len(calls) == 2 else dpitch, src, spitch, width, height, stream)

    monkeypatch.setattr(aiokv.cuda, "memcpy2d_async", second_fails)
    pool = await new_pool(LAYOUT.for_tp(2), 4)
    bridge = CompletionBridge()
    full = full_kv(LAYOUT, 5, slots=64)
    kv = KVBuffer.wrap(LAYOUT, rank_kv(full, LAYOUT, 0, 2).cuda(), TPSlice.of(LAYOUT, 0, 2))
    engine = torch.cuda.Stream()
    executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 1, bridge, TPConfig(), engine,
                            TransferPath.STAGING)
    try:
        warm = executor.execute(TransferSpec.build(1, Direction.OFFLOAD, 1, T, [3], range(T)))
        assert (await warm).status is RankStatus.OK  # registered, run copies work
        calls.clear()
        pool.pages.view(torch.uint8).fill_(0xA5)
        with torch.cuda.stream(engine):
            torch.cuda._sleep(400_000_000)  # the engine's stream is busy: the lanes' copies wait for it
        report = executor.execute(TransferSpec.build(2, Direction.OFFLOAD, 1, T, [0, 1], range(2 * T)))
        assert len(calls) == 2, "both run copies were tried"
        # aiokv.cuda's _check leaves the refused call's error as this thread's last CUDA error, which
        # torch's next kernel launch check would raise as its own: clear it (reported to the lead).
        runtime = aiokv.cuda._runtime_library()
        assert runtime is not None
        runtime.cudaGetLastError()
        assert not report.done(), "reported before the copy it had queued ran"
        done = await report
        assert done.status is RankStatus.COPY_FAILED and "cudaMemcpy2DAsync" in done.text, done
        # The first page's copy was queued before the fault: it has landed by the time of the report.
        assert torch.equal(pool.pages[0][0], expected_page(full, range(T), pool.layout)[0])
    finally:
        await executor.aclose()
        await asyncio.to_thread(bridge.close)
        await pool.aclose()


@pytest.mark.asyncio
async def test_a_launch_failing_with_a_sticky_error_still_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a sticky CUDA error every event record fails too: the failure path's own record must
    not escape ``execute()`` (the job was never reported, and the close waited for it for ever)."""
    pool = await new_pool(LAYOUT.for_tp(2), 4)
    bridge = CompletionBridge()
    full = full_kv(LAYOUT, 5, slots=64)
    kv = KVBuffer.wrap(LAYOUT, rank_kv(full, LAYOUT, 0, 2).cuda(), TPSlice.of(LAYOUT, 0, 2))
    engine = torch.cuda.Stream()
    executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 1, bridge, TPConfig(), engine,
                            TransferPath.STAGING)
    try:
        warm = executor.execute(TransferSpec.build(1, Direction.OFFLOAD, 1, T, [3], range(T)))
        assert (await warm).status is RankStatus.OK

        class StickyEvent(torch.cuda.Event):
            def record(self, stream: torch.cuda.Stream | None = None) -> None:
                raise RuntimeError("CUDA error: an illegal memory access was encountered (stand-in)")

        monkeypatch.setattr(torch.cuda, "Event", StickyEvent)
        report = executor.execute(TransferSpec.build(2, Direction.OFFLOAD, 1, T, [0, 1], range(2 * T)))
        done = await asyncio.wait_for(report, 10)
        assert done.status is RankStatus.COPY_FAILED, done
        monkeypatch.undo()
    finally:
        await asyncio.wait_for(executor.aclose(), 30)
        await asyncio.to_thread(bridge.close)
        await pool.aclose()
