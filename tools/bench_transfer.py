"""GPU <-> pool page transfers per path, against a plain pinned memcpy of the same bytes (same run).

For an 8B-class layout (32 layers, 8 KV heads, head_dim 128, bf16) and an MLA layout (61 layers,
576 latent, bf16), 256-token pages of random slots, 1/8/64 pages per call:

- offload (GPU -> pool), load (pool -> GPU) and a layer-by-layer load (``layers``) for each path,
  GB/s and the ratio to memcpy;
- offload and load at the same time (ratio to one direction alone);
- interference: a bf16 matmul loop's throughput alone and with offloads + loads running beside it.

Each figure is the median of per-call CUDA-event times (host launch cost included: a call's start
event is recorded before the host issues it). GB/s = 1e9 payload bytes per second.

    python tools/bench_transfer.py                  # H200: full table
    python tools/bench_transfer.py --json out.json  # also write every figure as JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from aiokv.kernels import PageMover, TransferPath
from aiokv.layout import KVBuffer, KVLayout
from aiokv.pool import PagePool

LAYOUTS = {
    "mha-8b": KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=256),
    "mla-61x576": KVLayout.mla(61, 576, torch.bfloat16, page_tokens=256),
}


Op = Literal["offload", "load", "layers"]
"""``layers``: a load layer by layer (``PageMover.load_layers``), timed to its last layer's event."""


@dataclass
class Row:
    layout: str
    op: str
    path: str
    pages: int
    gbps: float
    memcpy_gbps: float
    ratio: float
    call_gbps: float
    call_memcpy_gbps: float
    call_ratio: float


def _timed(call: Callable[[], torch.cuda.Event | None], reps: int, warmup: int = 2) -> tuple[float, float]:
    """Seconds per call of ``call``: (median of single calls from an idle GPU, back-to-back mean).

    A single call's start event is recorded before the host issues it, so host launch cost counts.
    Back-to-back: ``reps`` calls issued without waiting on the host, each ordered after the last on
    the GPU (the current stream waits for every call's event) -- the steady state of a busy cache.
    """
    stream = torch.cuda.current_stream()
    times = []
    for i in range(warmup + reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        done = call()
        if done is not None:
            stream.wait_event(done)
        end.record(stream)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1000)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(2_000_000)  # ~1 ms: lets the host queue calls ahead of the GPU
    start.record(stream)
    for _ in range(reps):
        done = call()
        if done is not None:
            stream.wait_event(done)
    end.record(stream)
    end.synchronize()
    return statistics.median(times), start.elapsed_time(end) / 1000 / reps


def _reps(nbytes: int, budget: int) -> int:
    return max(5, min(60, budget // max(nbytes, 1)))


def _emit(rows: list[Row], layout: str, op: str, path: TransferPath, pages: int, nbytes: int,
          ours: tuple[float, float], base: tuple[float, float], note: str = "") -> Row:
    call, pipe = (nbytes / t / 1e9 for t in ours)
    bcall, bpipe = (nbytes / t / 1e9 for t in base)
    row = Row(layout, op, path.value, pages, pipe, bpipe, pipe / bpipe, call, bcall, call / bcall)
    rows.append(row)
    print(f"{op:<8} {path.value:<8} {pages:>5} {pipe:>6.1f} {bpipe:>6.1f} {row.ratio:>6.3f} |"
          f" {call:>6.1f} {bcall:>6.1f} {row.call_ratio:>6.3f}{note}")
    return row


class Bench:
    def __init__(self, name: str, layout: KVLayout, slots: int, max_pages: int, seed: int) -> None:
        pool_pages = 2 * max_pages + 8
        self.name = name
        self.layout = layout
        gen = torch.Generator(device="cuda").manual_seed(seed)
        shape = (layout.num_layers, slots, layout.rows, layout.head_dim)
        self.kv_tensor = torch.randn(shape, device="cuda", dtype=torch.float32, generator=gen).to(layout.dtype)
        self.kv = KVBuffer.wrap(layout, self.kv_tensor)
        self.slots = slots
        self.pool = PagePool.create(layout, pool_pages * layout.page_bytes)
        self.pool.wait_ready_blocking()
        self.pool.pages.view(torch.uint8).fill_(1)
        self.gpu_pages = torch.empty((2 * max_pages, *layout.page_shape), dtype=layout.dtype, device="cuda")
        # The baseline's host side: torch pinned memory (the pool is registered in 256 MiB chunks,
        # and one memcpy may not cross two registrations).
        self.pinned = torch.empty((2 * max_pages, *layout.page_shape), dtype=layout.dtype, pin_memory=True)
        self.gen = torch.Generator().manual_seed(seed)
        self.movers = {path: PageMover(self.kv, self.pool.pages, path, run_pages=self.pool.chunk_pages) for path in (
            TransferPath.STAGING, TransferPath.DIRECT)}

    def close(self) -> None:
        self.pool.close()
        del self.kv_tensor, self.kv, self.movers, self.gpu_pages, self.pinned
        torch.cuda.empty_cache()

    def random_call(self, pages: int) -> tuple[torch.Tensor, list[int]]:
        """Random distinct slots for ``pages`` pages and random distinct pool pages."""
        slots = torch.randperm(self.slots, generator=self.gen)[: pages * self.layout.page_tokens]
        ids = torch.randperm(self.pool.num_pages, generator=self.gen)[:pages].tolist()
        return slots, ids

    def memcpy(self, pages: int, to_host: bool) -> tuple[float, float]:
        """Seconds of one plain pinned memcpy of ``pages`` pages' bytes."""
        host = self.pinned[:pages]
        dev = self.gpu_pages[:pages]

        def call() -> None:
            if to_host:
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)

        return _timed(call, _reps(pages * self.layout.payload_bytes, 2 << 30))

    def transfer(self, path: TransferPath, pages: int, op: Op) -> tuple[float, float]:
        mover = self.movers[path]
        slots, ids = self.random_call(pages)

        def call() -> torch.cuda.Event | None:
            if op == "offload":
                return mover.offload(slots, ids)
            if op == "load":
                return mover.load(ids, slots)
            events = mover.load_layers(ids, slots)
            return None if events is None else events[-1]

        return _timed(call, _reps(pages * self.layout.payload_bytes, 2 << 30))

    def both(self, path: TransferPath, pages: int) -> tuple[float, float]:
        """Seconds for one offload and one load of ``pages`` pages each, issued together."""
        mover = self.movers[path]
        out_slots, out_ids = self.random_call(pages)
        in_ids = [i for i in range(self.pool.num_pages) if i not in set(out_ids)][:pages]
        used = set(out_slots.tolist())
        in_slots = torch.tensor([s for s in range(self.slots) if s not in used][: pages * self.layout.page_tokens])
        stream = torch.cuda.current_stream()

        def call() -> torch.cuda.Event | None:
            a = mover.offload(out_slots, out_ids)
            b = mover.load(in_ids, in_slots)
            assert a is not None
            stream.wait_event(a)
            return b

        return _timed(call, _reps(2 * pages * self.layout.payload_bytes, 2 << 30))

    def both_memcpy(self, pages: int) -> tuple[float, float]:
        d2h, h2d = torch.cuda.Stream(), torch.cuda.Stream()
        host_out, host_in = self.pinned[:pages], self.pinned[pages : 2 * pages]
        dev_out, dev_in = self.gpu_pages[:pages], self.gpu_pages[pages : 2 * pages]
        stream = torch.cuda.current_stream()

        def call() -> None:
            ready = torch.cuda.Event()
            ready.record(stream)
            for side, dst, src in ((d2h, host_out, dev_out), (h2d, dev_in, host_in)):
                side.wait_event(ready)
                with torch.cuda.stream(side):
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
                stream.wait_event(done)

        return _timed(call, _reps(2 * pages * self.layout.payload_bytes, 2 << 30))


def matmul_interference(bench: Bench, path: TransferPath | None, seconds: float) -> dict[str, float]:
    """bf16 8192^3 matmuls on the current stream; beside them, offload+load pairs of 8 pages from
    another stream (the engine's compute stream is not waited on: the copies run concurrently)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    probe_start, probe_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe_start.record()
    for _ in range(10):
        torch.matmul(a, b, out=out)
    probe_end.record()
    probe_end.synchronize()
    count = max(20, int(seconds / (probe_start.elapsed_time(probe_end) / 1000 / 10)))
    torch.cuda.synchronize()

    aux = torch.cuda.Stream()
    pages = 8
    moved = 0
    calls: list[tuple[torch.Tensor, list[int], torch.Tensor, list[int]]] = []
    if path is not None:
        mover = bench.movers[path]
        tokens = pages * bench.layout.page_tokens
        for _ in range(4):
            # Disjoint slots and pages for the two directions: they run concurrently.
            slots = torch.randperm(bench.slots, generator=bench.gen)[: 2 * tokens]
            ids = torch.randperm(bench.pool.num_pages, generator=bench.gen)[: 2 * pages].tolist()
            calls.append((slots[:tokens], ids[:pages], slots[tokens:], ids[pages:]))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        torch.matmul(a, b, out=out)
    end.record()
    t0 = time.perf_counter()
    if path is not None:
        i = 0
        with torch.cuda.stream(aux):
            while not end.query():
                out_slots, out_ids, in_slots, in_ids = calls[i % len(calls)]
                first = mover.offload(out_slots, out_ids)
                second = mover.load(in_ids, in_slots)
                assert first is not None and second is not None
                second.synchronize()
                first.synchronize()
                moved += 2 * pages * bench.layout.payload_bytes
                i += 1
    end.synchronize()
    wall = time.perf_counter() - t0
    elapsed = start.elapsed_time(end) / 1000
    flops = 2 * n**3 * count / elapsed
    return {"tflops": flops / 1e12, "copy_gbps": moved / wall / 1e9 if path is not None else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--pages", nargs="+", type=int, default=[1, 8, 64], help="pages per call")
    parser.add_argument("--slots", type=int, default=65536, help="token slots in the KV buffer")
    parser.add_argument("--matmul-seconds", type=float, default=1.0, help="length of each interference window")
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_transfer needs a CUDA device", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    rows: list[Row] = []
    extra: dict[str, object] = {}
    for index, name in enumerate(args.layouts):
        bench = Bench(name, LAYOUTS[name], args.slots, max(args.pages), seed=index)
        try:
            print(f"\n## {name}: {bench.layout.describe()}")
            print("GB/s: back-to-back calls (steady state) | one call from an idle GPU, host launch included")
            print(f"{'op':<8} {'path':<8} {'pages':>5} {'GB/s':>6} {'memcpy':>6} {'ratio':>6} |"
                  f" {'GB/s':>6} {'memcpy':>6} {'ratio':>6}")

            for pages in args.pages:
                nbytes = pages * bench.layout.payload_bytes
                base = {d: bench.memcpy(pages, d) for d in (True, False)}
                single: dict[TransferPath, float] = {}
                ops: tuple[tuple[bool, Op], ...] = ((True, "offload"), (False, "load"), (False, "layers"))
                for offload, op in ops:
                    for path in bench.movers:
                        timing = bench.transfer(path, pages, op)
                        row = _emit(rows, name, op, path, pages, nbytes, timing, base[offload])
                        if op != "layers":
                            single[path] = min(single.get(path, row.gbps), row.gbps)
                both_base = bench.both_memcpy(pages)
                for path in bench.movers:
                    timing = bench.both(path, pages)
                    gbps = 2 * nbytes / timing[1] / 1e9
                    _emit(rows, name, "both", path, pages, 2 * nbytes, timing, both_base,
                         f"  ({gbps / single[path]:.2f}x one direction)")
            if index == 0:
                alone = matmul_interference(bench, None, args.matmul_seconds)
                print(f"\nmatmul bf16 8192^3 alone: {alone['tflops']:.0f} TFLOP/s")
                extra["matmul_alone_tflops"] = alone["tflops"]
                for path in bench.movers:
                    mixed = matmul_interference(bench, path, args.matmul_seconds)
                    slow = 1 - mixed["tflops"] / alone["tflops"]
                    extra[f"matmul_with_{path.value}"] = {**mixed, "slowdown": slow}
                    print(f"matmul with {path.value:<8} offload+load 8-page pairs: {mixed['tflops']:.0f} TFLOP/s "
                          f"(slowed {100 * slow:.1f}%), copies {mixed['copy_gbps']:.1f} GB/s")
        finally:
            bench.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": [asdict(r) for r in rows], **extra}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
