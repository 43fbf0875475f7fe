"""Adversarial (review 204): the cache closes while an offload waits for pages another call is
writing (review 202's take-over, 31e7235).

The first offload's copy is held on the copy thread; the second, of the whole prompt, copied its
own pages and waits for the shared ones. The close begins; the first then ends (its copy runs, or
it is cancelled, or its copy fails). The second must return (no exception: the close is no fault
of the caller's), its result adding up to its pages, never launching a copy once the close began
(a page the first gave up is withdrawn: dropped, counted ``pages_withdrawn``), and the cache must
close within its bound.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, CopyThreadGate, config
from loop_probes import until
from test_adv_rev195_cancel_sweep import GARBAGE, POISON, oracle, prompt
from test_adv_rev202_shared_prefix_offload import _fail_copies_from

from aiokv import KVCache
from aiokv.kernels.hostcopy import HostGather

T = LAYOUT.page_tokens
PAGES = 6
SHARED = 3
N = PAGES * T + 2
BOUND_S = 10.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")


@pytest.mark.asyncio
@pytest.mark.parametrize("first_ends", ["delivers", "cancelled", "copy_failed"])
async def test_the_close_while_an_offload_waits_for_another_calls_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_ends: str
) -> None:
    kv = torch.full((LAYOUT.num_layers, 4 * N, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
    tokens = prompt(31)[:N]
    truth = oracle(tokens, None)
    first_slots, second_slots = torch.arange(0, SHARED * T), torch.arange(N, 2 * N)
    cache = KVCache(config(tmp_path / "disk", pool_pages=16, commit_wait=5.0, close_timeout=5.0), LAYOUT, kv)
    await cache.start()
    closing: asyncio.Future[None] | None = None
    try:
        await cache.pool.wait_ready()
        if first_ends == "copy_failed":
            _fail_copies_from(monkeypatch, first_slots)
        launched_after_close: list[int] = []
        real = HostGather.offload

        def offload(this: HostGather, slots: torch.Tensor, page_ids: list[int]) -> None:
            # The second's copy of the shared pages (its own were launched before the close).
            if cache._manager.closing and N <= int(slots.min()) < N + SHARED * T:
                launched_after_close.append(len(page_ids))
            real(this, slots, page_ids)

        if first_ends != "copy_failed":
            monkeypatch.setattr(HostGather, "offload", offload)
        kv[:, first_slots] = truth[:, : SHARED * T]
        kv[:, second_slots] = truth
        gate = CopyThreadGate(cache)
        try:
            first = asyncio.ensure_future(cache.offload(tokens[: SHARED * T], first_slots))
            await until(lambda: cache.stats().pool_reserved == SHARED)
            second = asyncio.ensure_future(cache.offload(tokens, second_slots))
            await until(lambda: cache.stats().pool_reserved == PAGES)
            closing = asyncio.ensure_future(cache.aclose())
            await until(lambda: cache._manager.closing)
            if first_ends == "cancelled":
                first.cancel()
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            outcomes = await asyncio.gather(first, second, return_exceptions=True)
            kv[:, first_slots] = GARBAGE
            kv[:, second_slots] = GARBAGE
            await closing
        result = outcomes[1]
        assert not isinstance(result, BaseException), outcomes
        assert result.stored + result.skipped + result.dropped == PAGES, result
        assert not launched_after_close, launched_after_close
        if first_ends != "delivers":
            # The shared pages were given up after the close began: withdrawn, not copied.
            assert result.dropped >= SHARED, result
            assert cache.stats().pages_withdrawn >= SHARED, cache.stats()
    finally:
        if closing is None:
            await cache.aclose()
