"""Page-pool start-up: creation, first usable chunk, all chunks prepared (and CUDA-registered).

Baseline in the same run: ``torch.empty(..., pin_memory=True)`` of ``--baseline-gib`` GiB (what
engines usually do for a pinned CPU cache) when CUDA is present, else a first-touch memset of the same
size. Prints ms per GiB for each and the ratio.

    python tools/bench_pool.py --gib 8            # development machine
    python tools/bench_pool.py --gib 64           # H200 machine (registers with CUDA)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np
import torch

from aiokv.layout import KVLayout
from aiokv.pool import PagePool


def baseline_ms_per_gib(gib: float) -> tuple[str, float]:
    size = int(gib * (1 << 30))
    start = time.perf_counter()
    if torch.cuda.is_available():
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        name = "torch pin_memory alloc"
        elapsed = time.perf_counter() - start
        del pinned
    else:
        touched = np.empty(size, dtype=np.uint8)
        touched.fill(0)
        name = "numpy alloc + first touch"
        elapsed = time.perf_counter() - start
        del touched
    return name, elapsed * 1000 / gib


async def measure(gib: float, chunk_mib: int, workers: int) -> dict[str, float | int | str]:
    layout = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=256)
    budget = int(gib * (1 << 30))
    start = time.perf_counter()
    pool = PagePool.create(layout, budget, chunk_bytes=chunk_mib << 20, workers=workers)
    created = time.perf_counter()
    first_usable = None
    while first_usable is None:
        if pool.statistics().pages.usable:
            first_usable = time.perf_counter()
        else:
            await asyncio.sleep(0.001)
    await pool.wait_ready()
    ready = time.perf_counter()
    stats = pool.statistics()
    await pool.aclose()
    closed = time.perf_counter()
    real_gib = stats.pages.capacity * layout.page_bytes / (1 << 30)
    return {
        "gib": round(real_gib, 3),
        "pages": stats.pages.capacity,
        "chunk_mib": chunk_mib,
        "workers": workers,
        "cuda_registered": str(stats.cuda_registered),
        "chunks_failed": stats.chunks_failed,
        "create_ms": (created - start) * 1000,
        "first_usable_ms": (first_usable - start) * 1000,
        "all_ready_ms": (ready - start) * 1000,
        "ms_per_gib": (ready - start) * 1000 / real_gib,
        "close_ms": (closed - ready) * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8.0, help="pool budget in GiB")
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[256], help="chunk sizes to try")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8], help="worker counts to try")
    parser.add_argument("--baseline-gib", type=float, default=1.0, help="size of the baseline allocation")
    parser.add_argument("--json", metavar="FILE", help="write results as JSON")
    args = parser.parse_args()

    base_name, base = baseline_ms_per_gib(args.baseline_gib)
    rows = []
    for chunk in args.chunk_mib:
        for workers in args.workers:
            rows.append(asyncio.run(measure(args.gib, chunk, workers)))
    print(f"baseline: {base_name}: {base:.1f} ms/GiB")
    header = f"{'GiB':>6} {'chunk':>6} {'wrk':>4} {'cuda':>5} {'create ms':>10} {'1st usable ms':>14} "
    header += f"{'ready ms':>10} {'ms/GiB':>8} {'vs base':>8} {'close ms':>9}"
    print(header)
    for r in rows:
        print(
            f"{r['gib']:>6} {r['chunk_mib']:>6} {r['workers']:>4} {r['cuda_registered']:>5} "
            f"{r['create_ms']:>10.1f} {r['first_usable_ms']:>14.1f} {r['all_ready_ms']:>10.1f} "
            f"{r['ms_per_gib']:>8.1f} {float(r['ms_per_gib']) / base:>8.2f} {r['close_ms']:>9.1f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"baseline": {"name": base_name, "ms_per_gib": base}, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
