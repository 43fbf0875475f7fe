"""Review 226 (GPU): a DIRECT load into a
SPLIT_KV rank buffer launches one scatter per segment (K, then V). When the V launch is refused,
the K scatter is already queued on the mover's load lane. ``PageMover.load``'s DIRECT path (also
REFERENCE, and the DIRECT detour a STAGING mover takes while a paced layer-wise load feeds) has no
``_ordered_on_failure``: the engine's stream is not made to wait for the lane. The executor's fault
path relies on that wait: it reports COPY_FAILED once an event on the engine's stream completed,
which then does not cover the lane, so the manager hands the slots back while K still lands in
them. The fault is a real CUDA error: the second scatter's grid is beyond the device's limit.
Expected before the mover fix: the report comes while the lane still sleeps (the last assert).
Skipped without CUDA.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from cuda_executor import CUDA_ONLY, LAYOUT, T
from tp_helpers import close_executor, full_kv, new_pool, rank_kv

from aiokv.cuda import CompletionBridge
from aiokv.kernels import TransferPath
from aiokv.kernels.launch import CopyPlan
from aiokv.layout import KVBuffer, TPSlice
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankExecutor, RankStatus, TPConfig, TransferSpec

pytestmark = CUDA_ONLY


@pytest.mark.asyncio
async def test_a_direct_load_refused_on_its_second_segment_reports_after_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = await new_pool(LAYOUT.for_tp(2), 4)
    bridge = CompletionBridge()
    part = rank_kv(full_kv(LAYOUT, 13, slots=64), LAYOUT, 0, 2).cuda()  # [L, S, K heads + V heads, D]
    local = LAYOUT.num_kv_heads // 2
    k = [part[layer, :, :local].contiguous() for layer in range(LAYOUT.num_layers)]
    v = [part[layer, :, local:].contiguous() for layer in range(LAYOUT.num_layers)]
    kv = KVBuffer.wrap(LAYOUT, (k, v), TPSlice.of(LAYOUT, 0, 2))  # SPLIT_KV: two segments, two launches
    engine = torch.cuda.Stream()
    executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 1, bridge, TPConfig(), engine,
                            TransferPath.DIRECT)
    try:
        warm = executor.execute(TransferSpec.build(1, Direction.OFFLOAD, 1, T, [0], range(T)))
        assert (await warm).status is RankStatus.OK  # registered: the load launches at once
        # Both scatter variants compiled now: the first load's JIT compile (seconds) outlasted the
        # busy lane below, so the report came after the K scatter ran even without the fix.
        first = executor.execute(TransferSpec.build(2, Direction.LOAD, 1, T, [0], range(48, 48 + T)))
        assert (await first).status is RankStatus.OK
        torch.cuda.synchronize()
        real = CopyPlan._run
        scatters: list[int] = []

        def second_refused(self: CopyPlan, kernel: Any, name: str, grid: tuple[int, int, int],
                           args: tuple[object, ...], constexprs: dict[str, object]) -> None:
            if name == "scatter":
                scatters.append(1)
                if len(scatters) == 2:
                    grid = (grid[0], 70_000, grid[2])  # gridDim.y above 65535: the driver refuses it
            real(self, kernel, name, grid, args, constexprs)

        monkeypatch.setattr(CopyPlan, "_run", second_refused)
        mover = executor._mover
        assert mover is not None
        lane = mover._load_lanes[0].stream
        assert lane is not None
        with torch.cuda.stream(lane):
            torch.cuda._sleep(400_000_000)  # type: ignore[no-untyped-call]  # the K scatter runs after this
        done = await executor.execute(TransferSpec.build(3, Direction.LOAD, 1, T, [0], range(32, 32 + T)))
        assert len(scatters) == 2, "both segments' scatters were tried"
        assert done.status is RankStatus.COPY_FAILED, done
        assert lane.query(), f"reported ({done}) while the K scatter it had queued was still to run"
    finally:
        await close_executor(executor)
        await asyncio.to_thread(bridge.close)
        await pool.aclose()
