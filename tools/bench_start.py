"""Pool start-up as the event loop sees it: time until the pool is usable, and the longest loop stall.

A 1 ms periodic callback runs on the loop for the whole measurement (its lateness is the stall).
Per pool size, in the same run:

- ``open``: ``await PagePool.open(...)`` (set-up in a thread, returns at the first prepared chunk);
- ``sync``: the baseline, ``PagePool.create(...)`` called on the loop, then ``await wait_usable()``
  (what ``KVCache.start`` did before ``open`` existed);
- ``idle``: the probe alone for as long as ``open`` took (the machine's own noise floor).

``gc ms`` is the time spent in cyclic garbage collection meanwhile: a collection holds the GIL, so
it stalls the loop whichever thread runs it (pools of very many pages create many objects).

Both then wait until every chunk is prepared ("fill", stall measured too) when the pool fits in
``--fill-fraction`` of free memory, else they close at once (chunks not started are dropped).
``--leftover-gib`` first leaves a segment of that size behind a SIGKILLed child process, so the next
``open`` also reclaims it (unlinking frees memory: off the loop).

    python tools/bench_start.py                                # 1, 4, 16 GiB; 8B-model pages
    python tools/bench_start.py --page-tokens 16 --leftover-gib 4 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import torch

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.shm import shm_free_bytes

GiB = 1 << 30


class LagProbe:
    """A callback due every ``period`` seconds; records how late each call ran."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.lags: list[float] = []
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + period
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        now = self._loop.time()
        self.lags.append(now - self._due)
        self._due = now + self.period
        self._handle = self._loop.call_at(self._due, self._tick)

    def take(self) -> list[float]:
        """Lags recorded since the last take (seconds)."""
        lags, self.lags = self.lags, []
        return lags

    def stop(self) -> None:
        self._handle.cancel()


@dataclass(frozen=True)
class Row:
    path: str
    gib: float
    pages: int
    page_mib: float
    usable_ms: float
    usable_stall_ms: float
    fill_ms: float | None
    fill_stall_ms: float | None
    close_stall_ms: float
    lag_p99_ms: float
    gc_ms: float


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def _p99(lags: list[float]) -> float:
    return statistics.quantiles(lags, n=100)[98] if len(lags) >= 2 else (lags[0] if lags else 0.0)


async def _sync_open(layout: KVLayout, budget: int, workers: int) -> PagePool:
    pool = PagePool.create(layout, budget, workers=workers)  # the baseline blocks the loop on purpose
    await pool.wait_usable()
    return pool


class GcClock:
    """Total time spent in cyclic garbage collection while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def stop(self) -> float:
        gc.callbacks.remove(self._callback)
        return self.seconds


async def idle(seconds: float) -> Row:
    gc.collect()
    probe = LagProbe()
    clock = GcClock()
    await asyncio.sleep(seconds)
    lags = probe.take()
    probe.stop()
    stall = _ms(max(lags, default=0.0))
    return Row("idle", 0.0, 0, 0.0, _ms(seconds), stall, None, None, 0.0, _ms(_p99(lags)), _ms(clock.stop()))


async def _open(layout: KVLayout, budget: int, workers: int) -> PagePool:
    return await PagePool.open(layout, budget, workers=workers)


async def measure(path: str, layout: KVLayout, budget: int, fill: bool, workers: int) -> Row:
    opener: Callable[[KVLayout, int, int], Awaitable[PagePool]] = _open if path == "open" else _sync_open
    gc.collect()  # start each row from a clean heap: no collection owed by earlier rows lands in this one
    clock = GcClock()
    probe = LagProbe()
    await asyncio.sleep(0.02)  # the probe's first ticks, so a stall at the very start is caught
    probe.take()
    start = time.perf_counter()
    pool = await opener(layout, budget, workers)
    usable = time.perf_counter()
    usable_lags = probe.take()
    usable_stall = _ms(max(usable_lags, default=0.0))
    fill_ms = fill_stall = None
    if fill:
        await pool.wait_ready()
        fill_ms = _ms(time.perf_counter() - start)
        fill_lags = probe.take()
        fill_stall = _ms(max(fill_lags, default=0.0))
        usable_lags += fill_lags
    await pool.aclose()
    close_lags = probe.take()
    probe.stop()
    return Row(
        path=path,
        gib=round(pool.num_pages * layout.page_bytes / GiB, 3),
        pages=pool.num_pages,
        page_mib=round(layout.page_bytes / (1 << 20), 3),
        usable_ms=_ms(usable - start),
        usable_stall_ms=usable_stall,
        fill_ms=fill_ms,
        fill_stall_ms=fill_stall,
        close_stall_ms=_ms(max(close_lags, default=0.0)),
        lag_p99_ms=_ms(_p99(usable_lags + close_lags)),
        gc_ms=_ms(clock.stop()),
    )


def _leave_segment(gib: float, ready: multiprocessing.synchronize.Event) -> None:
    layout = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=16)
    pool = PagePool.create(layout, int(gib * GiB), register_cuda=False)
    pool.wait_ready_blocking()
    ready.set()
    signal.pause()  # until SIGKILL: the segment is left behind


def leave_leftover(gib: float) -> None:
    """A spawned child creates a pool of ``gib`` GiB and is SIGKILLed, leaving its segment."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_leave_segment, args=(gib, ready))
    child.start()
    if not ready.wait(300):
        child.kill()
        raise RuntimeError("the child did not create its pool")
    os.kill(child.pid or 0, signal.SIGKILL)
    child.join()


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


async def run(args: argparse.Namespace) -> list[Row]:
    layout = KVLayout.mha(args.layers, 8, 128, torch.bfloat16, page_tokens=args.page_tokens)
    rows: list[Row] = []
    for gib in args.gib:
        budget = int(gib * GiB)
        room = min(_available_bytes(), shm_free_bytes() or 0)
        if budget > room * 0.9:
            print(f"{gib} GiB skipped: {room / GiB:.1f} GiB of memory / shared memory free", file=sys.stderr)
            continue
        fill = budget <= room * args.fill_fraction
        for rep in range(args.repeat):
            for path in ("sync", "open") if rep % 2 == 0 else ("open", "sync"):
                if args.leftover_gib:
                    leave_leftover(args.leftover_gib)
                row = await measure(path, layout, budget, fill, args.workers)
                rows.append(row)
                print(json.dumps(asdict(row)), file=sys.stderr)
                if path == "open":
                    rows.append(await idle(row.usable_ms / 1000))
    return rows


def report(rows: list[Row]) -> None:
    print(
        f"{'GiB':>6} {'pages':>7} {'path':>5} {'usable ms':>10} {'max stall ms':>13} {'fill ms':>9} "
        f"{'fill stall':>10} {'close stall':>11} {'lag p99':>8} {'gc ms':>6}"
    )
    for r in rows:
        fill = f"{r.fill_ms:9.0f}" if r.fill_ms is not None else f"{'-':>9}"
        fill_stall = f"{r.fill_stall_ms:10.2f}" if r.fill_stall_ms is not None else f"{'-':>10}"
        print(
            f"{r.gib:6.2f} {r.pages:7d} {r.path:>5} {r.usable_ms:10.1f} {r.usable_stall_ms:13.2f} {fill} "
            f"{fill_stall} {r.close_stall_ms:11.2f} {r.lag_p99_ms:8.2f} {r.gc_ms:6.1f}"
        )
    print("ratios open/sync (medians per size): time to usable, max loop stall before usable")
    idle_stalls = [r.usable_stall_ms for r in rows if r.path == "idle"]
    if idle_stalls:
        print(
            f"  idle loop, same run: max stall median {statistics.median(idle_stalls):.2f} ms, "
            f"max {max(idle_stalls):.2f} ms"
        )
    for gib in sorted({r.gib for r in rows if r.path != "idle"}):
        med = {
            path: (
                statistics.median(r.usable_ms for r in rows if r.gib == gib and r.path == path),
                statistics.median(r.usable_stall_ms for r in rows if r.gib == gib and r.path == path),
            )
            for path in ("open", "sync")
        }
        (ou, os_), (su, ss) = med["open"], med["sync"]
        print(f"  {gib:6.2f} GiB: usable {ou:.1f} / {su:.1f} ms = {ou / su:.2f}x; stall {os_:.2f} / {ss:.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0, 16.0], help="pool sizes (GiB)")
    parser.add_argument("--page-tokens", type=int, default=256, help="tokens per page (8B model shape)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per size and path (alternated)")
    parser.add_argument(
        "--fill-fraction",
        type=float,
        default=0.5,
        help="wait for all chunks only when the pool fits in this fraction of free memory",
    )
    parser.add_argument("--leftover-gib", type=float, default=0.0, help="reclaim a SIGKILLed child's segment first")
    parser.add_argument("--layers", type=int, default=32, help="layers of the (8B-shaped) layout")
    parser.add_argument("--workers", type=int, default=4, help="chunk-preparation threads (CacheConfig default 4)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = asyncio.run(run(args))
    report(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
