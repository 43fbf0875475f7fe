"""A CPU rank's small copies run on its loop (no hop to the copy thread and back), in spec order."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tp_helpers import expected_page, full_kv, new_pool, rank_kv

from aiokv.cuda import CompletionBridge
from aiokv.layout import KVBuffer, KVLayout, TPSlice
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankExecutor, RankReport, RankStatus, TPConfig, TransferSpec

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
SLOT_BYTES = LAYOUT.num_layers * 4 * LAYOUT.head_dim * LAYOUT.itemsize
"""Bytes one token slot holds on rank 1 of 2 (2 heads: 4 rows)."""


@pytest.mark.asyncio
@pytest.mark.parametrize("inline_pages", [0, 2])
async def test_small_copies_run_inline_and_never_pass_a_queued_one(inline_pages: int) -> None:
    pool = await new_pool(LAYOUT.for_tp(2), 16)
    bridge = CompletionBridge()
    full = full_kv(LAYOUT, 3, slots=64)
    config = TPConfig(inline_copy_bytes=inline_pages * T * SLOT_BYTES)
    kv = KVBuffer.wrap(LAYOUT, rank_kv(full, LAYOUT, 1, 2), TPSlice.of(LAYOUT, 1, 2))
    executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 1, bridge, config)
    try:
        small = executor.execute(TransferSpec.build(1, Direction.OFFLOAD, 1, T, [0, 1], range(2 * T)))
        # Two pages fit the inline budget: done before execute returned, no loop turn, no thread.
        assert small.done() == bool(inline_pages)
        # A large copy goes to the copy thread; a small one after it waits its turn there (order kept).
        large = executor.execute(TransferSpec.build(2, Direction.OFFLOAD, 1, T, [2, 3, 4], range(2 * T, 5 * T)))
        after = executor.execute(TransferSpec.build(3, Direction.OFFLOAD, 1, T, [5], range(5 * T, 6 * T)))
        assert not large.done() and not after.done()
        reports: list[RankReport] = [await f for f in (small, large, after)]
        assert all(r.status is RankStatus.OK for r in reports), reports
        for page in range(6):
            want = expected_page(full, range(page * T, (page + 1) * T), pool.layout)[1]
            assert torch.equal(pool.pages[page][1], want), f"page {page}"
        # With nothing queued any more, a small copy runs inline again.
        again = executor.execute(TransferSpec.build(4, Direction.LOAD, 1, T, [5], range(40, 40 + T)))
        assert again.done() == bool(inline_pages)
        assert (await again).status is RankStatus.OK
        assert torch.equal(kv.k_layers[0][40 : 40 + T], kv.k_layers[0][5 * T : 6 * T])
    finally:
        await executor.aclose()
        await asyncio.to_thread(bridge.close)
        await pool.aclose()


def test_inline_copy_bytes_may_be_zero_but_not_negative() -> None:
    assert TPConfig(inline_copy_bytes=0).inline_copy_bytes == 0
    with pytest.raises(ValueError, match="inline_copy_bytes"):
        TPConfig(inline_copy_bytes=-1)


@pytest.mark.parametrize("field", ["handshake_timeout_s", "close_timeout_s", "reconnect_max_s", "max_jobs"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_tp_config_refuses_endless_or_undefined_values(field: str, value: float) -> None:
    # NaN slipped past "<= 0"; an infinite timeout or backoff hangs instead of failing.
    with pytest.raises(ValueError, match=field):
        TPConfig(**{field: value})  # type: ignore[arg-type]
