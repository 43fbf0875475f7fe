"""The event loop's longest stall while a disk tier starts over a directory it must trim (a budget
lowered since the files were written), against the same start with a budget that holds them all.

``--files`` pages are written once (small 8 KiB pages: the cost is per file), then the tier is
started ``--repeats`` times over a copy of that directory each way, alternated: ``keep`` (budget of
every file: nothing evicted) and ``trim`` (budget of ``--kept`` files: the rest evicted at start and
unlinked). A task turning the loop through ``sleep(0)`` records the gaps between its turns from the
start's call until every unlink is over; printed: the longest gap and the start's time, medians,
and trim ÷ keep.

    python tools/bench_start_trim.py
    python tools/bench_start_trim.py --files 50000 --kept 100 --dir /var/tmp
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskConfig, DiskTier
from aiokv.storage.pagefile import HEADER_BYTES

LAYOUT = KVLayout.mha(2, 2, 64, torch.float16, page_tokens=16)


def _key(i: int) -> bytes:
    return bytes([i % 256]) + i.to_bytes(15, "little")  # spread over the 256 fan-out directories


async def _write(root: Path, files: int, pool: PagePool, backend: DiskBackend) -> None:
    tier = DiskTier(DiskConfig(directory=root, capacity_bytes=2 * files * (LAYOUT.page_bytes + HEADER_BYTES),
                               backend=backend), LAYOUT, pool)
    await tier.start()
    try:
        (res,) = pool.reserve([b"\xff" * 16])
        assert res.handle is not None
        handle = pool.table.commit(res.handle, keep=True)
        assert handle is not None
        try:
            for i in range(files):
                if not await tier.write(_key(i), handle):
                    raise RuntimeError(f"page {i} was not stored: {tier.statistics()}")
        finally:
            pool.table.release(handle)
    finally:
        await tier.aclose()


async def _start(root: Path, kept: int, pool: PagePool, backend: DiskBackend) -> tuple[float, float, int]:
    """(longest loop gap, the start's time, pages indexed) of one start over ``root``."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def turns() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tier = DiskTier(DiskConfig(directory=root, capacity_bytes=kept * (LAYOUT.page_bytes + HEADER_BYTES),
                               backend=backend), LAYOUT, pool)
    turning = asyncio.create_task(turns())
    began = time.perf_counter()
    try:
        await tier.start()
        took = time.perf_counter() - began
        while tier._moving:  # the unlinks of the evicted files (benchmark: it reads the tier's state)
            await asyncio.wait(set(tier._moving.values()))
        pages = tier.statistics().pages
    finally:
        stop.set()
        await turning
        await tier.aclose()
    return max(gaps), took, pages


async def _bench(args: argparse.Namespace, work: Path) -> dict[str, list[tuple[float, float]]]:
    backend = DiskBackend(args.backend)
    pool = PagePool.create(LAYOUT, 16 * LAYOUT.page_bytes, register_cuda=False, workers=1)
    pool.wait_ready_blocking()
    try:
        master = work / "master"
        await _write(master, args.files, pool, backend)
        times: dict[str, list[tuple[float, float]]] = {"keep": [], "trim": []}
        for _ in range(args.repeats):
            for mode, kept in (("keep", args.files), ("trim", args.kept)):
                copy = work / mode
                await asyncio.to_thread(shutil.copytree, master, copy)
                try:
                    gap, took, pages = await _start(copy, kept, pool, backend)
                finally:
                    await asyncio.to_thread(shutil.rmtree, copy)
                if pages != kept:
                    raise RuntimeError(f"{mode}: {pages} pages indexed, expected {kept}")
                times[mode].append((gap, took))
        return times
    finally:
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--kept", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", choices=[b.value for b in DiskBackend], default=DiskBackend.AUTO.value)
    parser.add_argument("--dir", type=Path, default=None, help="where the page files go (default: a temp dir)")
    args = parser.parse_args()
    if args.files <= 0 or args.repeats <= 0 or not 0 < args.kept < args.files:
        parser.error("--files and --repeats must be positive, 0 < --kept < --files")
    work = Path(tempfile.mkdtemp(prefix="aiokv-bench-trim-", dir=args.dir))
    try:
        times = asyncio.run(_bench(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"python {sys.version.split()[0]}, {args.files} files, trimmed to {args.kept}, backend {args.backend}, "
          f"medians of {args.repeats}")
    print(f"{'start':6} {'longest loop gap ms':>20} {'start ms':>10}")
    medians = {}
    for mode in ("keep", "trim"):
        gap = statistics.median(g for g, _ in times[mode])
        took = statistics.median(t for _, t in times[mode])
        medians[mode] = (gap, took)
        print(f"{mode:6} {gap * 1e3:20.2f} {took * 1e3:10.1f}")
    print(f"trim / keep: longest gap {medians['trim'][0] / medians['keep'][0]:.2f}x, "
          f"start {medians['trim'][1] / medians['keep'][1]:.2f}x")


if __name__ == "__main__":
    main()
