"""Start-up of a whole `KVCache` with the disk tier on: time until usable and the loop's worst stall.

For each pool size: ``async with KVCache(...)`` with a disk tier (io_uring, AUTO backend) while a
1 ms periodic callback measures the event loop's lateness; then one page is offloaded and written
to disk to show the cache works at once. Baseline in the same run: the idle loop's own worst
lateness over the same wall time.

    python tools/bench_cache_start.py --gib 1 4 --dir /var/tmp/aiokv-start
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import torch

from aiokv import CacheConfig, KVCache, KVLayout


async def _lateness(stop: asyncio.Event, out: list[float]) -> None:
    loop = asyncio.get_running_loop()
    expected = loop.time() + 0.001
    while not stop.is_set():
        await asyncio.sleep(max(0.0, expected - loop.time()))
        now = loop.time()
        out.append(max(0.0, now - expected))
        expected = now + 0.001


async def one(gib: float, directory: Path) -> tuple[float, float, float, float]:
    layout = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=256)
    kv = torch.zeros(layout.num_layers, 256, layout.rows, layout.head_dim, dtype=layout.dtype)
    config = CacheConfig(cpu_bytes=int(gib * (1 << 30)), disk_dir=directory, disk_bytes=8 << 30, namespace="start")
    stop, lags = asyncio.Event(), []
    probe = asyncio.create_task(_lateness(stop, lags))
    start = time.perf_counter()
    async with KVCache(config, layout, kv) as cache:
        usable = time.perf_counter() - start
        await cache.offload(list(range(256)), torch.arange(256))
        await cache.flush()
        first_page = time.perf_counter() - start
        stop.set()
        await probe
        stall = max(lags)
    stop, idle = asyncio.Event(), []
    probe = asyncio.create_task(_lateness(stop, idle))
    await asyncio.sleep(first_page)
    stop.set()
    await probe
    return usable, first_page, stall, max(idle)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    p.add_argument("--dir", type=Path, help="disk tier directory (default: a temporary one)")
    args = p.parse_args()
    for gib in args.gib:
        base = args.dir or Path(tempfile.mkdtemp(prefix="aiokv-start-"))
        try:
            usable, first, stall, idle = await one(gib, base / f"run-{gib}")
        finally:
            shutil.rmtree(base / f"run-{gib}", ignore_errors=True)
        print(f"pool {gib:g} GiB, disk tier on: usable in {usable * 1e3:.0f} ms, first page on disk at "
              f"{first * 1e3:.0f} ms; worst loop stall {stall * 1e3:.1f} ms (idle loop, same run: {idle * 1e3:.1f} ms)")


if __name__ == "__main__":
    asyncio.run(main())
