"""Throughput of the public API against baselines measured in the same run.

GPU (H200), ``--mode gpu``: an 8B-class layout (32 layers, 8 KV heads, head_dim 128, bf16,
256-token pages = 32 MiB), KV buffer on the GPU, random slots. ``offload`` and ``match``+``load``
through ``KVCache`` against a plain pinned ``copy_`` of the same bytes (D2H and H2D), with the event
loop's lag (a 1 ms periodic callback). Then the streaming API (``start_load``, layer by layer with
``--layered``): an engine claims ``--claim-tokens`` at a time, each "computed" in ``--compute-ms``
(GPU sleep on its stream, the host free), until the fronts meet, then waits on every layer and
finishes. While it streams: the loop's lag (target p99 <= 1.2 ms), the CUDA-event bridge's latency
(target p99 <= 200 us: time from the GPU finishing, seen by a thread spinning on a spin event
recorded beside it, to the awaiting future resolving; for events with the default flags and for
blocking-sync ones), and the CPU time the cache's waiter threads burn per second (a spinning waiter
burns ~1 s/s). ``--device cpu`` runs the same code with a CPU KV buffer and a small layout (no
bridge: a smoke run for machines without a GPU).

Development machine, ``--mode disk``: pages written to the disk tier, then loaded through the API
(match + load into a CPU KV buffer) against the raw disk tier reading the same pages into the pool
(``DiskTier.read`` at the same depth). Runs alternate A/B ``--rounds`` times.

Any machine, ``--mode loop``: the event loop's own cost of the bookkeeping, not of the bytes. CPU
time of the loop thread (``time.thread_time``) per ``offload`` of ``--pages`` new pages through
``KVCache`` with a CPU KV buffer and tiny pages (the copies run on the copy thread), into a full
pool, so every page evicts one; ``--disk`` adds the write-behind queueing. ``--against REV`` runs
the same measurement on git revision REV's package too, each in a fresh process, alternated
``--rounds`` times, and prints the ratio.

Any machine, ``--mode stream``: the loop thread's time per streaming hit through the public API
(``match``, ``start_load(layered=True)``, the claims until the fronts meet, ``launched``, a
``wait_layer`` per layer, ``finish``) of ``--pages`` pool pages of 256 tokens (64: a 16K-token
prompt), 32 layers: CPU time of the loop thread (``time.thread_time``) per hit and per call, and
the CPU time of the longest single loop callback of each hit (what a loop lag is made of).
``--device cpu`` (the default without a GPU): a CPU KV buffer with one 16-wide head, the copies
on the copy thread (Python-driven index copies, ~0.5 s a hit on 2 cores: they land untimed before
the ``wait_layer`` calls are timed; the loop's CPU while they land, the layers' hand-over, is
reported apart); ``cuda``: the 8B shape, timed as an engine calls it.
``--token-list`` passes the token ids as a list of ints (what many engines hold) instead of an
int64 array. ``--against REV`` alternates with revision REV's package as in loop mode.

    python tools/bench_cache.py --mode gpu --json out.json
    python tools/bench_cache.py --mode gpu --device cpu --pages 8 --prompts 2
    python tools/bench_cache.py --mode gpu --layered --slots contiguous --load-runs-ab
    python tools/bench_cache.py --mode disk --dir /var/tmp/aiokv-bench
    python tools/bench_cache.py --mode loop --pages 256 --against HEAD~3 --rounds 4
    python tools/bench_cache.py --mode stream --against HEAD~3 --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aiokv import CacheConfig, KVCache, KVLayout
from aiokv.cuda import CompletionBridge, Lane
from aiokv.pool import PagePool
from aiokv.storage import DiskConfig, DiskTier


class LoopLag:
    """Lateness of a 1 ms periodic callback while a workload runs."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        expected = loop.time() + self.period
        while True:
            await asyncio.sleep(max(0.0, expected - loop.time()))
            now = loop.time()
            self.samples.append(max(0.0, now - expected))
            expected = now + self.period

    def __enter__(self) -> LoopLag:
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
        ordered = sorted(self.samples)
        return {
            "p50_ms": ordered[len(ordered) // 2] * 1e3,
            "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
            "max_ms": ordered[-1] * 1e3,
        }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


# -- GPU ------------------------------------------------------------------------------------------


def _event(blocking: bool) -> torch.cuda.Event:
    return torch.cuda.Event(blocking=blocking)  # type: ignore[no-untyped-call]


class Watcher:
    """One thread that launches each sample's GPU work and busy-waits (GIL released) on its spin
    event, stamping when it completed: the reference the bridge's latency is measured from.
    Persistent: a thread per sample would load the loop the measurement runs on. The launches run
    here, not on the loop: a GPU sleep and two event records on the loop thread waited for the GIL
    up to 2.8 ms per step on the H200, the benchmark's own share of the lag it reports."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Sample | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bench-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if callable(item):
                item()  # a thread -> loop wake-up sample (:meth:`wake`)
                continue
            stream, (event, spin), launched, stamp = item
            try:
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(200_000)  # type: ignore[no-untyped-call]  # ~0.1 ms of GPU time
                    event.record(stream)
                    spin.record(stream)  # completes with ``event``
            except Exception as exc:  # handed to the loop's sample, which raises it
                launched.set_exception(exc)
                stamp.set_exception(exc)
                continue
            launched.set_result(None)
            spin.synchronize()
            stamp.set_result(time.perf_counter())

    def sample(self, stream: torch.cuda.Stream, events: tuple[torch.cuda.Event, torch.cuda.Event],
               ) -> tuple[concurrent.futures.Future[None], concurrent.futures.Future[float]]:
        """Launch one sample on the watcher's thread: (launched, completed-at) futures."""
        launched: concurrent.futures.Future[None] = concurrent.futures.Future()
        stamp: concurrent.futures.Future[float] = concurrent.futures.Future()
        self._queue.put((stream, events, launched, stamp))
        return launched, stamp

    def wake(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[float]) -> None:
        """From this thread, after ~0.1 ms (the loop asleep by then): stamp, then resolve ``future``
        with the stamp through ``call_soon_threadsafe``, the bridge's own hand-over without CUDA."""
        def sample() -> None:
            time.sleep(0.0001)
            stamp = time.perf_counter()
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(stamp))

        self._queue.put(sample)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


_Sample = (tuple[torch.cuda.Stream, tuple[torch.cuda.Event, torch.cuda.Event],
                 concurrent.futures.Future[None], concurrent.futures.Future[float]]
           | Callable[[], None])


async def _bridge_sample(bridge: CompletionBridge, watcher: Watcher, stream: torch.cuda.Stream,
                         events: tuple[torch.cuda.Event, torch.cuda.Event]) -> float:
    """One GPU completion -> future resolution, in microseconds. ``events``: the event the bridge
    waits on (blocking-sync or not) and a spin event the watcher busy-waits on; created once per
    run and re-recorded (both completed before the next sample): creating events on the loop each
    sample added to the very lag the benchmark measures."""
    launched, seen = watcher.sample(stream, events)
    await asyncio.wrap_future(launched)  # the bridge must see the event recorded, not a stale one
    await bridge.wait(events[0], Lane.LOAD)
    resolved = time.perf_counter()
    return max(0.0, resolved - await asyncio.wrap_future(seen)) * 1e6


def _latency_summary(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {"samples": 0}
    return {"samples": len(latencies), "p50_us": pct(latencies, 0.5), "p99_us": pct(latencies, 0.99),
            "max_us": max(latencies)}


async def _wake_sample(watcher: Watcher) -> float:
    """One thread -> loop wake-up (``call_soon_threadsafe`` to the awaiting coroutine), in microseconds."""
    future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    watcher.wake(asyncio.get_running_loop(), future)
    stamp = await future
    return max(0.0, time.perf_counter() - stamp) * 1e6


async def bridge_latency(samples: int, stop: asyncio.Event | None = None) -> dict[str, dict[str, float]]:
    """GPU completion -> future resolution on a bridge of its own, spin and blocking-sync events
    alternated: ``samples`` of them, or (``stop``) until ``stop`` is set; between them, the baseline
    of the same run: a thread waking the loop with no CUDA in the way (``thread_wake``), the part of
    the bridge's latency that is the loop thread's own wake-up."""
    bridge = CompletionBridge()
    bridge.prestart(True)
    watcher = Watcher()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    latencies: dict[bool, list[float]] = {False: [], True: []}
    wakes: list[float] = []
    events = {blocking: (_event(blocking), _event(False)) for blocking in (False, True)}
    try:
        i = 0
        while (i < samples) if stop is None else not stop.is_set():
            blocking = bool(i % 2)
            latencies[blocking].append(await _bridge_sample(bridge, watcher, stream, events[blocking]))
            if blocking:
                wakes.append(await _wake_sample(watcher))
            i += 1
    finally:
        await asyncio.to_thread(watcher.close)
        await asyncio.to_thread(bridge.close)
    return {"spin_events": _latency_summary(latencies[False]),
            "blocking_events": _latency_summary(latencies[True]),
            "thread_wake": _latency_summary(wakes)}


def memcpy_gbps(nbytes: int, direction: str, repeat: int, device: torch.device) -> float:
    """A plain copy of ``nbytes`` (pinned host memory on CUDA), median GB/s."""
    cuda = device.type == "cuda"
    device_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if direction == "d2h":
            host.copy_(device_buf, non_blocking=cuda)
        else:
            device_buf.copy_(host, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def thread_clocks_work() -> bool:
    """Whether another thread's CPU clock advances here (under gVisor it read 0 for every thread)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        assert thread.ident is not None
        clock = time.pthread_getcpuclockid(thread.ident)
        first = time.clock_gettime(clock)
        time.sleep(0.05)
        return time.clock_gettime(clock) - first > 0.005
    finally:
        stop.set()
        thread.join()


class ThreadCPU:
    """CPU seconds the given threads used over a ``with`` window (``cpu``), its wall seconds
    (``wall``) and their ratio (``share``; a spinning thread: ~1). ``cpu`` and ``share`` are None
    where per-thread CPU clocks do not work (``thread_clocks_work``). Also used by the tests."""

    def __init__(self, threads: list[threading.Thread]) -> None:
        self._clocks = [time.pthread_getcpuclockid(t.ident) for t in threads if t.ident is not None]
        self.cpu: float | None = 0.0  # no threads: nothing burned
        if self._clocks and not thread_clocks_work():
            self._clocks = []
            self.cpu = None
        self.wall = 0.0
        self._start = 0.0

    @property
    def share(self) -> float | None:
        return None if self.cpu is None else self.cpu / max(1e-9, self.wall)

    def _cpu(self) -> float:
        return sum(time.clock_gettime(clock) for clock in self._clocks)

    def __enter__(self) -> ThreadCPU:
        self._start, self.wall = self._cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        if self._clocks:
            self.cpu = self._cpu() - self._start


def _where(handle: asyncio.events.Handle) -> str:
    """For a task step: the innermost coroutine of the task's await chain and its line."""
    task = getattr(handle._callback, "__self__", None)  # type: ignore[attr-defined]
    coro: Any = task.get_coro() if isinstance(task, asyncio.Task) else None
    where = ""
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        frame = coro.cr_frame
        where = f"{coro.__qualname__}:{frame.f_lineno}"
        coro = getattr(coro, "cr_await", None)
    return where


class LongSteps:
    """The loop's longest callbacks (task steps included) while active: what a loop lag is made of.
    Wraps ``asyncio.events.Handle._run`` (the asyncio loop; uvloop runs its own handles)."""

    def __init__(self, threshold_s: float = 0.0005, keep: int = 8) -> None:
        self._threshold = threshold_s
        self._keep = keep
        self.steps: list[tuple[float, str]] = []
        self._run = asyncio.events.Handle._run

    def __enter__(self) -> LongSteps:
        run, steps, threshold = self._run, self.steps, self._threshold

        def timed(handle: asyncio.events.Handle) -> None:
            before = _where(handle)
            start = time.perf_counter()
            run(handle)
            took = time.perf_counter() - start
            if took > threshold:
                steps.append((took, f"{before} -> {_where(handle)}" if before else repr(handle)[:200]))

        asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.events.Handle._run = self._run  # type: ignore[method-assign]

    def summary(self) -> list[dict[str, Any]]:
        top = sorted(self.steps, reverse=True)[: self._keep]
        return [{"ms": took * 1e3, "callback": what} for took, what in top]


async def _stream_one(cache: KVCache, tokens: Any, slots: torch.Tensor, args: argparse.Namespace) -> dict[str, int]:
    """One hit through ``start_load``: claims with simulated compute, then every layer, then finish."""
    cuda = slots.device.type == "cuda" or cache.kv.device.type == "cuda"
    match = await cache.match(tokens)
    stream = await cache.start_load(match, slots, layered=args.layered)
    async with stream:
        pos = 0
        while (end := stream.claim(pos + args.claim_tokens)) > pos:
            if cuda:
                torch.cuda._sleep(int(args.compute_ms * 1.4e6))  # type: ignore[no-untyped-call]  # ~compute_ms (1.4 GHz)
            await asyncio.sleep(args.compute_ms / 1e3)  # the host is free while the chunk computes
            pos = end
        await stream.launched()
        for layer in range(cache.layout.num_layers):
            await stream.wait_layer(layer)  # CUDA: the current stream waits on the GPU, the host does not
        result = await stream.finish()
    return {"claimed": result.claimed, "loaded_from": result.loaded_from, "tokens": result.tokens}


def _draw_slots(args: argparse.Namespace, slots: int, count: int, page: int, device: str) -> torch.Tensor:
    """``count`` destination slots of ``slots``: ``random`` (each token anywhere: the loads stage and
    scatter), ``blocks`` (whole pages of an engine's block table, blocks shuffled: each page's slots
    a run) or ``contiguous`` (blocks in order from a random block, as a fresh block table hands out:
    one run; layer-wise loads go by run copies)."""
    if args.slots == "random":
        return torch.randperm(slots, device=device)[:count]
    blocks = slots // page
    need = -(-count // page)
    if args.slots == "blocks":
        chosen = torch.randperm(blocks)[:need]
    else:
        first = int(torch.randint(0, blocks - need + 1, ()).item())
        chosen = torch.arange(first, first + need)
    runs = (chosen[:, None] * page + torch.arange(page)[None, :]).reshape(-1)[:count]
    return runs.to(device)


async def gpu_mode(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        layout = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=256)
    else:  # a smoke run: 128 KiB pages
        layout = KVLayout.mha(4, 2, 64, torch.bfloat16, page_tokens=64)
    pages = args.pages
    tokens_per_prompt = pages * layout.page_tokens
    prompts = args.prompts
    slots = tokens_per_prompt * 2
    kv = torch.randn(layout.num_layers, slots, layout.rows, layout.head_dim, dtype=layout.dtype, device=device)
    config = CacheConfig(
        cpu_bytes=(prompts * pages + 8) * layout.page_bytes, disk_dir=None, namespace="bench"
    )
    results: dict[str, Any] = {
        "device": str(device), "layout": layout.describe(), "pages_per_call": pages, "prompts": prompts,
        "gpu_slots": args.gpu_slots, "layered": args.layered, "claim_tokens": args.claim_tokens,
        "compute_ms": args.compute_ms, "slots": args.slots, "load_runs_ab": args.load_runs_ab,
    }
    nbytes = pages * layout.payload_bytes
    results["memcpy_d2h_gbps"] = memcpy_gbps(nbytes, "d2h", 10, device)
    results["memcpy_h2d_gbps"] = memcpy_gbps(nbytes, "h2d", 10, device)
    slot_device = "cuda" if args.gpu_slots and cuda else "cpu"

    def draw() -> torch.Tensor:
        return _draw_slots(args, slots, tokens_per_prompt, layout.page_tokens, slot_device)

    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        # Token ids as an int64 array and slot indices on the CPU: what an engine's scheduler holds
        # (a list of ints costs ~0.1 us per token to convert; CUDA slots cost a read-back).
        token_sets = [torch.randint(0, 100_000, (tokens_per_prompt,)).numpy() for _ in range(prompts)]
        # Warm-up (Triton compilation, staging allocation, the streaming path once).
        warm = torch.randint(0, 100_000, (tokens_per_prompt,)).numpy()
        await cache.offload(warm, draw())
        async with await cache.match(warm) as m:
            await cache.load(m, draw())
        await _stream_one(cache, warm, draw(), args)
        with LoopLag() as lag:
            if cuda:
                torch.cuda.synchronize()
            offload_times = []
            for tokens in token_sets:
                src = draw()
                start = time.perf_counter()
                await cache.offload(tokens, src)
                offload_times.append(time.perf_counter() - start)
            load_times = []
            for tokens in token_sets:
                dst = draw()
                match = await cache.match(tokens)
                start = time.perf_counter()
                await cache.load(match, dst)
                load_times.append(time.perf_counter() - start)
        results["offload_gbps"] = nbytes / statistics.median(offload_times) / 1e9
        results["load_gbps"] = nbytes / statistics.median(load_times) / 1e9
        results["offload_vs_memcpy"] = results["offload_gbps"] / results["memcpy_d2h_gbps"]
        results["load_vs_memcpy"] = results["load_gbps"] / results["memcpy_h2d_gbps"]
        results["loop_lag"] = lag.summary()
        # Streaming: the lag and the bridge latency are measured while hits stream.
        if cuda:
            torch.cuda.synchronize()
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(bridge_latency(0, stop)) if cuda else None
        waiters = list(cache._bridge._threads)  # the cache's waiter threads (CUDA), none on a CPU buffer
        outcomes = []
        stream_times = []
        # --load-runs-ab: hits alternate between loads (layer-wise or whole) by run copies and staged ones.
        mover = cache._transfers.mover if cache._transfers is not None else None
        arms: dict[bool, list[float]] = {True: [], False: []}
        runs_before = mover.runs_loaded if mover is not None else 0
        with LoopLag() as stream_lag, ThreadCPU(waiters) as waiter_cpu, LongSteps() as long_steps:
            for _ in range(args.stream_rounds):
                for i, tokens in enumerate(token_sets):
                    use_runs = i % 2 == 0
                    if args.load_runs_ab and mover is not None:
                        mover.load_runs = use_runs
                    dst = draw()
                    start = time.perf_counter()
                    outcomes.append(await _stream_one(cache, tokens, dst, args))
                    stream_times.append(time.perf_counter() - start)
                    arms[use_runs].append(stream_times[-1])
            stop.set()
            bridge_streaming = await sampler if sampler is not None else None
        results["stream"] = {
            "hits": len(outcomes), "median_s": statistics.median(stream_times),
            "claimed_tokens_median": statistics.median(o["claimed"] for o in outcomes),
            "loaded_tokens_median": statistics.median(o["tokens"] - o["loaded_from"] for o in outcomes),
            "loop_lag": stream_lag.summary(), "bridge": bridge_streaming,
            "waiter_threads": len(waiters), "waiter_cpu_per_s": waiter_cpu.share,
            "long_steps": long_steps.summary(), "long_steps_over_0.5ms": len(long_steps.steps),
            "runs_loaded_pages": (mover.runs_loaded if mover is not None else 0) - runs_before,
        }
        if args.load_runs_ab and arms[True] and arms[False]:
            runs_s, staged_s = statistics.median(arms[True]), statistics.median(arms[False])
            results["stream"]["load_runs_ab"] = {
                "runs_median_s": runs_s, "staged_median_s": staged_s, "runs_over_staged": runs_s / staged_s,
                "hits_each": min(len(arms[True]), len(arms[False])),
            }
    results["bridge_idle"] = await bridge_latency(args.bridge_samples) if cuda else None
    return results


# -- disk -----------------------------------------------------------------------------------------


def _drop_page_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def raw_tier_read(root: Path, layout: KVLayout, keys: list[bytes], depth: int) -> float:
    pool = PagePool.create(layout, (len(keys) + 1) * layout.page_bytes)
    try:
        await pool.wait_ready()
        tier = DiskTier(
            DiskConfig(directory=root, capacity_bytes=1 << 40, queue_depth=depth), layout, pool
        )
        async with tier:
            reservations = pool.reserve(keys)
            handles = [r.handle for r in reservations]
            assert all(h is not None for h in handles)
            await asyncio.to_thread(_drop_page_cache, root)
            start = time.perf_counter()
            oks = await asyncio.gather(*(tier.read(k, h) for k, h in zip(keys, handles, strict=True)))  # type: ignore[arg-type]
            elapsed = time.perf_counter() - start
            assert all(oks), "raw read failed"
            for h in handles:
                pool.table.abort(h)  # type: ignore[arg-type]
    finally:
        await pool.aclose()
    return len(keys) * layout.page_bytes / elapsed / 1e9


async def api_read(root: Path, layout: KVLayout, tokens: list[int], kv: torch.Tensor, depth: int) -> float:
    pages = len(tokens) // layout.page_tokens
    config = CacheConfig(
        cpu_bytes=(pages + 1) * layout.page_bytes, disk_dir=root, disk_bytes=1 << 40,
        disk_queue_depth=depth, namespace="bench",
    )
    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        await asyncio.to_thread(_drop_page_cache, root)
        start = time.perf_counter()
        match = await cache.match(tokens)
        assert match.disk_pages == pages, match
        result = await cache.load(match, torch.arange(len(tokens)))
        elapsed = time.perf_counter() - start
        assert result.tokens == len(tokens), result
    return pages * layout.page_bytes / elapsed / 1e9


async def disk_mode(args: argparse.Namespace) -> dict[str, Any]:
    # 4 MiB pages: 4 layers x 64 tokens x 16 rows x 128 x bf16... sized by --page-mib.
    tokens_per_page = 64
    rows_dim = args.page_mib * (1 << 20) // (4 * tokens_per_page * 2)
    layout = KVLayout.mha(4, 8, rows_dim // 16, torch.bfloat16, page_tokens=tokens_per_page)
    pages = args.disk_pages
    tokens = torch.randint(0, 100_000, (pages * tokens_per_page,)).tolist()
    kv = torch.randn(layout.num_layers, len(tokens), layout.rows, layout.head_dim).to(layout.dtype)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="aiokv-bench-"))
    root = base / "cache"
    shutil.rmtree(root, ignore_errors=True)
    config = CacheConfig(
        cpu_bytes=(pages + 1) * layout.page_bytes, disk_dir=root, disk_bytes=1 << 40, namespace="bench"
    )
    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(len(tokens)))
        keys = cache.keys(tokens)
    rounds: list[dict[str, float]] = []
    target = torch.zeros_like(kv)  # allocated before the lag window: touching it is not aiokv's work
    with LoopLag() as lag:
        for _ in range(args.rounds):
            raw = await raw_tier_read(root, layout, keys, args.depth)
            api = await api_read(root, layout, tokens, target, args.depth)
            rounds.append({"raw_gbps": raw, "api_gbps": api, "ratio": api / raw})
    shutil.rmtree(base if not args.dir else root, ignore_errors=True)
    return {
        "layout": layout.describe(),
        "pages": pages,
        "depth": args.depth,
        "rounds": rounds,
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "loop_lag": lag.summary(),
    }


async def loop_mode(args: argparse.Namespace) -> dict[str, Any]:
    """Loop-thread CPU time per offload of ``args.pages`` new pages (CPU KV buffer, tiny pages), and
    the longest single loop callback (a task step: synchronous work nothing else can interleave)."""
    layout = KVLayout.mha(1, 1, 16, torch.bfloat16, page_tokens=16)  # 4 KiB pages: bookkeeping dominates
    t = layout.page_tokens
    tokens = args.pages * t
    kv = torch.zeros(layout.num_layers, tokens, layout.rows, layout.head_dim, dtype=layout.dtype)
    slots = torch.arange(tokens)
    pool_pages = 8 * args.pages
    root = Path(tempfile.mkdtemp(prefix="aiokv-loop-"))
    config = CacheConfig(cpu_bytes=pool_pages * layout.page_bytes, namespace="loop",
                         **({"disk_dir": root / "disk", "disk_bytes": 1 << 30} if args.disk else {"disk": None}))
    cpu: list[float] = []
    wall: list[float] = []
    steps: list[float] = []  # the longest loop callback (task step) of each call
    longest = [0.0]
    run = asyncio.events.Handle._run

    def timed(handle: asyncio.events.Handle) -> None:
        start = time.perf_counter()
        run(handle)
        longest[0] = max(longest[0], time.perf_counter() - start)

    asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]
    try:
        async with KVCache(config, layout, kv) as cache:
            await cache.pool.wait_ready()
            for call in range(pool_pages // args.pages + args.calls):
                first = call * tokens  # new tokens each call: every page is new
                ids = list(range(first, first + tokens))
                cpu_start, wall_start = time.thread_time(), time.perf_counter()
                longest[0] = 0.0
                result = await cache.offload(ids, slots)
                cpu_end, wall_end = time.thread_time(), time.perf_counter()
                if call >= pool_pages // args.pages:  # the pool is full: each new page evicts one
                    cpu.append(cpu_end - cpu_start)
                    wall.append(wall_end - wall_start)
                    steps.append(longest[0])
                assert result.stored == args.pages, result
                if args.disk:
                    await cache.flush()
    finally:
        asyncio.events.Handle._run = run  # type: ignore[method-assign]
        shutil.rmtree(root, ignore_errors=True)
    return {
        "pages_per_call": args.pages,
        "longest_step_us_p50": statistics.median(steps) * 1e6,
        "longest_step_us_p90": pct(steps, 0.9) * 1e6,
        "disk": args.disk,
        "calls": len(cpu),
        "loop_cpu_us_p50": statistics.median(cpu) * 1e6,
        "loop_cpu_us_p10": pct(cpu, 0.1) * 1e6,
        "loop_cpu_us_p90": pct(cpu, 0.9) * 1e6,
        "wall_us_p50": statistics.median(wall) * 1e6,
    }


class Laps:
    """The loop thread's CPU time (``time.thread_time``) between successive :meth:`lap` calls."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._start = time.thread_time()

    def lap(self, name: str) -> None:
        now = time.thread_time()
        self.spent[name] = now - self._start
        self._start = now


STREAM_PHASES = ("match", "start_load", "claims", "launched", "layers", "finish")
"""The calls of one streaming hit, timed one by one (``claims``: the claim loop while the loader launches)."""


async def stream_mode(args: argparse.Namespace) -> dict[str, Any]:
    """Loop-thread CPU time per streaming hit and per call (see the module docstring)."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    heads, dim = (8, 128) if cuda else (1, 16)  # CPU: 512 KiB pages, so the bytes stay small
    layout = KVLayout.mha(32, heads, dim, torch.bfloat16, page_tokens=256)
    tokens_per_prompt = args.pages * layout.page_tokens
    prompts = 3
    num_slots = 2 * tokens_per_prompt
    kv = torch.randn(layout.num_layers, num_slots, layout.rows, layout.head_dim, dtype=layout.dtype, device=device)
    config = CacheConfig(cpu_bytes=(prompts * args.pages + 8) * layout.page_bytes, disk_dir=None, namespace="bench")
    phases: dict[str, list[float]] = {name: [] for name in STREAM_PHASES}
    landing: list[float] = []  # CPU: the loop's time while the copies land (untimed in the hit)
    hits: list[float] = []
    steps: list[float] = []
    longest = [0.0]
    run = asyncio.events.Handle._run

    def timed(handle: asyncio.events.Handle) -> None:
        # CPU time, not wall: on a CPU buffer the copy thread's Python takes the GIL in between.
        start = time.thread_time()
        run(handle)
        longest[0] = max(longest[0], time.thread_time() - start)

    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        await cache.wait_warm()
        token_sets: list[Any] = [torch.randint(0, 100_000, (tokens_per_prompt,)).numpy() for _ in range(prompts)]
        for ids in token_sets:
            await cache.offload(ids, torch.randperm(num_slots, device=device)[:tokens_per_prompt])
        if args.token_list:
            token_sets = [ids.tolist() for ids in token_sets]
        # The engine's slot indices (host int64), made before the timed hits: not aiokv's work.
        slot_sets = [torch.randperm(num_slots)[:tokens_per_prompt] for _ in range(prompts)]
        asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]
        try:
            for hit in range(args.warm_hits + args.hits):
                tokens, slots = token_sets[hit % prompts], slot_sets[hit % prompts]
                longest[0] = step = 0.0
                laps = Laps()
                lap = laps.lap
                match = await cache.match(tokens)
                lap("match")
                stream = await cache.start_load(match, slots, layered=True)
                lap("start_load")
                async with stream:
                    pos = 0
                    while (end := stream.claim(pos + args.claim_tokens)) > pos:
                        if cuda:
                            torch.cuda._sleep(int(args.compute_ms * 1.4e6))  # type: ignore[no-untyped-call]
                        await asyncio.sleep(args.compute_ms / 1e3)
                        pos = end
                    lap("claims")
                    await stream.launched()
                    lap("launched")
                    if not cuda:
                        # CPU copies are Python-driven index copies on the copy thread (~0.5 s for
                        # 32 MiB on a 2-core machine): let them land untimed, then time the calls.
                        step = longest[0]
                        await stream.wait_layer(layout.num_layers - 1)
                        lap("landing")
                        longest[0] = 0.0
                    for layer in range(layout.num_layers):
                        await stream.wait_layer(layer)
                    lap("layers")
                    result = await stream.finish()
                    lap("finish")
                assert result.loaded_from == result.claimed and result.tokens == tokens_per_prompt, result
                if hit >= args.warm_hits:
                    for name in STREAM_PHASES:
                        phases[name].append(laps.spent[name])
                    if not cuda:
                        landing.append(laps.spent["landing"])
                    hits.append(sum(laps.spent[name] for name in STREAM_PHASES))
                    steps.append(longest[0] if cuda else max(step, longest[0]))
        finally:
            asyncio.events.Handle._run = run  # type: ignore[method-assign]
    return {
        "device": str(device), "layout": layout.describe(), "pages": args.pages, "hits": len(hits),
        "token_list": args.token_list, "claim_tokens": args.claim_tokens, "compute_ms": args.compute_ms,
        "hit_cpu_us_p50": statistics.median(hits) * 1e6,
        "hit_cpu_us_p10": pct(hits, 0.1) * 1e6,
        "hit_cpu_us_p90": pct(hits, 0.9) * 1e6,
        "longest_step_us_p50": statistics.median(steps) * 1e6,
        "longest_step_us_p90": pct(steps, 0.9) * 1e6,
        "phase_cpu_us_p50": {name: statistics.median(v) * 1e6 for name, v in phases.items()},
        "landing_cpu_us_p50": statistics.median(landing) * 1e6 if landing else None,
    }


def package_tree(rev: str, into: Path) -> Path:
    """An importable copy of revision ``rev``'s package (``aiokv`` with ``kernels``/``storage`` inside)."""
    root = Path(__file__).resolve().parent.parent
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=root, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = into / "pkg"
    pkg.mkdir()
    shutil.copytree(src / "aiokv", pkg / "aiokv")
    for part in ("kernels", "storage"):
        (pkg / "aiokv" / part).symlink_to(src / part)
    return pkg


def loop_against(args: argparse.Namespace) -> dict[str, Any]:
    """``--mode loop``/``stream`` on this tree and on ``args.against``, each in a fresh process, alternated."""
    own = [a for a in sys.argv[1:] if a not in ("--against", args.against)]
    scratch = Path(tempfile.mkdtemp(prefix="aiokv-against-"))
    runs: dict[str, list[dict[str, Any]]] = {"current": [], args.against: []}
    try:
        trees = {"current": None, args.against: package_tree(args.against, scratch / "rev")}
        for rnd in range(args.rounds):
            for name in list(trees) if rnd % 2 == 0 else list(trees)[::-1]:
                env = dict(os.environ)
                tree = trees[name]
                if tree is not None:
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
                out = scratch / "run.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), *own, "--json", str(out)]
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
                runs[name].append(json.loads(out.read_text()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result: dict[str, Any] = {"against": args.against, "runs": runs}
    fields = ("hit_cpu_us_p50", "longest_step_us_p50") if args.mode == "stream" else ("loop_cpu_us_p50",
                                                                                       "longest_step_us_p50")
    for field in fields:
        current = [r[field] for r in runs["current"]]
        other = [r[field] for r in runs[args.against]]
        result[field] = {"current": current, "against": other,
                         "ratio": statistics.median(current) / statistics.median(other)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["gpu", "disk", "loop", "stream"],
                        default="gpu" if torch.cuda.is_available() else "disk")
    parser.add_argument("--pages", type=int, default=64,
                        help="pages per offload/load call (gpu, loop and stream modes)")
    parser.add_argument("--calls", type=int, default=200, help="timed offload calls (loop mode)")
    parser.add_argument("--disk", action="store_true", help="with a disk tier: write-behind queueing (loop mode)")
    parser.add_argument("--against", metavar="REV",
                        help="also measure git revision REV, alternated (loop and stream modes)")
    parser.add_argument("--hits", type=int, default=60, help="timed streaming hits (stream mode)")
    parser.add_argument("--warm-hits", type=int, default=6, help="untimed streaming hits first (stream mode)")
    parser.add_argument("--token-list", action="store_true", help="token ids as a list of ints (stream mode)")
    parser.add_argument("--prompts", type=int, default=6, help="prompts streamed (gpu mode)")
    parser.add_argument("--bridge-samples", type=int, default=300)
    parser.add_argument("--gpu-slots", action="store_true", help="pass slot indices as CUDA tensors (gpu mode)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="KV buffer device (gpu and stream modes; cpu: a small layout)")
    parser.add_argument("--layered", action="store_true", help="stream layer by layer (gpu mode)")
    parser.add_argument("--slots", choices=["random", "blocks", "contiguous"], default="random",
                        help="destination slots (gpu mode): random tokens, shuffled page blocks, or one run "
                             "(contiguous: layer-wise loads go by run copies)")
    parser.add_argument("--load-runs-ab", action="store_true",
                        help="streaming hits alternate loads by run copies and staged (gpu mode; "
                             "--slots contiguous or blocks; layer-wise with --layered, whole loads without; "
                             "--prompts even)")
    parser.add_argument("--claim-tokens", type=int, default=2048,
                        help="tokens per claim while streaming (gpu and stream modes)")
    parser.add_argument("--compute-ms", type=float, default=2.0,
                        help="simulated compute per claim (gpu and stream modes)")
    parser.add_argument("--stream-rounds", type=int, default=3, help="passes over the prompts while streaming")
    parser.add_argument("--page-mib", type=int, default=4, help="page size (disk mode)")
    parser.add_argument("--disk-pages", type=int, default=64, help="pages read per round (disk mode)")
    parser.add_argument("--depth", type=int, default=8, help="disk queue depth (disk mode)")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds (disk, and loop/stream --against)")
    parser.add_argument("--dir", help="directory for page files (disk mode; default a temp dir)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    if args.mode in ("gpu", "stream") and args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--mode {args.mode} needs a CUDA device (or --device cpu)")
    if args.mode == "stream" and args.against:
        result = loop_against(args)
        for field, what in (("hit_cpu_us_p50", "loop CPU per streaming hit"),
                            ("longest_step_us_p50", "longest loop step per hit")):
            r = result[field]
            print(f"{what}, {args.pages} pages{' (token list)' if args.token_list else ''} "
                  "(us, median per fresh process, alternated):")
            print(f"  current:          {', '.join(f'{v:.0f}' for v in r['current'])}")
            print(f"  {args.against + ':':<17} {', '.join(f'{v:.0f}' for v in r['against'])}")
            print(f"  ratio current/{args.against} (medians): {r['ratio']:.2f}")
        print("loop CPU per call (us, median of the per-process medians):")
        for name in STREAM_PHASES:
            cur = statistics.median(r["phase_cpu_us_p50"][name] for r in result["runs"]["current"])
            old = statistics.median(r["phase_cpu_us_p50"][name] for r in result["runs"][args.against])
            print(f"  {name:<11} current {cur:7.0f}  {args.against} {old:7.0f}  ratio {cur / max(old, 1e-9):.2f}")
        if all(r.get("landing_cpu_us_p50") is not None for runs in result["runs"].values() for r in runs):
            cur = statistics.median(r["landing_cpu_us_p50"] for r in result["runs"]["current"])
            old = statistics.median(r["landing_cpu_us_p50"] for r in result["runs"][args.against])
            print(f"loop CPU while the copies land (untimed in the hit; the layers' wake-ups): current {cur:.0f} us, "
                  f"{args.against} {old:.0f} us, ratio {cur / max(old, 1e-9):.2f}")
    elif args.mode == "stream":
        result = asyncio.run(stream_mode(args))
        print(f"{result['layout']}, {result['pages']} pages, {result['hits']} hits"
              f"{', token list' if args.token_list else ''}: loop CPU per hit p10 {result['hit_cpu_us_p10']:.0f} us, "
              f"p50 {result['hit_cpu_us_p50']:.0f} us, p90 {result['hit_cpu_us_p90']:.0f} us; longest loop step "
              f"p50 {result['longest_step_us_p50']:.0f} us, p90 {result['longest_step_us_p90']:.0f} us")
        print("  per call (p50): " + ", ".join(f"{k} {v:.0f} us" for k, v in result["phase_cpu_us_p50"].items()))
        if result["landing_cpu_us_p50"] is not None:
            print(f"  loop CPU while the copies land (untimed above): p50 {result['landing_cpu_us_p50']:.0f} us")
    elif args.mode == "loop" and args.against:
        result = loop_against(args)
        for field, what in (("loop_cpu_us_p50", "loop CPU"), ("longest_step_us_p50", "longest loop step")):
            r = result[field]
            print(f"{what} per {args.pages}-page offload (us, median per fresh process, alternated):")
            print(f"  current:          {', '.join(f'{v:.0f}' for v in r['current'])}")
            print(f"  {args.against + ':':<17} {', '.join(f'{v:.0f}' for v in r['against'])}")
            print(f"  ratio current/{args.against} (medians): {r['ratio']:.2f}")
    elif args.mode == "loop":
        result = asyncio.run(loop_mode(args))
        print(f"loop CPU per {result['pages_per_call']}-page offload{' (disk tier on)' if args.disk else ''}: "
              f"p10 {result['loop_cpu_us_p10']:.0f} us, p50 {result['loop_cpu_us_p50']:.0f} us, "
              f"p90 {result['loop_cpu_us_p90']:.0f} us; longest loop step p50 "
              f"{result['longest_step_us_p50']:.0f} us, p90 {result['longest_step_us_p90']:.0f} us; "
              f"wall p50 {result['wall_us_p50']:.0f} us ({result['calls']} calls)")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
        return 0
    else:
        if args.mode == "gpu" and torch.device(args.device).type == "cuda":
            KVCache.preload(args.device)  # imports and CUDA set-up before the loop runs, as an engine does
        result = asyncio.run(gpu_mode(args) if args.mode == "gpu" else disk_mode(args))
    if args.mode == "gpu":
        print(f"{result['layout']}, {result['pages_per_call']} pages per call")
        print(f"{'direction':<10} {'API GB/s':>9} {'memcpy GB/s':>12} {'ratio':>6}")
        print(f"{'offload':<10} {result['offload_gbps']:>9.2f} {result['memcpy_d2h_gbps']:>12.2f} "
              f"{result['offload_vs_memcpy']:>6.2f}")
        print(f"{'load':<10} {result['load_gbps']:>9.2f} {result['memcpy_h2d_gbps']:>12.2f} "
              f"{result['load_vs_memcpy']:>6.2f}")
        lag = result["loop_lag"]
        print(f"loop lag during offload/load: p50 {lag['p50_ms']:.3f} ms, p99 {lag['p99_ms']:.3f} ms, "
              f"max {lag['max_ms']:.3f} ms")
        st = result["stream"]
        lag = st["loop_lag"]
        print(f"streaming ({st['hits']} hits, {'layer by layer' if result['layered'] else 'whole pages'}, median "
              f"{st['median_s'] * 1e3:.1f} ms, claimed {st['claimed_tokens_median']:.0f} / loaded "
              f"{st['loaded_tokens_median']:.0f} tokens): loop lag p50 {lag['p50_ms']:.3f} ms, p99 "
              f"{lag['p99_ms']:.3f} ms (target 1.2), max {lag['max_ms']:.3f} ms; {st['waiter_threads']} waiter "
              f"threads burned " + ("? (per-thread CPU clocks do not work here)" if st["waiter_cpu_per_s"] is None
                                    else f"{st['waiter_cpu_per_s']:.2f} CPU s/s"))
        print(f"slots {result['slots']}: {st['runs_loaded_pages']} pages copied by run copies while streaming")
        ab = st.get("load_runs_ab")
        if ab is not None:
            print(f"load runs A/B ({ab['hits_each']} hits each): runs {ab['runs_median_s'] * 1e3:.1f} ms, staged "
                  f"{ab['staged_median_s'] * 1e3:.1f} ms, ratio runs/staged {ab['runs_over_staged']:.2f}")
        print(f"loop callbacks over 0.5 ms while streaming: {st['long_steps_over_0.5ms']}; longest:")
        for step in st["long_steps"][:5]:
            print(f"  {step['ms']:7.3f} ms  {step['callback']}")
        for name, b in (("while streaming", st["bridge"]), ("idle", result["bridge_idle"])):
            for kind, summary in (b or {}).items():
                if summary.get("samples"):
                    what = ("thread -> loop wake-up baseline" if kind == "thread_wake"
                            else f"CUDA event -> future {name}, {kind}")
                    print(f"{what}: p50 {summary['p50_us']:.1f} us, p99 "
                          f"{summary['p99_us']:.1f} us (target 200), max {summary['max_us']:.1f} us "
                          f"({summary['samples']} samples)")
    elif args.mode == "disk":
        print(f"{result['layout']}, {result['pages']} pages, depth {result['depth']}")
        print(f"{'round':<6} {'raw tier GB/s':>14} {'API GB/s':>9} {'ratio':>6}")
        for i, r in enumerate(result["rounds"]):
            print(f"{i:<6} {r['raw_gbps']:>14.2f} {r['api_gbps']:>9.2f} {r['ratio']:>6.2f}")
        lag = result["loop_lag"]
        print(f"median ratio {result['median_ratio']:.2f}; loop lag p50 {lag['p50_ms']:.3f} ms, "
              f"p99 {lag['p99_ms']:.3f} ms, max {lag['max_ms']:.3f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
