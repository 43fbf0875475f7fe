"""Review 216: a CUDA rank whose completion bridge was closed after it queued a copy reports only
once the copy is done.

0a7c120 made ``RankExecutor.execute`` report the bridge's ``RuntimeError`` (closed: a teardown, or
interpreter shutdown) as COPY_FAILED instead of letting it escape. On CUDA the copy is queued on the
GPU before the bridge is asked to wait for its event: reported at once, the manager handed the slots
(a load) or the pages (an offload) to other work while the GPU still wrote them. Behind 0.4 s of
the engine's queued work, the report must wait for the copy, and say what it did.
Skipped without CUDA.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from cuda_executor import CUDA_ONLY, LAYOUT, T
from tp_helpers import close_executor, full_kv, new_pool, rank_kv

from aiokv.cuda import CompletionBridge
from aiokv.kernels import TransferPath
from aiokv.layout import KVBuffer, TPSlice
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankExecutor, RankStatus, TPConfig, TransferSpec

pytestmark = CUDA_ONLY


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", [Direction.OFFLOAD, Direction.LOAD])
async def test_a_copy_queued_before_the_bridge_closed_reports_after_it_ran(direction: Direction) -> None:
    pool = await new_pool(LAYOUT.for_tp(2), 4)
    bridge = CompletionBridge()
    full = full_kv(LAYOUT, 7, slots=64)
    kv = KVBuffer.wrap(LAYOUT, rank_kv(full, LAYOUT, 0, 2).cuda(), TPSlice.of(LAYOUT, 0, 2))
    engine = torch.cuda.Stream()
    executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 1, bridge, TPConfig(), engine,
                            TransferPath.STAGING)
    try:
        warm = executor.execute(TransferSpec.build(1, Direction.OFFLOAD, 1, T, [0], range(T)))
        assert (await warm).status is RankStatus.OK  # registered: later copies launch at once
        await asyncio.to_thread(bridge.close)
        if direction is Direction.LOAD:
            spec = TransferSpec.build(2, Direction.LOAD, 1, T, [0], range(32, 32 + T))
        else:
            pool.pages[1].view(torch.uint8).fill_(0xA5)
            spec = TransferSpec.build(2, Direction.OFFLOAD, 1, T, [1], range(T))
        with torch.cuda.stream(engine):
            torch.cuda._sleep(400_000_000)  # type: ignore[no-untyped-call]  # the engine's queued work
        report = executor.execute(spec)
        done = await report
        # The copy runs after the engine's queued work: the report may not come before that ended.
        assert engine.query(), f"reported ({done}) while the engine's work, and the copy behind it, still ran"
        torch.cuda.synchronize()
        assert done.status is RankStatus.OK, done
        if direction is Direction.LOAD:
            assert torch.equal(kv.k_layers[0][32:32 + T].cpu(), kv.k_layers[0][0:T].cpu())
        else:
            assert torch.equal(pool.pages[1][0], pool.pages[0][0])  # rank 0's part (rank-major pages)
        assert executor.in_flight == 0
    finally:
        await close_executor(executor)
        await pool.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("path", [TransferPath.DIRECT, TransferPath.REFERENCE])
async def test_a_layered_load_queued_before_the_bridge_closed_reports_after_it_ran(path: TransferPath) -> None:
    """A layered load that is not paced (DIRECT, REFERENCE) queues every layer at once on side
    streams, and the engine's stream is not made to wait for them. Its per-layer watches (LAYERS
    frames) asked the closed bridge, which raised: the launch's fault path then reported COPY_FAILED
    behind an event on the engine's stream, which does not cover the side streams' copies, so the
    manager could free the slots while the layers still landed in them. The report must be OK, come
    after the copy, and the bytes must be there."""
    pool = await new_pool(LAYOUT.for_tp(2), 4)
    bridge = CompletionBridge()
    full = full_kv(LAYOUT, 11, slots=64)
    kv = KVBuffer.wrap(LAYOUT, rank_kv(full, LAYOUT, 0, 2).cuda(), TPSlice.of(LAYOUT, 0, 2))
    engine = torch.cuda.Stream()
    landed: list[tuple[int, int]] = []
    executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 1, bridge, TPConfig(), engine, path,
                            on_layers=lambda job, layers: landed.append((job, layers)))
    try:
        warm = executor.execute(TransferSpec.build(1, Direction.OFFLOAD, 1, T, [0], range(T)))
        assert (await warm).status is RankStatus.OK
        await asyncio.to_thread(bridge.close)
        with torch.cuda.stream(engine):
            torch.cuda._sleep(400_000_000)  # type: ignore[no-untyped-call]  # the engine's queued work
        spec = TransferSpec.build(2, Direction.LOAD, 1, T, [0], range(32, 32 + T), layered=True)
        done = await executor.execute(spec)
        assert executor.paced_loads == 0, "the load was paced: this test is about loads queued at once"
        assert executor.layered_loads == 1
        assert engine.query(), f"reported ({done}) while the engine's work, and the copy behind it, still ran"
        torch.cuda.synchronize()
        assert done.status is RankStatus.OK, done
        tensors = (*kv.k_layers, *kv.v_layers)  # v_layers is empty for the stacked form
        assert len(tensors) >= LAYOUT.num_layers
        for index, layer in enumerate(tensors):
            assert torch.equal(layer[32:32 + T].cpu(), layer[0:T].cpu()), index
        assert all(job == 2 for job, _ in landed)
        assert executor.in_flight == 0
    finally:
        await close_executor(executor)
        await pool.aclose()
