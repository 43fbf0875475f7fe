"""Review 212: a copy the bridge refuses leaked its count in flight, and the close waited for good.

``RankExecutor.execute`` counted the spec in flight, then handed the copy to the bridge's copy
thread. When the bridge refused it (closed; at interpreter shutdown the copy thread's executor
raises the same ``RuntimeError``: "cannot schedule new futures after interpreter shutdown"), the
error escaped ``execute`` (documented "never raises"), the spec's future never resolved, the count
stayed up, and ``drained()`` / ``aclose()`` never returned (the worker's teardown hung on it).

A real bridge, really closed, then a spec routed to its copy thread: the spec is reported failed,
nothing is left in flight, and the close returns within its bound.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from tp_helpers import full_kv, new_pool, rank_kv

from aiokv.cuda import CompletionBridge
from aiokv.layout import KVBuffer, KVLayout, TPSlice
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankExecutor, RankStatus, TPConfig, TransferSpec

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
BOUND_S = 10.0


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", [Direction.OFFLOAD, Direction.LOAD])
async def test_a_copy_the_closed_bridge_refuses_is_reported_and_not_left_in_flight(direction: Direction) -> None:
    pool = await new_pool(LAYOUT.for_tp(2), 8)
    bridge = CompletionBridge()
    kv = KVBuffer.wrap(LAYOUT, rank_kv(full_kv(LAYOUT, 5, slots=32), LAYOUT, 0, 2), TPSlice.of(LAYOUT, 0, 2))
    before = kv.k_layers[0].clone()
    pages_before = pool.pages.clone()
    # inline_copy_bytes=0: every CPU copy goes to the bridge's copy thread.
    executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 1, bridge, TPConfig(inline_copy_bytes=0))
    await asyncio.to_thread(bridge.close)  # the copy thread is gone (as at interpreter shutdown)
    try:
        report = executor.execute(TransferSpec.build(1, direction, 1, T, [2], range(T)))  # must not raise
        done, _ = await asyncio.wait({report}, timeout=BOUND_S)
        assert done, "the refused spec never reported"
        got = report.result()
        assert got.status is RankStatus.COPY_FAILED and "closed" in got.text, got
        assert executor.in_flight == 0, f"{executor.in_flight} spec(s) left counted in flight"
        assert torch.equal(kv.k_layers[0], before), "the refused load wrote the KV"
        assert torch.equal(pool.pages, pages_before), "the refused offload wrote the pool"
    finally:
        # Bounded by a wait, not a cancel: the close outlasts cancels (Cancels.outlast).
        closing = asyncio.ensure_future(executor.aclose())
        done, _ = await asyncio.wait({closing}, timeout=BOUND_S)
        if done:  # else the pool stays mapped in the executor, and its close would wait on it
            await pool.aclose()
    assert done, "the executor's close waited for a spec counted in flight that never reports"
