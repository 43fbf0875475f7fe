"""Tensor parallelism through the manager: rank workers in their own processes, one shared pool.

One scheduler process runs a :class:`aiokv.tp.cache.TPCache`; ``--tp`` rank processes (spawned)
each hold their head slice of an 8B-shaped KV buffer (32 layers, 8 KV heads, head_dim 128, bf16,
256-token pages) on ``--device`` and run a :class:`aiokv.tp.RankWorker`. Measured in one run:

- offload and load of ``--pages`` pages through the manager (every rank copying its slice of each
  page at once), against a pinned ``copy_`` of the same bytes by every rank at once (D2H, H2D),
  started by every rank at one agreed instant and timed from the first start to the last end (and,
  to compare, as measured before: each rank timing its own copy from whenever it got there);
- each rank's loaded bytes against its own source slots (bit-exact, checked in the rank);
- the manager loop's lag (a 1 ms periodic callback) while streaming;
- the path each rank's copies took (pages are rank-major: each rank's part is contiguous, so STAGING
  moves it with one copy-engine memcpy per page).

    python tools/bench_tp.py --device cuda --tp 2 --pages 64 --json out.json
    python tools/bench_tp.py --device cuda --tp 2 --pages 64 --path direct   # the kernel path, to compare
    python tools/bench_tp.py --device cuda --tp 2 --pages 64 --offload-runs both   # run copies vs gathers, ABBA
    python tools/bench_tp.py --device cuda --tp 2 --pages 64 --slots random  # every page gathered
    python tools/bench_tp.py --device cpu --tp 2 --layers 2 --pages 8        # smoke test on a CPU
    TRITON_INTERPRET=1 python tools/bench_tp.py --device cpu --tp 2 --layers 2 --pages 8 --offload-runs both
    python tools/bench_tp.py --device cpu --tp 2 --layers 4 --pages 16 --stalls-ms 10   # where the loop stalls

``--stalls-ms``: a sampling thread reads the manager loop's stack (``sys._current_frames``) whenever
the loop has not run a callback for that long, and the garbage collector's pauses are timed; the
stalls, their stacks and the collections during them are printed (and written with ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import multiprocessing.connection
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cache import LoopLag

from aiokv import CacheConfig, KVLayout
from aiokv.kernels import TransferPath
from aiokv.kernels.paths import interpreting
from aiokv.layout import TPSlice
from aiokv.tp import RankWorker, TPCache, TPConfig


class StallProbe:
    """Where the event loop stalls: a 1 ms heartbeat on the loop, a thread that samples the loop
    thread's stack once the heartbeat is ``threshold_s`` late, and gc pauses timed meanwhile.

    Each stall: its length, the loop thread's stack when first seen late (and the innermost frame at
    each later sample), the other threads' innermost frames then (a GIL holder shows there), the gc
    generations collected during it with their pauses, and from the loop thread's
    ``/proc/self/task/<tid>/schedstat`` how long it ran on a CPU and how long it waited in the run
    queue meanwhile (the machine's other processes, not this one, delayed it).
    """

    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self.stalls: list[dict[str, Any]] = []
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_thread = threading.get_ident()
        self._schedstat = ""
        self._handle: asyncio.TimerHandle | None = None
        self._gc: list[tuple[float, float, int]] = []  # (start, seconds, generation)
        self._gc_start = 0.0

    def _tick(self) -> None:
        self._beat = time.monotonic()
        self._handle = asyncio.get_running_loop().call_later(0.001, self._tick)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.monotonic()
        if phase == "start":
            self._gc_start = now
        else:
            self._gc.append((self._gc_start, now - self._gc_start, info["generation"]))

    def _sample(self) -> None:
        current: dict[str, Any] | None = None
        while not self._stop.wait(0.002):
            beat = self._beat
            late = time.monotonic() - beat
            if late < self.threshold_s:
                if current is not None:
                    self._end(current)
                    current = None
                continue
            frames = sys._current_frames()
            frame = frames.get(self._loop_thread)
            if frame is None:
                continue
            if current is None or current["since"] != beat:
                if current is not None:  # a beat came and went between two samples: a new stall
                    self._end(current)
                others = [_innermost(f) for ident, f in frames.items()
                          if ident not in (self._loop_thread, threading.get_ident())]
                current = {"since": beat, "stack": "".join(traceback.format_stack(frame)), "inner": [],
                           "others": others, "sched0": _schedstat(self._schedstat)}
            where = _innermost(frame)
            if not current["inner"] or current["inner"][-1] != where:
                current["inner"].append(where)

    def _end(self, stall: dict[str, Any]) -> None:
        stall["ms"] = (self._beat - stall["since"]) * 1e3
        run0, wait0 = stall.pop("sched0")
        run1, wait1 = _schedstat(self._schedstat)
        stall["on_cpu_ms"], stall["run_queue_ms"] = (run1 - run0) / 1e6, (wait1 - wait0) / 1e6
        self.stalls.append(stall)

    def __enter__(self) -> StallProbe:
        self._loop_thread = threading.get_ident()
        self._schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._tick()
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._sample, name="stall-probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        gc.callbacks.remove(self._on_gc)
        if self._handle is not None:
            self._handle.cancel()
        for stall in self.stalls:
            begin, end = stall["since"], stall["since"] + stall["ms"] / 1e3
            stall["gc"] = [{"generation": g, "ms": round(d * 1e3, 3)} for t, d, g in self._gc if begin <= t <= end]
            del stall["since"]

    def summary(self) -> list[dict[str, Any]]:
        """The stalls, longest first."""
        return sorted(self.stalls, key=lambda s: -s["ms"])


def _innermost(frame: Any) -> str:
    inner = traceback.extract_stack(frame, limit=1)[-1]
    return f"{inner.filename}:{inner.lineno} {inner.name}"


def _schedstat(path: str) -> tuple[int, int]:
    """Nanoseconds a thread ran on a CPU and waited in the run queue (0, 0 where not readable)."""
    try:
        with open(path) as f:
            run, wait, _ = f.read().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return 0, 0


def _layout(args: argparse.Namespace) -> KVLayout:
    return KVLayout.mha(args.layers, args.heads, args.head_dim, torch.bfloat16, page_tokens=args.page_tokens)


def rank_main(conn: multiprocessing.connection.Connection, address: str, rank: int, args: argparse.Namespace) -> None:
    """A rank process: its KV slice on the device, a worker, and commands from the scheduler."""
    asyncio.run(_rank(conn, address, rank, args))


async def _rank(conn: multiprocessing.connection.Connection, address: str, rank: int, args: argparse.Namespace) -> None:
    layout = _layout(args)
    device = torch.device(args.device)
    tp = TPSlice.of(layout, rank, args.tp)
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    kv = torch.randn(layout.num_layers, 2 * args.pages * layout.page_tokens, 2 * tp.local_heads, layout.head_dim,
                     generator=gen, device=device).to(layout.dtype)
    slice_bytes = args.pages * layout.payload_bytes * tp.local_heads // layout.num_kv_heads
    # On a CPU, STAGING runs only through Triton's interpreter (TRITON_INTERPRET=1: a smoke test of the path).
    path = TransferPath(args.path) if device.type == "cuda" or interpreting() else TransferPath.REFERENCE
    memcpy = _Memcpy(slice_bytes, device)
    runs: bool | None = _modes(args)[0]
    specs = 0
    while runs is not None:
        # One worker per mode: `--offload-runs both` switches the ranks' TPConfig between reps.
        config = TPConfig(offload_runs=runs)
        async with RankWorker(address, rank, args.tp, layout, kv, config=config, path=path) as worker:
            await worker.wait_attached()
            await _wait_registered(worker)
            await worker.wait_warm()
            used = worker.statistics().transfer_path
            conn.send(("ready", slice_bytes, used.value if used is not None else "none"))
            runs = await _serve(conn, worker, kv, memcpy, device)
            specs += worker.statistics().specs
    conn.send(specs)


async def _wait_registered(worker: RankWorker) -> None:
    """Until the worker's pool mapping is registered with CUDA (a spec before waits for its chunks:
    the first offload after a switch would time the registration)."""
    while True:
        ready, total = worker.statistics().registered_chunks
        if ready == total:
            return
        await asyncio.sleep(0.01)


async def _serve(conn: multiprocessing.connection.Connection, worker: RankWorker, kv: torch.Tensor,
                 memcpy: _Memcpy, device: torch.device) -> bool | None:
    """Commands until a mode switch (returns the new mode) or the stop (None)."""
    while True:
        command, *rest = await asyncio.to_thread(conn.recv)
        if command == "check":
            src, dst = rest
            conn.send(bool(torch.equal(kv[:, dst.to(device)], kv[:, src.to(device)])))
        elif command == "zero":
            kv[:, rest[0].to(device)] = 0
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            conn.send(True)
        elif command == "runs":
            conn.send(worker.statistics().runs_offloaded)
        elif command == "memcpy":
            conn.send(memcpy.timed(*rest))
        elif command == "memcpy_before":
            conn.send(_memcpy_before(memcpy.host.numel(), device, rest[0]))
        elif command == "mode":
            return bool(rest[0])
        else:
            return None


class _Memcpy:
    """The baseline: a pinned ``copy_`` of this rank's bytes, buffers allocated once.

    :meth:`timed` starts at an agreed ``CLOCK_MONOTONIC`` instant (the same clock in every process),
    so the ranks' copies overlap as the offload's do, and returns its ``(start, end)``: the manager
    takes the span from the first start to the last end. Timed each from its own start (as before),
    a rank whose copy began late ran partly alone, and the sum of bytes over the longest single
    time overstated what the link moves for all ranks at once.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.pin = device.type == "cuda"
        self.device = device
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for direction in ("d2h", "h2d"):
            self._copy(direction)  # warm
        self._sync()

    def _copy(self, direction: str) -> None:
        dst, src = (self.host, self.dev) if direction == "d2h" else (self.dev, self.host)
        dst.copy_(src, non_blocking=self.pin)

    def _sync(self) -> None:
        if self.pin:
            torch.cuda.synchronize(self.device)

    def timed(self, direction: str, start_at: float) -> tuple[float, float]:
        while (left := start_at - time.monotonic()) > 0.002:
            time.sleep(left - 0.002)
        while time.monotonic() < start_at:
            pass
        start = time.monotonic()
        self._copy(direction)
        self._sync()
        return start, time.monotonic()


def _memcpy_before(nbytes: int, device: torch.device, direction: str) -> float:
    """The baseline as this tool measured it until session 24 (kept to compare): fresh buffers, a
    warm copy, then seconds for one pinned copy, each rank timing its own, starting when it gets there."""
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst, src = (host, dev) if direction == "d2h" else (dev, host)
    dst.copy_(src, non_blocking=pin)  # warm
    if pin:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    dst.copy_(src, non_blocking=pin)
    if pin:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


async def _ask_all(conns: list[multiprocessing.connection.Connection], *command: Any) -> list[Any]:
    for conn in conns:
        conn.send(command)
    return [await asyncio.to_thread(conn.recv) for conn in conns]


def _modes(args: argparse.Namespace) -> list[bool]:
    return {"on": [True], "off": [False], "both": [False, True]}[args.offload_runs]


def _slots(args: argparse.Namespace, n: int, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source slots in ``[0, n)`` and load targets in ``[n, 2n)``: in order (``runs``: every page's
    slots one ascending run) or a random permutation (every page gathered)."""
    if args.slots == "runs":
        return torch.arange(n), torch.arange(n, 2 * n)
    gen = torch.Generator().manual_seed(rep)
    return torch.randperm(n, generator=gen), n + torch.randperm(n, generator=gen)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = _layout(args)
    t = layout.page_tokens
    n = args.pages * t
    modes = _modes(args)
    ctx = multiprocessing.get_context("spawn")
    config = CacheConfig(cpu_bytes=(args.pages + 2) * layout.page_bytes, disk_dir=None, namespace="bench-tp",
                         launch_pages=args.launch_pages)
    results: dict[str, Any] = {"tp": args.tp, "pages": args.pages, "page_bytes": layout.page_bytes,
                               "device": args.device, "slots": args.slots, "launch_pages": args.launch_pages}
    names = [_mode_name(m) for m in modes]
    rows: dict[str, list[float]] = {f"memcpy_{d}{when}": [] for d in ("d2h", "h2d") for when in ("", "_before")}
    for name in names:
        rows[f"offload_{name}"], rows[f"load_{name}"] = [], []
    runs_pages: dict[str, int] = dict.fromkeys(names, 0)
    small: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as sock_dir:
        async with TPCache(config, layout, tp_size=args.tp, num_slots=2 * n,
                           directory=Path(sock_dir) / "tp") as cache:
            await cache.pool.wait_ready()
            conns, procs = [], []
            for rank in range(args.tp):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=rank_main, args=(child, cache.address, rank, args), daemon=True)
                proc.start()
                conns.append(parent)
                procs.append(proc)
            try:
                ready = [await asyncio.to_thread(c.recv) for c in conns]
                await cache.wait_ranks()
                total = sum(nbytes for _, nbytes, _ in ready)
                results["transfer_paths"] = [path for _, _, path in ready]
                exact = True
                current = modes[0]
                probe = StallProbe(args.stalls_ms / 1e3) if args.stalls_ms else None
                with LoopLag() as lag, probe or contextlib.nullcontext():
                    # LoopLag's task takes its first step only when the loop next runs: without this
                    # turn a stall at the very start (the first offload's) went unmeasured.
                    await asyncio.sleep(0)
                    for rep in range(args.reps):
                        # ABBA: each rep runs the modes in the other order, one switch per rep.
                        for mode in modes if rep % 2 == 0 else modes[::-1]:
                            if mode != current:
                                for conn in conns:
                                    conn.send(("mode", mode))
                                [await asyncio.to_thread(c.recv) for c in conns]
                                await cache.wait_ranks()
                                current = mode
                            name = _mode_name(mode)
                            src, dst = _slots(args, n, rep)
                            tokens = list(range(rep * 10**6, rep * 10**6 + n))
                            start = time.perf_counter()
                            result = await cache.offload(tokens, src)
                            rows[f"offload_{name}"].append(time.perf_counter() - start)
                            assert result.stored == args.pages, result
                            await _ask_all(conns, "zero", dst)
                            match = await cache.match(tokens)
                            start = time.perf_counter()
                            loaded = await cache.load(match, dst)
                            rows[f"load_{name}"].append(time.perf_counter() - start)
                            assert loaded.tokens == n, loaded
                            exact &= all(await _ask_all(conns, "check", src, dst))
                            cache.pool.table.evict(cache.pool.num_pages)
                            for k in range(args.small_calls):  # one page each: the call's fixed cost shows
                                first = 10**9 + (rep * args.small_calls + k) * t
                                start = time.perf_counter()
                                one = await cache.offload(list(range(first, first + t)), src[:t])
                                small[name].append(time.perf_counter() - start)
                                assert one.stored == 1, one
                            runs_pages[name] = max(runs_pages[name], min(await _ask_all(conns, "runs")))
                            cache.pool.table.evict(cache.pool.num_pages)
                        for direction in ("d2h", "h2d"):
                            spans = await _ask_all(conns, "memcpy", direction, time.monotonic() + 0.05)
                            rows[f"memcpy_{direction}"].append(max(e for _, e in spans) - min(s for s, _ in spans))
                            before = await _ask_all(conns, "memcpy_before", direction)
                            rows[f"memcpy_{direction}_before"].append(max(before))
            finally:
                for conn in conns:
                    conn.send(("stop",))
                specs = [await asyncio.to_thread(c.recv) for c in conns]
                for proc in procs:
                    await asyncio.to_thread(proc.join, 60)
    med = {k: statistics.median(v) for k, v in rows.items()}
    results.update(
        bytes=total,
        bit_exact=exact,
        gbps={k: total / v / 1e9 for k, v in med.items()},
        modes={name: {
            "offload_runs": name == "runs",
            "offload_vs_memcpy": med["memcpy_d2h"] / med[f"offload_{name}"],
            "load_vs_memcpy": med["memcpy_h2d"] / med[f"load_{name}"],
            "offload_vs_memcpy_before": med["memcpy_d2h_before"] / med[f"offload_{name}"],
            "load_vs_memcpy_before": med["memcpy_h2d_before"] / med[f"load_{name}"],
            "pages_by_runs_per_rank": runs_pages[name],
            "one_page_offload_ms": statistics.median(small[name]) * 1e3 if small[name] else None,
            "one_page_at_memcpy_ms": med["memcpy_d2h"] / args.pages * 1e3,
        } for name in names},
        loop_lag=lag.summary(),
        specs_per_rank=specs,
        stalls=probe.summary() if probe is not None else None,
    )
    last = results["modes"][names[-1]]  # the mode asked for (``both``: the new path, runs)
    results["offload_vs_memcpy"], results["load_vs_memcpy"] = last["offload_vs_memcpy"], last["load_vs_memcpy"]
    return results


def _mode_name(runs: bool) -> str:
    return "runs" if runs else "gather"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda[:N] (every rank shares it) or cpu")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-tokens", type=int, default=256)
    p.add_argument("--launch-pages", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--path", choices=[TransferPath.STAGING.value, TransferPath.DIRECT.value],
                   default=TransferPath.STAGING.value,
                   help="the ranks' copy path on CUDA (rank-major pages make STAGING possible; DIRECT for comparison)")
    p.add_argument("--offload-runs", choices=["on", "off", "both"], default="on",
                   help="TPConfig.offload_runs of the ranks (STAGING: a page whose slots are one run is one 2-D "
                        "copy-engine memcpy, no gather kernel); both: alternated rep by rep (ABBA) in this run")
    p.add_argument("--slots", choices=["runs", "random"], default="runs",
                   help="runs: every page's slots in order (what run copies take); random: a permutation (gathers)")
    p.add_argument("--stalls-ms", type=float, default=0.0,
                   help="sample the manager loop's stack whenever it stalls this long (0: off)")
    p.add_argument("--small-calls", type=int, default=5,
                   help="one-page offloads per rep and mode, timed apart: the per-call fixed cost")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    out = asyncio.run(run(args))
    g = out["gbps"]
    print(f"tp={out['tp']} {out['pages']} pages x {out['page_bytes'] >> 20} MiB on {out['device']}, "
          f"slots {out['slots']}, launch_pages {out['launch_pages']}; bit-exact on every rank: {out['bit_exact']}; "
          f"ranks' copy paths: {', '.join(out['transfer_paths'])}")
    print(f"pinned memcpy of the same bytes, every rank at once from one instant (span first start -> last end): "
          f"D2H {g['memcpy_d2h']:.1f} GB/s, H2D {g['memcpy_h2d']:.1f} GB/s; as measured before session 24 (each rank "
          f"timing its own copy): D2H {g['memcpy_d2h_before']:.1f}, H2D {g['memcpy_h2d_before']:.1f} GB/s")
    for name, mode in out["modes"].items():
        print(f"[{name:6}] offload {g['offload_' + name]:.1f} GB/s: {mode['offload_vs_memcpy']:.2f}x memcpy "
              f"({mode['offload_vs_memcpy_before']:.2f}x the baseline as before); "
              f"load {g['load_' + name]:.1f} GB/s: {mode['load_vs_memcpy']:.2f}x "
              f"({mode['load_vs_memcpy_before']:.2f}x); pages by run copies per rank: {mode['pages_by_runs_per_rank']}")
        if mode["one_page_offload_ms"] is not None:
            print(f"         a one-page offload (the call's fixed cost shows): {mode['one_page_offload_ms']:.3f} ms, "
                  f"its bytes at the memcpy rate {mode['one_page_at_memcpy_ms']:.3f} ms")
    lag = out["loop_lag"]
    print(f"manager loop lag while streaming: p50 {lag['p50_ms']:.3f} ms, p99 {lag['p99_ms']:.3f} ms, "
          f"max {lag['max_ms']:.3f} ms")
    for stall in (out["stalls"] or [])[:5]:
        print(f"\nstall {stall['ms']:.1f} ms: loop thread on a CPU {stall['on_cpu_ms']:.1f} ms, in the run queue "
              f"{stall['run_queue_ms']:.1f} ms; gc during it: {stall['gc'] or 'none'}\n"
              f"  loop thread's innermost frames sampled: {' -> '.join(stall['inner'])}\n"
              f"  other threads then: {'; '.join(stall['others']) or 'none'}\n{stall['stack']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    if not out["bit_exact"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
