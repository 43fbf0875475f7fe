"""Longest call into the vLLM adapter while pages stream to and from disk (issue 12's target: 1 ms).

Builds vLLM 0.33's real TieringOffloadingManager (OffloadingSpecFactory -> TieringOffloadingSpec)
with ``AiokvTier`` by module path and plays its scheduler: each step runs the manager calls of
the step, then sleeps ``--step-ms`` (the model's forward). It stores ``--gib`` of chunks (2 MiB by
default; the CPU tier holds half, so the first half is evicted while the rest is stored), then
looks the first half up, promotes it from disk and loads it, checking every chunk bit-exact.

Every call vLLM makes into the tier (lookup, submit_store/submit_load, get_finished_jobs,
on_schedule_end, has_pending_work, on_new_request/on_request_finished) is timed inside the tier;
the report gives count, p50, p99 and max per method, the longest of all (the figure the target is
about), and the write and read throughput seen by the scheduler (GiB of chunks per second of wall).
The row ``control`` is the baseline of the same run: an empty function timed the same way once per
step, under the manager lock; its max is what the machine alone (preemption, other processes) puts
on any call. ``wakes`` counts the hand-overs that made a system call (the loop was parked).

CPU per GB: the CPU time of every thread of the process but the scheduler's (the tier's loop
thread, the disk tier's checksum and pool threads, io_uring workers), per GB (1e9 bytes) of chunks
written, and read, in each phase. The scheduler's own work (the worker's region writes, the test
pattern, the bit-exact check) is not counted. ``--zero-copy off`` runs the same with every page
through a staging page (the path before zero copy), for A/B runs alternated in one session.

    python tools/bench_adapters.py --gib 1 --json out/adapters.json

``--engine sglang``: SGLang 0.5.23's backend from its real factory over its real MLA host pool
(``page_first``, 61 layers x 64 tokens x 576 bf16: 4.3 MiB pages, one buffer each) on the CPU,
called as SGLang's cache controller calls it: ``batch_set_v1`` in batches of 128 pages, then
``batch_exists`` and ``batch_get_v1`` into other host slots, checked bit-exact. CPU per GB as
above (every thread but the caller's). ``--register off`` skips registering the host pool with
io_uring (the behaviour before it was registered; pages still move in place, O_DIRECT where
aligned), for A/B runs alternated in one session. The host pool's module imports on a CPU machine
through tests/adapters/sglang_helpers.py (it says why).

    python tools/bench_adapters.py --engine sglang --gib 1 --register on
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from aiokv.adapters.vllm import AiokvTier

STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
TIMED = ("lookup", "submit_store", "submit_load", "get_finished_jobs", "on_schedule_end", "has_pending_work",
         "on_new_request", "on_request_finished")


def build(disk_dir: Path, chunk_bytes: int, cpu_chunks: int, queue_depth: int, backend: str, linger_s: float,
          idle_poll_s: float, zero_copy: bool) -> Any:
    tier = {"type": "AiokvTier", "module_path": "aiokv.adapters.vllm", "disk_dir": str(disk_dir),
            "disk_bytes": 64 << 30, "queue_depth": queue_depth, "disk_backend": backend, "namespace": "bench",
            "linger_s": linger_s, "idle_poll_s": idle_poll_s, "zero_copy": zero_copy}
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=256, layer_names=("layers",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_chunks * chunk_bytes,
                      "secondary_tiers": [tier]},
        engine_id=f"aiokv-bench-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="bench/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=256, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False),
    )
    return OffloadingSpecFactory.create_spec(config).get_manager()


def time_calls(tier: AiokvTier) -> dict[str, list[int]]:
    """Wrap the tier's vLLM-facing methods (on the instance) to record each call's duration in ns."""
    times: dict[str, list[int]] = {name: [] for name in TIMED}
    for name in TIMED:
        method = getattr(tier, name)

        def timed(*args: Any, _method: Callable[..., Any] = method, _out: list[int] = times[name]) -> Any:
            start = time.perf_counter_ns()
            try:
                return _method(*args)
            finally:
                _out.append(time.perf_counter_ns() - start)

        setattr(tier, name, functools.wraps(method)(timed))
    return times


class Scheduler:
    """The scheduler's side of the offloading connector, reduced to the manager calls."""

    def __init__(self, manager: Any, chunk_bytes: int, step_ms: float, control: list[int]) -> None:
        self.m = manager
        self.control = control
        self.chunk_bytes = chunk_bytes
        self.step_s = step_ms / 1000
        self.steps = 0

    def step(self) -> None:
        with self.m.lock:
            self.m.on_schedule_end(STEP)
            self.m.has_pending_work()
            start = time.perf_counter_ns()
            _empty()
            self.control.append(time.perf_counter_ns() - start)
        self.steps += 1
        time.sleep(self.step_s)  # the model's forward pass

    def chunks(self) -> memoryview:
        return self.m.primary_tier.get_kv_memoryview().cast("B")

    def store(self, req: str, keys: Sequence[bytes], fill: Callable[[int], bytes]) -> None:
        ctx = ReqContext(req_id=req)
        with self.m.lock:
            self.m.on_new_request(ctx)
        while True:
            with self.m.lock:
                out = self.m.prepare_store(keys, ctx)
            if out is not None:
                break
            self.step()  # the CPU tier is full of chunks still being written: wait for cascades
        with self.chunks() as flat:
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                c = int(chunk)
                flat[c * self.chunk_bytes : (c + 1) * self.chunk_bytes] = fill(keys.index(key))
        with self.m.lock:
            self.m.complete_store(keys, ctx)
            self.m.on_request_finished(ctx)
        self.step()

    def load(self, req: str, keys: Sequence[bytes]) -> list[bytes]:
        ctx = ReqContext(req_id=req)
        with self.m.lock:
            self.m.on_new_request(ctx)
        for _ in range(10_000):
            with self.m.lock:
                results = [self.m.lookup(k, ctx) for k in keys]
            if all(r is LookupResult.HIT for r in results):
                break
            if LookupResult.MISS in results:
                raise RuntimeError(f"{req}: a stored chunk missed: {results}")
            self.step()
        with self.m.lock:
            spec = self.m.prepare_load(keys, ctx)
        with self.chunks() as flat:
            data = [bytes(flat[int(c) * self.chunk_bytes : (int(c) + 1) * self.chunk_bytes]) for c in spec.chunk_ids]
        with self.m.lock:
            self.m.complete_load(keys, ctx)
            self.m.on_request_finished(ctx)
        self.step()
        return data


def _empty() -> None:
    """The control call: nothing."""


def count_wakes(tier: AiokvTier) -> list[int]:
    """Count the loop wake-ups (system calls) the tier's hand-overs made: [count, ns of each...]."""
    thread = tier._store.thread
    count = [0]
    wake = thread.wake

    def counted() -> None:
        if thread.parked and thread.pending():
            count[0] += 1
            start = time.perf_counter_ns()
            wake()
            count.append(time.perf_counter_ns() - start)
            return
        wake()

    thread.wake = counted  # type: ignore[method-assign]
    return count


def other_threads_cpu_s() -> float:
    """CPU seconds of this process (live and ended threads, io_uring workers) minus the calling
    (scheduler) thread's own."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime - time.thread_time()


def pattern(request: int, index: int, size: int) -> bytes:
    return np.random.default_rng(request * 1000 + index).integers(0, 256, size, dtype=np.uint8).tobytes()


def summarize(times: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    out = {}
    for name, values in times.items():
        if values:
            arr = np.array(values) / 1e3
            out[name] = {"calls": len(values), "p50_us": float(np.percentile(arr, 50)),
                         "p99_us": float(np.percentile(arr, 99)), "max_us": float(arr.max())}
    return out


SGLANG_BATCH = 128  # SGLang's STORAGE_BATCH_SIZE: pages per batch_set_v1 / batch_get_v1 call


def run_sglang(args: argparse.Namespace) -> dict[str, Any]:
    """The SGLang run: MLA pages written from and read into SGLang's host pool; its figures."""
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "adapters"))
    import sglang_helpers as sh
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    import aiokv.adapters.sglang as adapter

    if args.register == "off":
        adapter._register_host = lambda pool: None  # the behaviour before: host pool not registered
    layers, tokens, dim = 61, 64, 576
    page_bytes = layers * tokens * dim * 2
    pages = max(1, int(args.gib * (1 << 30)) // page_bytes)
    capacity = 2 * pages * tokens  # written from the first half, read into the second
    device = tuple(torch.zeros(capacity, 1, dim, dtype=torch.bfloat16) for _ in range(layers))
    info = sh.MLABufferInfo(buffers=device, data_ptrs=torch.tensor([t.data_ptr() for t in device], dtype=torch.uint64),
                            layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=tokens,
                            kv_lora_rank=512, qk_rope_head_dim=64, kv_cache_dim=dim, dtype=torch.bfloat16,
                            device=torch.device("cpu"))
    host = sh.MLATokenToKVPoolHost(info, 1.0, 0, tokens, "page_first", pin_memory=False, device="cpu",
                                   device_capacity_tokens=capacity, start_layer=0, end_layer=layers,
                                   target_layer_num=layers)
    del device
    flat = host.kv_buffer.view(torch.uint8).reshape(-1)[: 2 * pages * page_bytes].view(2 * pages, page_bytes)
    seed = torch.Generator().manual_seed(7)
    flat[:pages] = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, generator=seed)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        config = sh.storage_config(Path(tmp), True, model="bench/mla", mla=True, tp_size=1, options={
            "disk_bytes": 64 << 30, "queue_depth": args.queue_depth, "disk_backend": args.backend,
            "zero_copy": args.zero_copy == "on"})
        backend = StorageBackendFactory.create_backend("dynamic", config, host)
        try:
            backend.register_mem_pool_host(host)
            backend.on_host_pools_registered()
            store = backend._pools["kv"].store
            store.thread.run(store.wait_registered())
            keys = [f"page-{i}" for i in range(pages)]

            def slots(first: int, count: int) -> torch.Tensor:
                return torch.arange(first * tokens, (first + count) * tokens)

            start, cpu = time.perf_counter(), other_threads_cpu_s()
            for b in range(0, pages, SGLANG_BATCH):
                n = min(SGLANG_BATCH, pages - b)
                if not all(backend.batch_set_v1(keys[b : b + n], slots(b, n))):
                    raise SystemExit(f"batch {b}: pages not stored")
            write_s, write_cpu = time.perf_counter() - start, other_threads_cpu_s() - cpu
            start, cpu = time.perf_counter(), other_threads_cpu_s()
            for b in range(0, pages, SGLANG_BATCH):
                n = min(SGLANG_BATCH, pages - b)
                if backend.batch_exists(keys[b : b + n]) != n or not all(
                        backend.batch_get_v1(keys[b : b + n], slots(pages + b, n))):
                    raise SystemExit(f"batch {b}: pages not read back")
            read_s, read_cpu = time.perf_counter() - start, other_threads_cpu_s() - cpu
            if not torch.equal(flat[:pages], flat[pages:]):
                raise SystemExit("read bytes differ")
            stats = backend.statistics()
            direct, staged = store.thread.call(lambda: (store.direct_pages, store.staged_pages)).result()
            registered = store.registered_regions - int(stats["memory_unregistered"])
        finally:
            backend.close()
    total = pages * page_bytes
    report = {
        "engine": "sglang", "page_bytes": page_bytes, "pages": pages, "backend": str(stats["backend"]),
        "direct_io": stats["direct_io"], "register": args.register, "registered_regions": registered,
        "direct_pages": direct, "staged_pages": staged, "buffered_fallbacks": stats["buffered_fallbacks"],
        "write_gib_s": total / write_s / (1 << 30), "read_gib_s": total / read_s / (1 << 30),
        "write_cpu_s_per_gb": write_cpu / (total / 1e9), "read_cpu_s_per_gb": read_cpu / (total / 1e9),
        "load_average": os.getloadavg(),
    }
    print(f"SGLang AiokvHiCacheStorage, MLA host pool: {pages} x {page_bytes >> 10} KiB pages "
          f"({total / (1 << 30):.2f} GiB) stored and read back bit-exact; {report['backend']}, "
          f"O_DIRECT={report['direct_io']}, host pool registered: {args.register} ({registered} regions)")
    print(f"{direct} pages in place, {staged} through staging, {report['buffered_fallbacks']} buffered fallbacks")
    print(f"write {report['write_gib_s']:.2f} GiB/s {report['write_cpu_s_per_gb']:.3f} core-s/GB; "
          f"read {report['read_gib_s']:.2f} GiB/s {report['read_cpu_s_per_gb']:.3f} core-s/GB "
          f"(CPU besides the caller's thread); load average {report['load_average'][0]:.1f}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm", help="which adapter to drive")
    parser.add_argument("--register", choices=("on", "off"), default="on",
                        help="sglang: register the host pool with io_uring (on) or not (off, the old behaviour)")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of chunks stored (half of them loaded back)")
    parser.add_argument("--chunk-mib", type=float, default=2.0, help="bytes per chunk, MiB (a multiple of 4 KiB)")
    parser.add_argument("--per-request", type=int, default=16, help="chunks per request")
    parser.add_argument("--step-ms", type=float, default=1.0, help="model step between scheduler calls, ms")
    parser.add_argument("--queue-depth", type=int, default=16, help="page I/Os in flight")
    parser.add_argument("--backend", default="auto", help="auto, uring_fixed, uring or threads")
    parser.add_argument("--linger-s", type=float, default=0.05,
                        help="the tier's linger_s: polling time after work before the loop parks, s")
    parser.add_argument("--idle-poll-s", type=float, default=0.01,
                        help="the tier's idle_poll_s: a parked loop's look interval, s (0: step ends wake it)")
    parser.add_argument("--zero-copy", choices=("on", "off"), default="on",
                        help="the tier's zero_copy: chunks straight between vLLM's region and files (on) "
                        "or through staging pages (off)")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temporary page-file directory")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    if args.engine == "sglang":
        report = run_sglang(args)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))
        return

    chunk_bytes = int(args.chunk_mib * (1 << 20)) // 4096 * 4096
    total = int(args.gib * (1 << 30)) // chunk_bytes // args.per_request * args.per_request
    requests = total // args.per_request
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        manager = build(Path(tmp), chunk_bytes, total // 2, args.queue_depth, args.backend, args.linger_s,
                        args.idle_poll_s, args.zero_copy == "on")
        tier = manager.secondary_tiers[0]
        assert isinstance(tier, AiokvTier)
        times = time_calls(tier)
        wakes = count_wakes(tier)
        control: list[int] = []
        sched = Scheduler(manager, chunk_bytes, args.step_ms, control)
        keys = [[make_offload_key(f"r{r}-{i}".encode().ljust(32, b"."), 0) for i in range(args.per_request)]
                for r in range(requests)]
        try:
            start, cpu = time.perf_counter(), other_threads_cpu_s()
            for r in range(requests):
                sched.store(f"w{r}", keys[r], functools.partial(pattern, r, size=chunk_bytes))
            while manager.has_pending_work():
                sched.step()
            write_s, write_cpu = time.perf_counter() - start, other_threads_cpu_s() - cpu
            start, cpu = time.perf_counter(), other_threads_cpu_s()
            loaded = 0
            for r in range(requests // 2):  # evicted from the CPU tier: promoted from disk
                data = sched.load(f"l{r}", keys[r])
                if data != [pattern(r, i, chunk_bytes) for i in range(args.per_request)]:
                    raise SystemExit(f"request {r}: loaded bytes differ")
                loaded += len(data)
            read_s, read_cpu = time.perf_counter() - start, other_threads_cpu_s() - cpu
            stats = tier.statistics()
            store = tier._store
            direct, staged = store.thread.call(lambda: (store.direct_pages, store.staged_pages)).result()
        finally:
            manager.shutdown()
    figures = summarize(times)
    longest = max(v["max_us"] for v in figures.values())
    figures["control"] = summarize({"control": control})["control"]
    report = {
        "chunk_bytes": chunk_bytes, "stored_chunks": total, "loaded_chunks": loaded, "steps": sched.steps,
        "step_ms": args.step_ms, "backend": str(stats["backend"]), "direct_io": stats["direct_io"],
        "write_gib_s": total * chunk_bytes / write_s / (1 << 30),
        "read_gib_s": loaded * chunk_bytes / read_s / (1 << 30),
        "zero_copy": args.zero_copy == "on", "direct_pages": direct, "staged_pages": staged,
        "write_cpu_s_per_gb": write_cpu / (total * chunk_bytes / 1e9),
        "read_cpu_s_per_gb": read_cpu / (loaded * chunk_bytes / 1e9),
        "load_average": os.getloadavg(),
        "longest_call_us": longest, "calls": figures, "wakes": wakes[0],
        "wake_max_us": max(wakes[1:], default=0) / 1e3,
    }
    print(f"vLLM AiokvTier, {total} x {chunk_bytes >> 10} KiB chunks stored "
          f"({total * chunk_bytes / (1 << 30):.2f} GiB), {loaded} loaded back bit-exact; "
          f"{report['backend']}, O_DIRECT={report['direct_io']}, {sched.steps} steps")
    print(f"write {report['write_gib_s']:.2f} GiB/s, read {report['read_gib_s']:.2f} GiB/s "
          "(scheduler wall, steps included)")
    print(f"zero copy {args.zero_copy}: {direct} pages in place, {staged} through staging; CPU besides the scheduler: "
          f"write {report['write_cpu_s_per_gb']:.3f}, read {report['read_cpu_s_per_gb']:.3f} core-s/GB; "
          f"load average {report['load_average'][0]:.1f}")
    print(f"{'method':22} {'calls':>7} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
    for name, f in figures.items():
        print(f"{name:22} {f['calls']:7d} {f['p50_us']:8.1f} {f['p99_us']:8.1f} {f['max_us']:8.1f}")
    print(f"longest call into the adapter: {longest:.0f} us (target <= 1000 us); "
          f"longest control call {figures['control']['max_us']:.0f} us; {wakes[0]} wake-ups in {sched.steps} steps "
          f"(longest {report['wake_max_us']:.0f} us)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
