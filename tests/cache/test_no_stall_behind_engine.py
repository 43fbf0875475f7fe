"""No public path stalls the loop behind the engine's queued GPU work.

Each path runs while ~0.5 s of the engine's work is queued on its stream; a 1 ms ticker measures
the loop's longest gap. A host call that waits for the device (a kernel's first launch under CUDA
lazy loading, a synchronizing copy, a pinned allocation's first size) shows as a gap as long as
the queued work. On the H200 every path stayed under 5 ms (11 ms for the first offload with int32
slots) except strided CUDA slots, which blocked ~0.5 s until the read-back gathered them first.
CUDA only; the paths run in order in one process, so most of them are their process's first use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, config, make_kv, prompt, record_loop_gaps

from aiokv import KVCache
from aiokv.kernels import TransferPath

T = LAYOUT.page_tokens
N = 4 * T
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of one GPU thread spinning on the H200
MOST_GAP_S = 0.1



async def _behind_engine(name: str, op: Callable[[], Awaitable[object]], stalls: dict[str, float]) -> None:
    torch.cuda.synchronize()
    gaps: list[float] = []
    ticker = asyncio.create_task(record_loop_gaps(gaps))
    await asyncio.sleep(0.01)
    gaps.clear()
    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
    try:
        await op()
    finally:
        await asyncio.sleep(0.003)
        ticker.cancel()
    stalls[name] = max(gaps)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the engine's queued GPU work")
@pytest.mark.slow(seconds=10)
@pytest.mark.timing
@pytest.mark.asyncio
async def test_no_public_path_stalls_the_loop_behind_the_engine(tmp_path: Path) -> None:
    kv = make_kv(111)
    prompts = [prompt(1100 + i, N) for i in range(8)]
    a = torch.arange(N)
    on_device = {  # made before any queued work: a pageable copy to the GPU waits for it
        "c64": a.to(DEVICE), "c64b": (a + 100).to(DEVICE), "c32": a.to(DEVICE, torch.int32),
        "c32b": (a + 100).to(DEVICE, torch.int32), "cstr": (torch.arange(2 * N) + 100).to(DEVICE)[::2],
        "cspl": (a + 120).to(DEVICE),
    }
    torch.cuda._sleep(1000)  # type: ignore[no-untyped-call]  # the sleep kernel's own module
    stalls: dict[str, float] = {}

    async def load(cache: KVCache, i: int, slots: torch.Tensor, from_token: int = 0) -> None:
        match = await cache.match(prompts[i])
        assert (await cache.load(match, slots, from_token=from_token)).tokens == N

    async def split(cache: KVCache, i: int, slots: torch.Tensor, layered: bool) -> None:
        stream = await cache.start_load(await cache.match(prompts[i]), slots, layered=layered)
        stream.claim(T if not layered else 0)
        if layered:
            await stream.launched()
            for layer in range(LAYOUT.num_layers):
                await stream.wait_layer(layer)
        await stream.finish()

    disk = tmp_path / "disk"
    async with KVCache(config(disk, pool_pages=64, launch_pages=2, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.wait_started()
        await _behind_engine("offload cpu int64", lambda: cache.offload(prompts[0], a), stalls)
        await _behind_engine("load cpu int64", lambda: load(cache, 0, a + 100), stalls)
        await _behind_engine("offload cuda int64", lambda: cache.offload(prompts[1], on_device["c64"]), stalls)
        await _behind_engine("load cuda int64", lambda: load(cache, 1, on_device["c64b"]), stalls)
        await _behind_engine("offload cuda int32", lambda: cache.offload(prompts[2], on_device["c32"]), stalls)
        await _behind_engine("load cuda int32", lambda: load(cache, 2, on_device["c32b"]), stalls)
        await _behind_engine("load cpu int32", lambda: load(cache, 0, (a + 100).to(torch.int32)), stalls)
        await _behind_engine("offload cpu strided", lambda: cache.offload(prompts[3], torch.arange(2 * N)[::2]), stalls)
        await _behind_engine("load cuda strided", lambda: load(cache, 3, on_device["cstr"]), stalls)
        await _behind_engine("split stream cpu", lambda: split(cache, 0, a + 120, False), stalls)
        await _behind_engine("split stream cuda", lambda: split(cache, 1, on_device["cspl"], False), stalls)
        await _behind_engine("layered stream cpu", lambda: split(cache, 2, a + 140, True), stalls)
        await _behind_engine("load from_token", lambda: load(cache, 3, torch.arange(N - T) + 160, T), stalls)
        await _behind_engine("flush", cache.flush, stalls)
    async with KVCache(config(disk, pool_pages=64, launch_pages=2, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.wait_started()  # restarted: an empty pool, the pages on disk
        await _behind_engine("load from disk", lambda: load(cache, 0, a + 180), stalls)
        await _behind_engine("split from disk", lambda: split(cache, 1, a + 200, False), stalls)
        await _behind_engine("layered from disk", lambda: split(cache, 2, a + 220, True), stalls)
    direct = config(disk, pool_pages=64, launch_pages=2, launch_turn_s=0, transfer_path=TransferPath.DIRECT)
    async with KVCache(direct, LAYOUT, kv) as cache:
        await cache.wait_started()
        await _behind_engine("direct: load from disk", lambda: load(cache, 0, a + 180), stalls)
        await _behind_engine("direct: layered from pool", lambda: split(cache, 0, a + 200, True), stalls)
        await _behind_engine("direct: offload cuda int32", lambda: cache.offload(prompts[4], on_device["c32"]), stalls)
    stalled = {name: f"{1e3 * gap:.0f} ms" for name, gap in stalls.items() if gap >= MOST_GAP_S}
    assert not stalled, f"the loop stalled behind the engine's queued work: {stalled}"
    assert len(stalls) == 20
