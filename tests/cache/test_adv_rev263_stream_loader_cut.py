"""Adversarial (helper-263): a stream's loader cut by a loop-wide cancel that the engine's own code
escaped (an application's SIGTERM handler cancels every task; the engine's shutdown then runs in a
task of its own, or its step was not a task at the time) and the engine then calls ``finish()``.

``launched()``, ``wait_front()`` and ``wait_layer()`` answer such a stream as they answer a stream
whose loader stopped (they wait with ``asyncio.wait``); ``finish()`` awaited the loader through
``shield()``, so the loader's own cancellation raised ``CancelledError`` into a caller nobody had
cancelled (``Task.cancelling()`` 0): the engine saw its shutdown task end "cancelled" and got no
result. It must settle what the loader launched as a shortened load: a ``StreamResult`` whose
loaded suffix holds exactly the prompt's KV, nothing written below it, quiescent after.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, prompt
from test_adv_rev263_loop_cancel import POISON

from aiokv import KVCache

T = LAYOUT.page_tokens
PAGES = 8
N = PAGES * T
BOUND_S = 20.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")


def _cut_all_but_mine() -> None:
    me = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is not me and not task.done():
            task.cancel()


@pytest.mark.asyncio
@pytest.mark.parametrize("turns", range(0, 6))
@pytest.mark.parametrize("layered", [False, True])
@pytest.mark.parametrize("disk", [False, True])
async def test_finish_after_a_loop_wide_cancel_cut_the_loader_settles_what_it_launched(
    tmp_path: Path, turns: int, layered: bool, disk: bool
) -> None:
    kv = torch.full((LAYOUT.num_layers, 3 * N, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
    cache = KVCache(config(tmp_path / "disk" if disk else None, pool_pages=2 * PAGES, launch_pages=1), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    try:
        tokens = prompt(265, N)
        source = torch.arange(0, N)
        truth = torch.randn(LAYOUT.num_layers, N, LAYOUT.rows, LAYOUT.head_dim).to(LAYOUT.dtype)
        kv[:, source] = truth
        assert (await cache.offload(tokens, source)).stored == PAGES
        if disk:
            await cache.flush()
            for key in cache.keys(tokens)[PAGES // 2 :]:
                assert cache.pool.table.discard(key)  # the back half on disk only: the loader reads it
        target = torch.arange(N, 2 * N)
        match = await cache.match(tokens)
        assert match.tokens == N, match
        stream = await cache.start_load(match, target, layered=layered)
        for _ in range(turns):
            await asyncio.sleep(0)
        _cut_all_but_mine()
        async with asyncio.timeout(BOUND_S):
            result = await stream.finish()  # not CancelledError: nobody cancelled this task
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        low = result.loaded_from
        assert torch.equal(kv[:, target[low:]], truth[:, low:]), result
        written = (kv[:, target[:low]] != POISON).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
        assert not written, f"tokens {written} written below loaded_from {low}"
        async with asyncio.timeout(BOUND_S):
            await assert_quiescent(cache)
    finally:
        async with asyncio.timeout(BOUND_S):
            await cache.aclose()
