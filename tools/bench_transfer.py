"""GPU <-> pool page transfers per path, against a plain pinned memcpy of the same bytes (same run).

For an 8B-class layout (32 layers, 8 KV heads, head_dim 128, bf16) and an MLA layout (61 layers,
576 latent, bf16), 256-token pages of random slots, 1/8/64 pages per call:

- offload (GPU -> pool) and load (pool -> GPU) for each path, GB/s and the ratio to memcpy;
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

import torch
from aiokv.kernels import PageMover, TransferPath

from aiokv.layout import KVBuffer, KVLayout
from aiokv.pool import PagePool

LAYOUTS = {
    "mha-8b": KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=256),
    "mla-61x576": KVLayout.mla(61, 576, torch.bfloat16, page_tokens=256),
}


@dataclass
class Row:
    layout: str
    op: str
    path: str
    pages: int
    gbps: float
    memcpy_gbps: float
    ratio: float


def _timed(call: Callable[[], torch.cuda.Event | None], reps: int, warmup: int = 2) -> float:
    """Median seconds of ``call`` on the current stream, from before the host issues it to its event."""
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
    return statistics.median(times)


def _reps(nbytes: int, budget: int) -> int:
    return max(5, min(60, budget // max(nbytes, 1)))


class Bench:
    def __init__(self, name: str, layout: KVLayout, slots: int, pool_pages: int, seed: int) -> None:
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
        self.gpu_pages = torch.empty((64, *layout.page_shape), dtype=layout.dtype, device="cuda")
        self.gen = torch.Generator().manual_seed(seed)
        self.movers = {path: PageMover(self.kv, self.pool.pages, path) for path in (
            TransferPath.STAGING, TransferPath.DIRECT)}

    def close(self) -> None:
        self.pool.close()

    def random_call(self, pages: int) -> tuple[torch.Tensor, list[int]]:
        """Random distinct slots for ``pages`` pages and random distinct pool pages."""
        slots = torch.randperm(self.slots, generator=self.gen)[: pages * self.layout.page_tokens]
        ids = torch.randperm(self.pool.num_pages, generator=self.gen)[:pages].tolist()
        return slots, ids

    def memcpy(self, pages: int, to_host: bool) -> float:
        """Seconds of one plain pinned memcpy of ``pages`` pages (contiguous pool range)."""
        host = self.pool.pages[:pages]
        dev = self.gpu_pages[:pages]
        assert host.is_contiguous(), "pages are padded: no single memcpy covers them"

        def call() -> None:
            if to_host:
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)

        return _timed(call, _reps(pages * self.layout.payload_bytes, 2 << 30))

    def transfer(self, path: TransferPath, pages: int, offload: bool) -> float:
        mover = self.movers[path]
        slots, ids = self.random_call(pages)

        def call() -> torch.cuda.Event | None:
            return mover.offload(slots, ids) if offload else mover.load(ids, slots)

        return _timed(call, _reps(pages * self.layout.payload_bytes, 2 << 30))

    def both(self, path: TransferPath, pages: int) -> float:
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

    def both_memcpy(self, pages: int) -> float:
        d2h, h2d = torch.cuda.Stream(), torch.cuda.Stream()
        host_out, host_in = self.pool.pages[:pages], self.pool.pages[pages : 2 * pages]
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
    pool_pages = 2 * max(args.pages) + 8
    for index, name in enumerate(args.layouts):
        bench = Bench(name, LAYOUTS[name], args.slots, pool_pages, seed=index)
        try:
            print(f"\n## {name}: {bench.layout.describe()}")
            print(f"{'op':<8} {'path':<9} {'pages':>5} {'GB/s':>7} {'memcpy':>7} {'ratio':>6}")
            for pages in args.pages:
                nbytes = pages * bench.layout.payload_bytes
                base = {d: nbytes / bench.memcpy(pages, d) / 1e9 for d in (True, False)}
                for offload, op in ((True, "offload"), (False, "load")):
                    for path in bench.movers:
                        gbps = nbytes / bench.transfer(path, pages, offload) / 1e9
                        row = Row(name, op, path.value, pages, gbps, base[offload], gbps / base[offload])
                        rows.append(row)
                        print(f"{op:<8} {path.value:<9} {pages:>5} {gbps:>7.1f} {base[offload]:>7.1f} "
                              f"{row.ratio:>6.3f}")
                both_base = 2 * nbytes / bench.both_memcpy(pages) / 1e9
                for path in bench.movers:
                    gbps = 2 * nbytes / bench.both(path, pages) / 1e9
                    single = next(r.gbps for r in rows if r.layout == name and r.op == "offload"
                                  and r.path == path.value and r.pages == pages)
                    row = Row(name, "both", path.value, pages, gbps, both_base, gbps / both_base)
                    rows.append(row)
                    print(f"{'both':<8} {path.value:<9} {pages:>5} {gbps:>7.1f} {both_base:>7.1f} {row.ratio:>6.3f}"
                          f"  ({gbps / single:.2f}x one direction)")
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
