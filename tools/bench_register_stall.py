"""Does the disk tier's background io_uring registration slow other threads of the process?

A probe thread does what a launch-bound engine thread does on the host, timing each part of every
iteration: ``py`` (a few thousand small Python objects: pymalloc arenas are mmapped), ``torch``
(small CPU tensor ops: allocator calls), ``mmap`` (map, touch and unmap 1 MiB) and ``bytearray``
(``bytearray(300_000)`` churn: glibc mmap/brk). Conditions, alternated round by round, each over the
same pool (created and prepared once, outside the measurement):

- ``idle``: the probe alone;
- ``uring``: a ``DiskTier`` started with backend URING (the same start-up work, no registration);
- ``register``: a ``DiskTier`` started with backend AUTO, whose pool registration (fixed buffers)
  runs in the background; the probe runs until ``wait_registered`` returns;
- ``register-single``: the same, one region per ``io_uring_register`` update call (as before the
  updates were batched: each call's return waits for the GIL);
- ``register-old``: the same, as registered before 8 MiB regions (64 MiB regions, each faulted in
  again whether mapped or not, one per call);
- ``chunks``: a fresh pool of the same size prepared as on CUDA (each chunk faulted in; the
  ``cudaHostRegister`` call itself cannot run here and is skipped).

``--populate`` faults the tier's pool in first; ``--cuda-pool`` prepares it as on CUDA (each chunk
faulted in, ``cudaHostRegister`` skipped), as the H200 demo's pool is: the registration then only
pins. ``--c`` swaps the Python probe for a C loop in a thread (no GIL: what the mmap lock and the
pins alone do): per iteration one 1 MiB mmap + touch + munmap (``c_mmap``) and a fixed CPU-only
loop (``c_cpu``: preemption alone); ``c_mmap@pin`` / ``@populate``: the iterations that overlapped
a pin / a populate call. ``--gil`` swaps it for pure Python (~0.5 ms of bytecode per iteration,
holding the GIL: what other threads' GIL acquisitions cost it). Per condition: per-iteration
p50/p99/p99.9/max of each part (us), the probe's iterations per second, its voluntary (blocked)
and involuntary (preempted) context switches per iteration, and its time above idle's median in
all; each ``io_uring_register`` update call's duration and region count over all registering
conditions.

    python tools/bench_register_stall.py --pool-gib 6 --rounds 4 --populate
    python tools/bench_register_stall.py --c --pool-gib 4 --rounds 4 --cuda-pool --conditions idle register register-old
    python tools/bench_register_stall.py --gil --pool-gib 4 --cuda-pool --conditions idle register register-old
    python tools/bench_register_stall.py --gil --pool-gib 4 --rounds 3 --cuda-pool \
        --conditions idle register register-single
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import mmap
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from aiokv import shm
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskConfig, DiskTier, backends, memory
from aiokv.storage import uring as uring_mod
from aiokv.storage.backends import UringPageIO

C_PROBE = r"""
#define _GNU_SOURCE
#include <sys/mman.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
/* Until *stop: per iteration, the seconds of one 1 MiB mmap + touch + munmap (the mmap lock taken
   for write twice) and of a fixed CPU-only loop (preemption alone). Returns iterations recorded. */
long probe(volatile int *stop, double *map_s, double *cpu_s, double *at_s, long cap, long *switches) {
    struct rusage r0, r1; getrusage(RUSAGE_THREAD, &r0);
    long n = 0; volatile unsigned long x = 0;
    while (!*stop && n < cap) {
        double t0 = now();
        char *p = mmap(0, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        p[0] = 1; p[4096] = 1;
        munmap(p, 1 << 20);
        double t1 = now();
        for (int i = 0; i < 20000; i++) x += i;
        double t2 = now();
        map_s[n] = t1 - t0; cpu_s[n] = t2 - t1; at_s[n] = t0; n++;
    }
    getrusage(RUSAGE_THREAD, &r1);
    switches[0] = r1.ru_nvcsw - r0.ru_nvcsw; switches[1] = r1.ru_nivcsw - r0.ru_nivcsw;
    return n;
}
"""


class CProbe:
    """The mmap-lock probe without the GIL: a C loop in a thread (ctypes releases the GIL)."""

    CAP = 2_000_000

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._stop = ctypes.c_int(0)
        self._map = (ctypes.c_double * self.CAP)()
        self._cpu = (ctypes.c_double * self.CAP)()
        self._at = (ctypes.c_double * self.CAP)()
        self.starts: list[float] = []
        self._switches = (ctypes.c_long * 2)()
        self._n = 0
        self._thread = threading.Thread(target=self._run, name="cprobe", daemon=True)
        self.samples: dict[str, list[float]] = {}
        self.voluntary = self.involuntary = 0
        self.wall = 0.0

    def _run(self) -> None:
        self._n = self._lib.probe(ctypes.byref(self._stop), self._map, self._cpu, self._at, self.CAP,
                                  self._switches)

    def start(self) -> None:
        self._t = time.perf_counter()
        self._thread.start()

    def stop(self) -> None:
        self._stop.value = 1
        self._thread.join()
        self.wall = time.perf_counter() - self._t
        n = self._n
        self.samples = {"c_mmap": list(self._map[:n]), "c_cpu": list(self._cpu[:n]), "total": list(self._map[:n])}
        self.starts = list(self._at[:n])
        self.voluntary, self.involuntary = self._switches[0], self._switches[1]


def load_c_probe(directory: str) -> ctypes.CDLL:
    src = Path(directory) / "probe.c"
    so = Path(directory) / "probe.so"
    src.write_text(C_PROBE)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.probe.restype = ctypes.c_long
    lib.probe.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long, ctypes.c_void_p]
    return lib


PARTS = ("py", "torch", "mmap", "bytearray", "total", "offcpu")
C_PARTS = ("c_mmap", "c_cpu", "c_mmap@pin", "c_mmap@populate")
make_probe: Callable[[], Any] = lambda: Probe()  # noqa: E731 (--c swaps in the C probe)


class Probe:
    """The engine-like thread: runs iterations until stopped, each part timed (seconds)."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {p: [] for p in PARTS}
        self.started = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)
        self.wall = 0.0
        self.voluntary = self.involuntary = 0

    def start(self) -> None:
        self._thread.start()
        self.started.wait()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        small = [torch.ones(256) for _ in range(4)]
        clock, cpu = time.perf_counter, time.thread_time
        switches = _switches()
        begin = clock()
        self.started.set()
        s = self.samples
        while not self._stop.is_set():
            c0 = cpu()
            t0 = clock()
            junk = [(i, str(i), {"k": i}) for i in range(3000)]
            del junk
            t1 = clock()
            acc = small[0]
            for _ in range(20):
                acc = torch.add(acc, small[1]).mul_(0.5)
                acc = acc + torch.empty(256).fill_(1.0)
            t2 = clock()
            m = mmap.mmap(-1, 1 << 20)
            m[0] = 1
            m.close()
            t3 = clock()
            for _ in range(4):
                b = bytearray(300_000)
                b[-1] = 1
                del b
            t4 = clock()
            c4 = cpu()
            s["py"].append(t1 - t0)
            s["torch"].append(t2 - t1)
            s["mmap"].append(t3 - t2)
            s["bytearray"].append(t4 - t3)
            s["total"].append(t4 - t0)
            s["offcpu"].append(max(0.0, (t4 - t0) - (c4 - c0)))  # waiting: preempted or blocked
        self.wall = clock() - begin
        after = _switches()
        self.voluntary = after[0] - switches[0]
        self.involuntary = after[1] - switches[1]


class GilProbe(Probe):
    """A launch-bound engine thread at its purest: Python only, holding the GIL (``gil``: ~0.5 ms of
    bytecode per iteration). Another thread's every GIL acquisition forces it to drop the GIL."""

    def _run(self) -> None:
        clock, cpu = time.perf_counter, time.thread_time
        switches = _switches()
        begin = clock()
        self.started.set()
        s = self.samples = {"gil": [], "offcpu": [], "total": []}
        while not self._stop.is_set():
            c0, t0 = cpu(), clock()
            x = 0
            for i in range(10_000):
                x += i
            t1, c1 = clock(), cpu()
            s["gil"].append(t1 - t0)
            s["total"].append(t1 - t0)
            s["offcpu"].append(max(0.0, (t1 - t0) - (c1 - c0)))
        self.wall = clock() - begin
        after = _switches()
        self.voluntary = after[0] - switches[0]
        self.involuntary = after[1] - switches[1]


def _switches() -> tuple[int, int]:
    """This thread's (voluntary, involuntary) context switches so far (Linux)."""
    with open("/proc/thread-self/status") as f:
        fields = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
    return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)

    def at(q: float) -> float:
        return v[min(len(v) - 1, int(q * len(v)))]

    return {"n": len(v), "p50": at(0.5) * 1e6, "p90": at(0.9) * 1e6, "p99": at(0.99) * 1e6,
            "p999": at(0.999) * 1e6, "max": v[-1] * 1e6, "mean": statistics.fmean(v) * 1e6, "sum": sum(v) * 1e6}


def _overlapping(starts: list[float], values: list[float], spans: list[tuple[float, float]]) -> list[float]:
    """The ``values`` of iterations (``starts[i]``, ``+values[i]``) that overlap a (start, duration) span."""
    spans = sorted(spans)
    ends = [a + d for a, d in spans]
    out: list[float] = []
    j = 0
    for t, v in sorted(zip(starts, values, strict=True)):
        while j < len(spans) and ends[j] < t:
            j += 1
        if j < len(spans) and spans[j][0] <= t + v:
            out.append(v)
    return out


_batch_sizes: list[int] = []
"""Regions per timed ``update_buffers`` call."""


def _timed_calls(durations: list[tuple[float, float]], populates: list[tuple[float, float]]) -> Callable[[], None]:
    """Record each ``update_buffers`` call's (start, duration) and each background ``populate``
    call's; returns the undo."""
    original = uring_mod.UringEngine.update_buffers
    original_populate = backends.populate

    def timed_populate(address: int, length: int) -> None:
        t = time.perf_counter()
        try:
            original_populate(address, length)
        finally:
            populates.append((t, time.perf_counter() - t))

    backends.populate = timed_populate

    def timed(self: uring_mod.UringEngine, regions: Sequence[uring_mod.Region]) -> int:
        t = time.perf_counter()
        try:
            done: int = original(self, regions)
            return done
        finally:
            durations.append((t, time.perf_counter() - t))
            _batch_sizes.append(len(regions))

    setattr(uring_mod.UringEngine, "update_buffers", timed)  # noqa: B010

    def undo() -> None:
        setattr(uring_mod.UringEngine, "update_buffers", original)  # noqa: B010
        backends.populate = original_populate

    return undo


async def _with_tier(pool: PagePool, layout: KVLayout, backend: DiskBackend, directory: Path,
                     window: float) -> tuple[Any, float]:
    cfg = DiskConfig(directory=directory, capacity_bytes=1 << 30, backend=backend)
    probe = make_probe()
    probe.start()
    t = time.perf_counter()
    tier = DiskTier(cfg, layout, pool)
    await tier.start()
    io = tier.backend
    if isinstance(io, UringPageIO):
        await io.wait_registered()
    busy = time.perf_counter() - t
    rest = window - busy
    if rest > 0:
        await asyncio.sleep(rest)
    probe.stop()
    await tier.aclose()
    return probe, busy


async def _idle(window: float) -> Any:
    probe = make_probe()
    probe.start()
    await asyncio.sleep(window)
    probe.stop()
    return probe


async def _chunks(layout: KVLayout, size: int) -> tuple[Any, float]:
    # The CUDA preparation path, less the CUDA call: posix_fallocate, populate, (cudaHostRegister).
    original = shm._cuda_host_register
    shm._cuda_host_register = lambda address, length: None
    probe = make_probe()
    try:
        probe.start()
        t = time.perf_counter()
        pool = PagePool.create(layout, size, register_cuda=True)
        await pool.wait_ready()
        busy = time.perf_counter() - t
        probe.stop()
    finally:
        shm._cuda_host_register = original
    await pool.aclose()
    return probe, busy


async def _cuda_like_pool(layout: KVLayout, size: int) -> PagePool:
    """A pool prepared as on CUDA (each chunk faulted in, then registered: skipped here), usable."""
    original = shm._cuda_host_register
    shm._cuda_host_register = lambda address, length: None
    try:
        pool = PagePool.create(layout, size, register_cuda=True)
        await pool.wait_ready()
    finally:
        shm._cuda_host_register = original
    return pool


def _populate(pool: PagePool) -> None:
    shm.populate(pool.memory.segment.address, pool.num_pages * pool.layout.page_bytes)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    layout = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=args.page_tokens)
    size = int(args.pool_gib * (1 << 30)) // layout.page_bytes * layout.page_bytes
    results: dict[str, dict[str, list[float]]] = {}
    busy: dict[str, list[float]] = {}
    updates: list[tuple[float, float]] = []
    all_updates: list[tuple[float, float]] = []
    populates: list[tuple[float, float]] = []
    undo = _timed_calls(updates, populates)
    conditions = args.conditions
    global make_probe
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            if args.c:
                lib = load_c_probe(tmp)
                make_probe = lambda: CProbe(lib)  # noqa: E731
            elif args.gil:
                make_probe = GilProbe
            for r in range(args.rounds):
                order = conditions[r % len(conditions):] + conditions[: r % len(conditions)]
                for cond in order:
                    if cond == "chunks":
                        probe, took = await _chunks(layout, size)
                    elif cond == "idle":
                        probe, took = await _idle(args.window or 0.5), 0.0
                    else:
                        # A fresh pool per round: a pool registered once stays pinned until the ring
                        # closes, but the next registration pins it again from the start.
                        if args.cuda_pool:
                            pool = await _cuda_like_pool(layout, size)
                        else:
                            pool = PagePool.create(layout, size, register_cuda=False)
                            await pool.wait_ready()
                        if args.populate:
                            await asyncio.to_thread(_populate, pool)
                        backend = DiskBackend.URING if cond == "uring" else DiskBackend.AUTO
                        old = backends.BACKGROUND_REGION_BYTES, backends._faulted_in
                        per_update = memory.REGIONS_PER_UPDATE
                        if cond in ("register-single", "register-old"):
                            memory.REGIONS_PER_UPDATE = 1
                        if cond == "register-old":
                            # The registration before 629b28d: 64 MiB regions, each populated
                            # (read once, at the registration's start).
                            backends.BACKGROUND_REGION_BYTES = 64 << 20
                            backends._faulted_in = lambda fd, address, length: False
                            pool.register_cuda = False
                        try:
                            probe, took = await _with_tier(pool, layout, backend, Path(tmp) / f"{cond}-{r}",
                                                           args.window)
                        finally:
                            backends.BACKGROUND_REGION_BYTES, backends._faulted_in = old
                            memory.REGIONS_PER_UPDATE = per_update
                        await pool.aclose()
                    for part, values in probe.samples.items():
                        results.setdefault(cond, {}).setdefault(part, []).extend(values)
                    if args.c:  # the iterations that overlapped a pin, or a populate, of this round
                        mapped = probe.samples["c_mmap"]
                        results[cond].setdefault("c_mmap@pin", []).extend(
                            _overlapping(probe.starts, mapped, updates))
                        results[cond].setdefault("c_mmap@populate", []).extend(
                            _overlapping(probe.starts, mapped, populates))
                    all_updates.extend(updates)
                    updates.clear()
                    populates.clear()
                    busy.setdefault(cond, []).append(took)
                    n = len(probe.samples["total"])
                    results[cond].setdefault("rate", []).append(n / probe.wall)
                    results[cond].setdefault("vol", []).append(probe.voluntary / n)
                    results[cond].setdefault("invol", []).append(probe.involuntary / n)
                    print(f"round {r} {cond:9s} busy {took * 1e3:7.1f} ms, {len(probe.samples['total'])} "
                          f"iterations, p50 {_quantiles(probe.samples['total'])['p50']:.0f} us, "
                          f"p99 {_quantiles(probe.samples['total'])['p99']:.0f} us", flush=True)
    finally:
        undo()
    out: dict[str, Any] = {"pool_bytes": size, "page_bytes": layout.page_bytes, "populate": args.populate,
                           "cuda_pool": args.cuda_pool,
                           "window_s": args.window, "conditions": {}}
    for cond, parts in results.items():
        out["conditions"][cond] = {p: _quantiles(v) for p, v in parts.items() if p not in ("rate", "vol", "invol")}
        out["conditions"][cond]["iterations_per_s"] = statistics.fmean(parts["rate"])
        out["conditions"][cond]["voluntary_per_it"] = statistics.fmean(parts["vol"])
        out["conditions"][cond]["involuntary_per_it"] = statistics.fmean(parts["invol"])
        out["conditions"][cond]["busy_ms"] = [round(b * 1e3, 1) for b in busy[cond]]
    if all_updates:
        out["update_buffer_ms"] = _quantiles([d for _, d in all_updates])
        out["update_buffer_ms"] = {k: (v / 1e3 if k != "n" else v) for k, v in out["update_buffer_ms"].items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-gib", type=float, default=4.0)
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=0.0,
                        help="seconds each condition is probed at least (0: only while it is busy)")
    parser.add_argument("--populate", action="store_true", help="fault the tier's pool in first")
    parser.add_argument("--cuda-pool", action="store_true",
                        help="prepare the tier's pool as on CUDA (chunks faulted in; the CUDA call skipped)")
    parser.add_argument("--conditions", nargs="+", default=["idle", "uring", "register", "register-old", "chunks"],
                        choices=["idle", "uring", "register", "register-single", "register-old", "chunks"])
    parser.add_argument("--dir", default=None, help="where the disk tiers' directories go")
    parser.add_argument("--c", action="store_true", help="the C probe (mmap lock and CPU, no GIL; needs cc)")
    parser.add_argument("--gil", action="store_true", help="a pure-Python probe (the GIL alone)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = asyncio.run(main_async(args))
    print(f"pool {out['pool_bytes'] / 2**30:.2f} GiB, page {out['page_bytes']} B, populate={out['populate']}, "
          f"cuda_pool={out['cuda_pool']}")
    parts = C_PARTS if args.c else ("gil", "offcpu") if args.gil else PARTS
    header = "condition  it/s  vol/it inv/it " + "  ".join(f"{p + ' n: p50/p99/p999/max us':>31s}" for p in parts)
    print(header)
    for cond, row in out["conditions"].items():
        cells = [f"{row[p]['n']:6d}: {row[p]['p50']:4.0f}/{row[p]['p99']:5.0f}/{row[p]['p999']:5.0f}/"
                 f"{row[p]['max']:5.0f}" if row.get(p) else "-" for p in parts]
        print(f"{cond:9s} {row['iterations_per_s']:6.0f} {row['voluntary_per_it']:6.2f} "
              f"{row['involuntary_per_it']:6.2f} " + "  ".join(f"{c:>31s}" for c in cells))
    idle = out["conditions"].get("idle")
    first = parts[0]
    if idle and idle.get(first):
        for cond, row in out["conditions"].items():
            if cond == "idle" or not row.get(first):
                continue
            excess = row[first]["sum"] - row[first]["n"] * idle[first]["p50"]
            print(f"{cond:9s} {first}: {excess / 1e3:8.1f} ms above idle's median in all "
                  f"(busy {sum(row['busy_ms']):.0f} ms in all)")
    if "update_buffer_ms" in out:
        u = out["update_buffer_ms"]
        per_call = statistics.fmean(_batch_sizes or [0])
        print(f"io_uring update call ({per_call:.1f} regions on average): n={u['n']} p50 {u['p50']:.2f} ms "
              f"p99 {u['p99']:.2f} ms max {u['max']:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
