"""How much a GIL-holding engine thread slows aiokv's hits: the same loads beside an idle process
and beside a thread that runs Python all the time, alternated round by round, as ratios.

An engine's scheduler or model-runner thread that runs Python (scheduling, sampling, kernel
launches) holds the GIL between switch intervals (``sys.getswitchinterval()``, 5 ms by default).
Each time one of aiokv's threads (a read thread, the ring's completion side on the loop, the
checksum thread, the copy thread) must run Python, it may wait up to one interval for the GIL, so a
hit costs about one interval per hand-over on its path, not per byte. This measures that:
``--pages`` pages of the small test layout (or ``--page-kib``) are put on disk, then loaded
``--repeats`` times from the pool and from disk (the pool emptied before each disk load), once
with the process otherwise idle and once beside ``--spinners`` threads of pure Python, alternated
per round; it prints medians and contended ÷ idle ratios for each backend.

    python tools/bench_gil.py
    python tools/bench_gil.py --pages 64 --page-kib 1024 --repeats 8 --dir /var/tmp
    python tools/bench_gil.py --switch-ms 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from aiokv import CacheConfig, DiskBackend, KVCache, KVLayout
from aiokv.storage import DiskConfig


def _layout(page_kib: int) -> KVLayout:
    # 2 layers x K/V x 8 rows x 64 fp16 = 4 KiB per token; page_tokens sets the page size.
    tokens = max(1, page_kib // 4)
    return KVLayout.mha(2, 8, 64, torch.float16, page_tokens=tokens)


@contextmanager
def spinning(threads: int) -> Iterator[None]:
    """``threads`` threads running pure Python (they hold the GIL until the interpreter takes it)."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for _ in range(1000):
                x += 1

    started = [threading.Thread(target=spin, name=f"engine-spin-{i}", daemon=True) for i in range(threads)]
    for t in started:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in started:
            t.join()


async def _one(cache: KVCache, tokens: list[int], slots: torch.Tensor, from_disk: bool) -> float:
    if from_disk:
        for key in cache.keys(tokens):
            cache.pool.table.discard(key)
    match = await cache.match(tokens)
    want = match.disk_pages if from_disk else match.pool_pages
    if want * cache.layout.page_tokens != len(tokens):
        raise RuntimeError(f"expected a whole {'disk' if from_disk else 'pool'} hit, got {match}")
    start = time.perf_counter()
    result = await cache.load(match, slots)
    took = time.perf_counter() - start
    if result.tokens != len(tokens):
        raise RuntimeError(f"load shortened: {result}")
    return took


async def _bench(args: argparse.Namespace, backend: DiskBackend, root: Path) -> dict[str, list[float]]:
    layout = _layout(args.page_kib)
    n = args.pages * layout.page_tokens
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(layout.num_layers, 2 * n, layout.rows, layout.head_dim, generator=gen).to(layout.dtype)
    tokens = torch.randint(0, 50_000, (n,), generator=gen).tolist()
    disk = DiskConfig(directory=root, capacity_bytes=4 * args.pages * (layout.page_bytes + 4096), backend=backend)
    config = CacheConfig(cpu_bytes=(args.pages + 8) * layout.page_bytes, disk=disk, namespace="bench-gil",
                         pool_chunk_bytes=4 * layout.page_bytes)
    times: dict[str, list[float]] = {f"{tier} {mode}": [] for tier in ("pool", "disk") for mode in ("idle", "busy")}
    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        await cache.flush()
        slots = torch.arange(n, 2 * n)
        await _one(cache, tokens, slots, from_disk=True)  # warm: files opened once, pool pages back
        for _ in range(args.repeats):
            for mode in ("idle", "busy"):
                with spinning(args.spinners if mode == "busy" else 0):
                    times[f"disk {mode}"].append(await _one(cache, tokens, slots, from_disk=True))
                    times[f"pool {mode}"].append(await _one(cache, tokens, slots, from_disk=False))
        if not torch.equal(kv[:, n:], kv[:, :n]):
            raise RuntimeError("the loaded KV differs from what was offloaded")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=39)
    parser.add_argument("--page-kib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--spinners", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where the page files go (default: a temp dir)")
    parser.add_argument("--switch-ms", type=float, default=None,
                        help="sys.setswitchinterval for the run, in ms (default: the interpreter's)")
    args = parser.parse_args()
    if args.pages <= 0 or args.page_kib <= 0 or args.repeats <= 0 or args.spinners <= 0:
        parser.error("--pages, --page-kib, --repeats and --spinners must be positive")
    if args.switch_ms is not None:
        if not args.switch_ms > 0:
            parser.error("--switch-ms must be positive")
        sys.setswitchinterval(args.switch_ms / 1e3)
    print(f"python {sys.version.split()[0]}, switch interval {sys.getswitchinterval() * 1e3:.1f} ms, "
          f"{args.pages} pages of {_layout(args.page_kib).page_bytes // 1024} KiB, {args.spinners} spinning thread(s)")
    print(f"{'backend':12} {'tier':5} {'idle ms':>9} {'busy ms':>9} {'busy / idle':>12}")
    for backend in (DiskBackend.THREADS, DiskBackend.URING_FIXED):
        root = Path(tempfile.mkdtemp(prefix="aiokv-bench-gil-", dir=args.dir))
        try:
            times = asyncio.run(_bench(args, backend, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for tier in ("pool", "disk"):
            idle = statistics.median(times[f"{tier} idle"])
            busy = statistics.median(times[f"{tier} busy"])
            print(f"{backend.value:12} {tier:5} {idle * 1e3:9.2f} {busy * 1e3:9.2f} {busy / idle:12.2f}")


if __name__ == "__main__":
    main()
