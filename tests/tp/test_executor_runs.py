"""A rank's offload of pages whose slots are runs takes run copies (``TPConfig.offload_runs``):
bit-exact with a gather, counted in the worker's statistics, and ``offload_runs=False`` gathers.

The STAGING path runs here through Triton's interpreter and the run copies through memmove (the
same addresses and pitches the GPU's cudaMemcpy2DAsync gets: ``tests/kernels/test_mover_runs.py``).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from tp_helpers import expected_page, full_kv, new_pool, rank_kv

from aiokv.cuda import CompletionBridge
from aiokv.kernels import TransferPath
from aiokv.kernels.paths import interpreting
from aiokv.layout import KVBuffer, KVLayout, TPSlice
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankExecutor, RankStatus, TPConfig, TransferSpec

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not interpreting(), reason="CPU KV through Triton's interpreter (GPU: test_tp_gpu)"
)


@pytest.mark.asyncio
@pytest.mark.parametrize("runs", [True, False])
async def test_a_rank_offloads_run_pages_by_run_copies_unless_told_not_to(runs: bool) -> None:
    pool = await new_pool(LAYOUT.for_tp(2), 8)
    bridge = CompletionBridge()
    full = full_kv(LAYOUT, 4, slots=64)
    config = TPConfig(offload_runs=runs, inline_copy_bytes=0)
    kv = KVBuffer.wrap(LAYOUT, rank_kv(full, LAYOUT, 0, 2), TPSlice.of(LAYOUT, 0, 2))
    executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 1, bridge, config, path=TransferPath.STAGING)
    try:
        pool.pages.view(torch.uint8).fill_(0xA5)
        run_slots = [*range(20, 20 + T), *range(4, 4 + T)]
        scattered = [9, 3, 50, 41, 17, 60, 2, 33]
        run = executor.execute(TransferSpec.build(1, Direction.OFFLOAD, 1, T, [6, 1], run_slots))
        gathered = executor.execute(TransferSpec.build(2, Direction.OFFLOAD, 1, T, [3, 4], scattered))
        assert [(await run).status, (await gathered).status] == [RankStatus.OK, RankStatus.OK]
        for page, slots in ((6, run_slots[:T]), (1, run_slots[T:]), (3, scattered[:T]), (4, scattered[T:])):
            assert torch.equal(pool.pages[page][0], expected_page(full, slots, pool.layout)[0]), f"page {page}"
            assert pool.pages[page][1].view(torch.uint8).eq(0xA5).all(), "rank 1's part was written"
        assert executor.runs_offloaded == (2 if runs else 0)
    finally:
        await executor.aclose()
        await asyncio.to_thread(bridge.close)
        await pool.aclose()
    assert executor.runs_offloaded == (2 if runs else 0), "the count outlives the close"


def test_offload_runs_must_be_a_bool() -> None:
    assert TPConfig().offload_runs is True
    with pytest.raises(ValueError, match="offload_runs"):
        TPConfig(offload_runs=1)  # type: ignore[arg-type]
