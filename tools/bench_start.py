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

``--table PAGES...`` measures the page table alone instead, GC enabled, at each page count: built in
a thread (as ``PagePool.open`` does) then handed its pages chunk by chunk on the loop (max loop
stall, GC time and full passes, GC-tracked objects it added), then, full of READY pages, the loop
time of one 256-page batch of each hot-path operation (``offload``: reserve with evictions and
commit; ``match+load``: acquire the prefix, check and release each handle; ``statistics``).
``--against REV`` measures the page table of that git revision too, alternated in the same run, and
prints ratios against it.

``--token-array COUNTS...`` times ``keys.token_array`` (the validation and conversion every ``match``,
``offload`` and ``prefetch`` starts with) for a list, a tuple, a numpy array and a CPU tensor of that
many ids; with ``--against REV``, that revision's ``aiokv/keys.py`` alternates call by call.

``--churn PAGES...`` times single insert, lookup and evict calls on a full table for twice as many
rounds as it has pages (``--churn-ops``): p50, p99, p99.9 and max per operation, with ``--against REV``
alternated table by table (a dict rebuilding its hash table shows as a rare multi-ms max).

``--first-start N`` runs N fresh processes per mode, a CUDA KV buffer (``--device``), with and without
``KVCache.preload`` before the loop, alternated: the loop's worst stall during the first ``start()``
and the first two offloads (1 GiB pool, no disk tier).

    python tools/bench_start.py                                # 1, 4, 16 GiB; 8B-model pages
    python tools/bench_start.py --page-tokens 16 --leftover-gib 4 --json out.json
    python tools/bench_start.py --table 65536 262144 1048576 --against b6a79ae
    python tools/bench_start.py --token-array 4096 131072 --against HEAD~1 --ops-repeat 2000
    python tools/bench_start.py --first-start 5                # H200: CUDA first start, preload or not
    python tools/bench_start.py --churn 262144 --against HEAD~1 --repeat 2
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import itertools
import json
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import statistics
import subprocess
import sys
import time
import types
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import aiokv.keys
import aiokv.pagetable
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


@dataclass(frozen=True)
class TableRow:
    impl: str
    pages: int
    build_ms: float
    add_ms: float
    max_stall_ms: float
    gc_ms: float
    gc_full_passes: int
    tracked_objects: int
    offload_us: float
    match_load_us: float
    statistics_us: float


def load_module(rev: str, path: str = "aiokv/pagetable.py") -> types.ModuleType:
    """``path`` as of git revision ``rev``, imported under its own module name."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"{Path(path).stem}_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their class's module up
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def _batch_us(op: Callable[[], object], repeat: int) -> float:
    """Median loop time of ``op`` (microseconds) over ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


async def measure_table(impl: str, module: types.ModuleType, pages: int, chunk: int, repeat: int) -> TableRow:
    gc.collect()
    tracked = len(gc.get_objects())
    passes = [0]

    def count_full(phase: str, info: dict[str, int]) -> None:
        passes[0] += phase == "start" and info["generation"] == 2

    gc.callbacks.append(count_full)
    clock = GcClock()
    probe = LagProbe()
    await asyncio.sleep(0.01)  # the probe's first ticks
    probe.take()
    start = time.perf_counter()
    table = await asyncio.get_running_loop().run_in_executor(None, module.PageTable, pages)
    build = time.perf_counter() - start
    add = 0.0
    for first in range(0, pages, chunk):
        begin = time.perf_counter()
        table.add_usable(range(first, min(first + chunk, pages)))  # as PagePool absorbs a chunk
        add += time.perf_counter() - begin
        await asyncio.sleep(0)
    stall = max(probe.take(), default=0.0)
    probe.stop()
    gc_seconds = clock.stop()
    gc.callbacks.remove(count_full)
    added = len(gc.get_objects()) - tracked

    # Fill it with READY pages, then time 256-page batches of the hot path on the full table.
    counter = iter(range(1 << 62))

    def new_keys() -> list[bytes]:
        return [next(counter).to_bytes(16, "little") for _ in range(256)]

    for _ in range(pages // 256):
        for r in table.reserve(new_keys()):
            table.commit(r.handle)
    resident = new_keys()  # a prefix that stays in the pool: matched over and over
    for r in table.reserve(resident):
        table.commit(r.handle)

    def offload() -> None:
        for r in table.reserve(new_keys()):  # each new page evicts the least recently used one
            table.commit(r.handle)

    def match_load() -> None:
        handles = table.acquire_prefix(resident)
        for h in handles:
            table.check(h)
        for h in handles:
            table.release(h)

    return TableRow(
        impl=impl,
        pages=pages,
        build_ms=_ms(build),
        add_ms=_ms(add),
        max_stall_ms=_ms(stall),
        gc_ms=_ms(gc_seconds),
        gc_full_passes=passes[0],
        tracked_objects=added,
        offload_us=_batch_us(offload, repeat),
        match_load_us=_batch_us(match_load, repeat),
        statistics_us=_batch_us(table.statistics, repeat),
    )


async def run_table(args: argparse.Namespace) -> list[TableRow]:
    impls: list[tuple[str, types.ModuleType]] = [("current", aiokv.pagetable)]
    if args.against:
        impls.append((args.against, load_module(args.against)))
    rows: list[TableRow] = []
    for pages in args.table:
        for rep in range(args.repeat):
            for impl, module in impls if rep % 2 == 0 else impls[::-1]:
                row = await measure_table(impl, module, pages, args.table_chunk, args.ops_repeat)
                rows.append(row)
                print(json.dumps(asdict(row)), file=sys.stderr)
    return rows


def report_table(rows: list[TableRow]) -> None:
    print(
        f"{'impl':>9} {'pages':>8} {'build ms':>9} {'add ms':>7} {'max stall':>9} {'gc ms':>7} {'full gc':>7} "
        f"{'objects':>8} {'offload us':>10} {'match+load us':>13} {'stats us':>9}"
    )
    for r in rows:
        print(
            f"{r.impl:>9} {r.pages:8d} {r.build_ms:9.1f} {r.add_ms:7.1f} {r.max_stall_ms:9.2f} {r.gc_ms:7.1f} "
            f"{r.gc_full_passes:7d} {r.tracked_objects:8d} {r.offload_us:10.1f} {r.match_load_us:13.1f} "
            f"{r.statistics_us:9.1f}"
        )
    others = sorted({r.impl for r in rows} - {"current"})
    for other in others:
        print(f"ratios current/{other} (medians per size): max stall, offload, match+load, statistics")
        for pages in sorted({r.pages for r in rows}):

            def med(impl: str, field: str, n: int = pages) -> float:
                return float(statistics.median(getattr(r, field) for r in rows if r.impl == impl and r.pages == n))

            parts = []
            for field in ("max_stall_ms", "offload_us", "match_load_us", "statistics_us"):
                a, b = med("current", field), med(other, field)
                parts.append(f"{a:.1f}/{b:.1f} = {a / b:.2f}x" if b else f"{a:.1f}/{b:.1f}")
            print(f"  {pages:8d} pages: " + "; ".join(parts))


@dataclass(frozen=True)
class TokenRow:
    impl: str
    tokens: int
    kind: str
    median_us: float
    best_us: float


def _token_inputs(count: int) -> dict[str, object]:
    ids = np.random.default_rng(0).integers(0, 150_000, count, dtype=np.int64)  # a vocabulary's range
    return {"list": ids.tolist(), "tuple": tuple(ids.tolist()), "numpy": ids, "tensor": torch.from_numpy(ids)}


def run_tokens(args: argparse.Namespace) -> list[TokenRow]:
    """``keys.token_array`` per input kind, current and ``--against`` alternated call by call."""
    impls: list[tuple[str, types.ModuleType]] = [("current", aiokv.keys)]
    if args.against:
        impls.append((args.against, load_module(args.against, "aiokv/keys.py")))
    rows: list[TokenRow] = []
    for count in args.token_array:
        for kind, value in _token_inputs(count).items():
            times: dict[str, list[float]] = {impl: [] for impl, _ in impls}
            expected = aiokv.keys.token_array(value).tobytes()  # type: ignore[arg-type]
            for rep in range(args.ops_repeat):
                for impl, module in impls if rep % 2 == 0 else impls[::-1]:
                    start = time.perf_counter()
                    out = module.token_array(value)
                    times[impl].append(time.perf_counter() - start)
                    if rep == 0 and out.tobytes() != expected:
                        raise AssertionError(f"{impl} gives other bytes for a {kind}")
            for impl, samples in times.items():
                row = TokenRow(
                    impl, count, kind, round(statistics.median(samples) * 1e6, 1), round(min(samples) * 1e6, 1)
                )
                rows.append(row)
                print(json.dumps(asdict(row)), file=sys.stderr)
    return rows


def report_tokens(rows: list[TokenRow]) -> None:
    print(f"{'impl':>9} {'tokens':>7} {'kind':>7} {'median us':>10} {'best us':>8}")
    for r in rows:
        print(f"{r.impl:>9} {r.tokens:7d} {r.kind:>7} {r.median_us:10.1f} {r.best_us:8.1f}")
    for other in sorted({r.impl for r in rows} - {"current"}):
        print(f"ratios current/{other} (medians)")
        for r in rows:
            if r.impl == "current":
                (o,) = [x for x in rows if x.impl == other and (x.tokens, x.kind) == (r.tokens, r.kind)]
                ratio = r.median_us / o.median_us
                print(f"  {r.tokens:7d} {r.kind:>7}: {r.median_us:.1f}/{o.median_us:.1f} = {ratio:.2f}x")


@dataclass(frozen=True)
class ChurnRow:
    impl: str
    pages: int
    op: str
    count: int
    p50_us: float
    p99_us: float
    p999_us: float
    max_us: float
    over_1ms: int


def measure_churn(impl: str, module: types.ModuleType, pages: int, ops: int) -> list[ChurnRow]:
    """A full table (every page READY), then ``ops`` rounds of: insert one new key (reserve +
    commit; every other round it evicts the least recently used page inline, the others take the
    page an explicit ``evict(1)`` freed), look one resident key up (acquire + release), and every
    other round ``evict(1)``. Each call timed alone, in this thread's CPU time (a busy machine's
    preemptions are not the table's); cyclic GC off (its passes are not the table's either)."""
    table = module.PageTable(pages)
    for first in range(0, pages, 4096):
        table.add_usable(range(first, min(first + 4096, pages)))
    keys = (i.to_bytes(8, "little") * 2 for i in itertools.count(1))  # digests' first bytes vary
    recent: collections.deque[bytes] = collections.deque(maxlen=1024)
    for _ in range(pages // 256):
        batch = [next(keys) for _ in range(256)]
        for r in table.reserve(batch):
            table.commit(r.handle)
        recent.extend(batch)
    times = {op: array("q", bytes(8 * ops)) for op in ("insert", "lookup", "evict")}
    insert, lookup, evict = times["insert"], times["lookup"], times["evict"]
    clock = time.thread_time_ns  # CPU time of this thread: a shared machine's preemptions stay out
    evicted = 0
    gc.disable()
    try:
        for i in range(ops):
            key = next(keys)
            began = clock()
            (r,) = table.reserve([key])
            table.commit(r.handle)
            insert[i] = clock() - began
            recent.append(key)
            resident = recent[0]
            began = clock()
            handle = table.acquire(resident)
            table.release(handle)
            lookup[i] = clock() - began
            if i % 2:
                began = clock()
                table.evict(1)
                evict[evicted] = clock() - began
                evicted += 1
    finally:
        gc.enable()
    rows = []
    for op, samples in times.items():
        count = evicted if op == "evict" else ops
        us = np.frombuffer(samples, dtype=np.int64)[:count] / 1000.0
        p50, p99, p999 = np.percentile(us, [50, 99, 99.9])
        rows.append(
            ChurnRow(
                impl,
                pages,
                op,
                count,
                round(float(p50), 2),
                round(float(p99), 2),
                round(float(p999), 2),
                round(float(us.max()), 1),
                int((us > 1000).sum()),
            )
        )
    return rows


def run_churn(args: argparse.Namespace) -> list[ChurnRow]:
    impls: list[tuple[str, types.ModuleType]] = [("current", aiokv.pagetable)]
    if args.against:
        impls.append((args.against, load_module(args.against)))
    rows: list[ChurnRow] = []
    for pages in args.churn:
        for rep in range(args.repeat):
            for impl, module in impls if rep % 2 == 0 else impls[::-1]:
                for row in measure_churn(impl, module, pages, args.churn_ops or 2 * pages):
                    rows.append(row)
                    print(json.dumps(asdict(row)), file=sys.stderr)
                gc.collect()
    return rows


def report_churn(rows: list[ChurnRow]) -> None:
    print(
        f"{'impl':>9} {'pages':>8} {'op':>7} {'count':>8} {'p50 us':>7} {'p99 us':>7} {'p99.9 us':>8} "
        f"{'max us':>8} {'>1ms':>5}"
    )
    for r in rows:
        print(
            f"{r.impl:>9} {r.pages:8d} {r.op:>7} {r.count:8d} {r.p50_us:7.2f} {r.p99_us:7.2f} {r.p999_us:8.2f} "
            f"{r.max_us:8.1f} {r.over_1ms:5d}"
        )
    for other in sorted({r.impl for r in rows} - {"current"}):
        print(f"ratios current/{other} (medians over repeats): p50, p99, max")
        for pages in sorted({r.pages for r in rows}):
            for op in ("insert", "lookup", "evict"):

                def med(impl: str, field: str, n: int = pages, o: str = op) -> float:
                    return float(
                        statistics.median(getattr(r, field) for r in rows if (r.impl, r.pages, r.op) == (impl, n, o))
                    )

                parts = []
                for field in ("p50_us", "p99_us", "max_us"):
                    a, b = med("current", field), med(other, field)
                    parts.append(f"{a:.2f}/{b:.2f} = {a / b:.2f}x")
                print(f"  {pages:8d} {op:>7}: " + "; ".join(parts))


FIRST_START = """
import asyncio, gc, json, sys, time
import torch
from aiokv import CacheConfig, KVCache, KVLayout, TransferPath

device, path, preload = sys.argv[1], sys.argv[2], sys.argv[3] == "preload"
path = None if path == "default" else TransferPath(path)
layout = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=16)  # 8B-shaped, 2 MiB pages
kv = torch.zeros(layout.num_layers, 1024, layout.rows, layout.head_dim, dtype=layout.dtype, device=device)
began = time.perf_counter()
preloaded = KVCache.preload(device, path) if preload else ()
preload_ms = (time.perf_counter() - began) * 1e3

async def main() -> dict[str, object]:
    gc.collect()  # the full collection importing torch leaves owed is not the start's
    loop = asyncio.get_running_loop()
    worst, due = 0.0, loop.time() + 0.001
    def tick() -> None:
        global handle
        nonlocal worst, due
        now = loop.time()
        worst, due = max(worst, now - due), now + 0.001
        handle = loop.call_at(due, tick)
    global handle
    handle = loop.call_at(due, tick)
    await asyncio.sleep(0.05)
    worst = 0.0
    config = CacheConfig(cpu_bytes=1 << 30, disk_dir=None, namespace="first", transfer_path=path)
    began = time.perf_counter()
    cache = KVCache(config, layout, kv)
    await cache.start()
    start_ms, start_stall, worst = (time.perf_counter() - began) * 1e3, worst, 0.0
    began = time.perf_counter()
    await cache.offload(list(range(64)), torch.arange(64, device=device))
    offload_ms, offload_stall, worst = (time.perf_counter() - began) * 1e3, worst, 0.0
    await cache.offload(list(range(1000, 1064)), torch.arange(64, device=device))
    second_stall = worst
    counted = cache.stats().errors.get("start_imports", 0)
    await cache.aclose()
    handle.cancel()
    return {"start_ms": start_ms, "start_stall_ms": start_stall * 1e3, "offload_ms": offload_ms,
            "first_offload_stall_ms": offload_stall * 1e3, "second_offload_stall_ms": second_stall * 1e3,
            "start_imports": counted}

print(json.dumps({"preloaded": list(preloaded), "preload_ms": preload_ms, **asyncio.run(main())}))
"""


def run_first_start(args: argparse.Namespace) -> list[dict[str, object]]:
    """Fresh processes, without and with ``KVCache.preload`` alternated: the loop's worst stall
    during the first ``start()`` and during the first two offloads (a 1 ms probe)."""
    rows: list[dict[str, object]] = []
    for rep in range(args.first_start):
        for mode in ("cold", "preload") if rep % 2 == 0 else ("preload", "cold"):
            run = subprocess.run(
                [sys.executable, "-c", FIRST_START, args.device, args.transfer_path, mode],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if run.returncode != 0:
                raise RuntimeError(run.stderr)
            row = {"mode": mode, **json.loads(run.stdout.splitlines()[-1])}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def report_first_start(rows: list[dict[str, object]]) -> None:
    fields = ("preload_ms", "start_ms", "start_stall_ms", "first_offload_stall_ms", "second_offload_stall_ms")
    print(f"{'mode':>8} " + " ".join(f"{f:>24}" for f in fields) + " start_imports")
    for r in rows:
        print(f"{r['mode']:>8} " + " ".join(f"{float(r[f]):24.2f}" for f in fields) + f" {r['start_imports']}")  # type: ignore[arg-type]
    print("medians preload/cold:")
    for f in fields[1:]:
        pre = statistics.median(float(r[f]) for r in rows if r["mode"] == "preload")  # type: ignore[arg-type]
        cold = statistics.median(float(r[f]) for r in rows if r["mode"] == "cold")  # type: ignore[arg-type]
        print(f"  {f}: {pre:.2f} / {cold:.2f} ms" + (f" = {pre / cold:.2f}x" if cold else ""))


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
    parser.add_argument("--table", type=int, nargs="+", help="page counts: measure the page table alone")
    parser.add_argument("--table-chunk", type=int, default=4096, help="pages handed over per chunk (--table)")
    parser.add_argument("--ops-repeat", type=int, default=200, help="timed batches per hot-path operation (--table)")
    parser.add_argument("--against", help="git revision whose page table is measured alongside (--table)")
    parser.add_argument("--token-array", type=int, nargs="+", help="token counts: time keys.token_array alone")
    parser.add_argument("--first-start", type=int, help="fresh processes per mode: first start with/without preload")
    parser.add_argument("--device", default="cuda", help="KV buffer device (--first-start)")
    parser.add_argument("--transfer-path", default="default", help="TransferPath value or 'default' (--first-start)")
    parser.add_argument("--churn", type=int, nargs="+", help="page counts: insert/lookup/evict latency, full table")
    parser.add_argument("--churn-ops", type=int, help="rounds per table (--churn; default twice its pages)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.churn:
        churn_rows = run_churn(args)
        report_churn(churn_rows)
        dumped: list[dict[str, object]] = [asdict(r) for r in churn_rows]
    elif args.first_start:
        start_rows = run_first_start(args)
        report_first_start(start_rows)
        dumped = start_rows
    elif args.token_array:
        token_rows = run_tokens(args)
        report_tokens(token_rows)
        dumped = [asdict(r) for r in token_rows]
    elif args.table:
        table_rows = asyncio.run(run_table(args))
        report_table(table_rows)
        dumped = [asdict(r) for r in table_rows]
    else:
        rows = asyncio.run(run(args))
        report(rows)
        dumped = [asdict(r) for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dumped, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
