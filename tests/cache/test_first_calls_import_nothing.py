"""The first calls of a started cache import no module: an import holds the GIL, a loop stall.

Regression (H100 host, warm-up test): the first load starting mid-page into slots spread wide
stalled the loop 85-104 ms with nothing compiled: the slot check's ``np.unique`` imports
``numpy.ma`` on its first call (``np.ma.is_masked``). numpy's lazy attributes did the same in the
page table and the TP specs before; this test catches the next one on every call path the engine
uses, in a fresh process (the test session has imported everything already).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cache_helpers import DEVICE

SCRIPT = r"""
import asyncio, json, sys, threading, traceback
import torch
from aiokv import CacheConfig, KVCache, KVLayout

disk_dir, device = sys.argv[1], sys.argv[2]
layout = KVLayout.mha(2, 2, 16, torch.bfloat16, page_tokens=4)
KVCache.preload(device)
watching = threading.Event()
imports = []  # (call, module, thread, innermost frames) of every import while a call runs
current = ["start"]


def hook(event, args):
    if event == "import" and watching.is_set():
        frames = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in traceback.extract_stack(limit=12)[:-1]]
        imports.append((current[0], args[0], threading.current_thread().name, frames))


sys.addaudithook(hook)


async def main():
    kv = torch.randn(layout.num_layers, 4096, layout.rows, layout.head_dim).to(layout.dtype).to(device)
    config = CacheConfig(cpu_bytes=64 * layout.page_bytes, disk_dir=disk_dir, disk_bytes=1 << 30, namespace="imports")
    tokens = list(range(8 * layout.page_tokens))
    n = len(tokens)
    # Slots spread wide, none next to another: the slot check sorts them (span > 32 x count).
    spread = torch.randperm(4096, generator=torch.Generator().manual_seed(7))

    async def call(name, coro):
        current[0] = name
        watching.set()
        try:
            return await coro
        finally:
            watching.clear()

    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        await cache.wait_warm()  # CUDA: the kernels' variants compiled or loaded (none on the CPU)
        await cache.offload(tokens[:4], torch.arange(4))  # the first call of each kind may warm up
        await cache.load(await cache.match(tokens[:4]), torch.arange(8, 12))
        await cache.flush()
        await call("offload", cache.offload(tokens, spread[:n]))
        await call("flush", cache.flush())
        match = await call("match", cache.match(tokens))
        assert match.tokens == n, match
        await call("load", cache.load(match, spread[n : 2 * n]))
        await call("load_mid_page", cache.load(await cache.match(tokens), spread[2 * n : 3 * n][5:], from_token=5))
        stream = await call("start_load", cache.start_load(await cache.match(tokens), spread[3 * n : 4 * n],
                                                         layered=True))
        await call("layered", stream.finish())
        stream = await call("start_load_mid", cache.start_load(await cache.match(tokens), spread[4 * n : 5 * n][7:],
                                                             from_token=7, layered=True))
        await call("layered_mid_page", stream.finish())
        await call("prefetch", cache.prefetch(list(range(1000, 1000 + n))))
        for bad in (spread[:3].clone().fill_(5), torch.tensor([4095, 9999, 1]), torch.tensor([-1, 2, 3])):
            try:
                await call("bad_slots", cache.load(await cache.match(tokens[:3]), bad))
            except ValueError:
                pass
            else:
                raise AssertionError(f"bad slots accepted: {bad}")
        await cache.flush()
    # A restart over the same directory: its pages come from disk (reads, checksums, promotion).
    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        await cache.load(await cache.match(tokens[:4]), torch.arange(8, 12))  # the first disk read may warm up
        match = await call("match_disk", cache.match(tokens))
        assert match.tokens == n, match
        await call("load_disk", cache.load(match, spread[5 * n : 6 * n]))
        await cache.offload(list(range(2000, 2000 + n)), spread[6 * n : 7 * n])
        await cache.flush()
    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        await cache.load(await cache.match(tokens[:4]), torch.arange(8, 12))
        stream = await call("start_load_disk", cache.start_load(await cache.match(list(range(2000, 2000 + n))),
                                                              spread[7 * n : 8 * n], layered=True))
        watching.set()
        current[0] = "claim"
        stream.claim(2 * layout.page_tokens)  # the engine computes the first two pages itself
        watching.clear()
        result = await call("stream_disk", stream.finish())
        assert result.tokens == n, result
    return imports


print(json.dumps(asyncio.run(main())))
"""


@pytest.mark.slow(seconds=15)
def test_no_call_of_a_started_cache_imports_a_module(tmp_path: Path) -> None:
    # The engine's device (AIOKV_TEST_DEVICE=cuda on a GPU machine: the copies' CUDA paths).
    env = {**os.environ}
    if DEVICE.type == "cuda":
        env.pop("TRITON_INTERPRET", None)  # real kernels, as an engine runs them
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "disk"), str(DEVICE)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    imports = json.loads(run.stdout.splitlines()[-1])
    assert imports == [], "\n".join(f"{call}: {module} on {thread} at {' < '.join(reversed(frames))}"
                                    for call, module, thread, frames in imports)
