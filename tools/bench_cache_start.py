"""Start-up of a whole `KVCache` with the disk tier on: time until usable and the loop's worst stall.

For each pool size: ``async with KVCache(...)`` with a disk tier (io_uring, AUTO backend) while a
1 ms periodic callback measures the event loop's lateness; then one page is offloaded and written
to disk to show the cache works at once. Baseline in the same run: the idle loop's own worst
lateness over the same wall time. Cyclic GC stays enabled, as in an engine: its passes are part of
what the loop sees (``gc ms`` and ``full gc`` say how much of the window they took). The page
geometry is a flag: small pages make a pool of very many pages, which is where per-page bookkeeping
shows (262,144 pages of 4 KiB in 1 GiB).

The first start of a process pays one-time costs the later ones do not (imports, first calls);
``--fresh N`` starts each pool size in N fresh processes, one start each, and reports every one's
worst stall and the modules imported while it started (an import holds the GIL for its whole module
body, and the loop waits for the GIL).

    python tools/bench_cache_start.py --gib 1 4 --dir /var/tmp/aiokv-start
    python tools/bench_cache_start.py --gib 1 --layers 1 --kv-heads 1 --head-dim 16 --page-tokens 8
    python tools/bench_cache_start.py --gib 1 --fresh 6
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import statistics
import subprocess
import sys
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


class GcClock:
    """Time in cyclic garbage collection, and full (generation 2) passes, while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            self.full += info["generation"] == 2
        else:
            self.seconds += time.perf_counter() - self._start

    def stop(self) -> tuple[float, int]:
        gc.callbacks.remove(self._callback)
        return self.seconds, self.full


async def one(
    gib: float, directory: Path, layout: KVLayout, imported: list[str] | None = None
) -> tuple[int, float, float, float, float, float, int]:
    """One start: (pages, usable s, first page on disk s, worst stall s, idle stall s, GC s, full GC
    passes); ``imported`` receives the modules imported while the cache started."""
    tokens = max(256, layout.page_tokens)
    kv = torch.zeros(layout.num_layers, tokens, layout.rows, layout.head_dim, dtype=layout.dtype)
    config = CacheConfig(cpu_bytes=int(gib * (1 << 30)), disk_dir=directory, disk_bytes=8 << 30, namespace="start")
    gc.collect()  # nothing owed by earlier runs lands in this one
    clock = GcClock()
    stop, lags = asyncio.Event(), list[float]()
    probe = asyncio.create_task(_lateness(stop, lags))
    start = time.perf_counter()
    modules = set(sys.modules)
    async with KVCache(config, layout, kv) as cache:
        usable = time.perf_counter() - start
        if imported is not None:
            imported.extend(sorted(set(sys.modules) - modules))
        pages = cache.pool.num_pages
        await cache.offload(list(range(tokens)), torch.arange(tokens))
        await cache.flush()
        first_page = time.perf_counter() - start
        stop.set()
        await probe
        stall = max(lags)
    gc_seconds, full = clock.stop()
    stop, idle = asyncio.Event(), list[float]()
    probe = asyncio.create_task(_lateness(stop, idle))
    await asyncio.sleep(first_page)
    stop.set()
    await probe
    return pages, usable, first_page, stall, max(idle), gc_seconds, full


def fresh(args: argparse.Namespace, gib: float) -> None:
    """``args.fresh`` processes, each starting one cache of ``gib`` GiB (its process's first start)."""
    stalls: list[float] = []
    for _ in range(args.fresh):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--gib", str(gib), "--child",
               "--layers", str(args.layers), "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim),
               "--page-tokens", str(args.page_tokens)]
        if args.dir:
            cmd += ["--dir", str(args.dir)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        row = json.loads(out.splitlines()[-1])
        stalls.append(row["stall_ms"])
        print(f"pool {gib:g} GiB, fresh process: usable in {row['usable_ms']:.0f} ms, worst loop stall "
              f"{row['stall_ms']:.1f} ms (idle loop {row['idle_ms']:.1f} ms); imported while starting: "
              f"{', '.join(row['imported']) or 'nothing'}")
    print(f"pool {gib:g} GiB, first start of {len(stalls)} processes: worst stall min {min(stalls):.1f} / median "
          f"{statistics.median(stalls):.1f} / max {max(stalls):.1f} ms")


async def child(args: argparse.Namespace, layout: KVLayout) -> None:
    """One start in this (fresh) process; one JSON line on stdout."""
    base = args.dir or Path(tempfile.mkdtemp(prefix="aiokv-start-"))
    imported: list[str] = []
    try:
        _, usable, _, stall, idle, _, _ = await one(args.gib[0], base / f"fresh-{args.gib[0]}", layout, imported)
    finally:
        shutil.rmtree(base / f"fresh-{args.gib[0]}", ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"usable_ms": usable * 1e3, "stall_ms": stall * 1e3, "idle_ms": idle * 1e3,
                      "imported": imported}))


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    p.add_argument("--dir", type=Path, help="disk tier directory (default: a temporary one)")
    p.add_argument("--layers", type=int, default=32, help="layers of the layout (8B model shape by default)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of the layout")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension of the layout")
    p.add_argument("--page-tokens", type=int, default=256, help="tokens per page")
    p.add_argument("--fresh", type=int, default=0, help="start each size in this many fresh processes")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    layout = KVLayout.mha(args.layers, args.kv_heads, args.head_dim, torch.bfloat16, page_tokens=args.page_tokens)
    if args.child:
        await child(args, layout)
        return
    for gib in args.gib:
        if args.fresh:
            fresh(args, gib)
            continue
        base = args.dir or Path(tempfile.mkdtemp(prefix="aiokv-start-"))
        try:
            pages, usable, first, stall, idle, gc_s, full = await one(gib, base / f"run-{gib}", layout)
        finally:
            shutil.rmtree(base / f"run-{gib}", ignore_errors=True)
        print(
            f"pool {gib:g} GiB ({pages} pages of {layout.page_bytes >> 10} KiB), disk tier on: usable in "
            f"{usable * 1e3:.0f} ms, first page on disk at {first * 1e3:.0f} ms; worst loop stall "
            f"{stall * 1e3:.1f} ms (idle loop, same run: {idle * 1e3:.1f} ms); GC {gc_s * 1e3:.0f} ms, "
            f"{full} full passes"
        )


if __name__ == "__main__":
    asyncio.run(main())
