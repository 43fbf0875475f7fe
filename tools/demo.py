"""aiokv's demo inference loop: a Llama-shaped model served from one asyncio loop over aiokv's tiers.

Runs a multi-tenant workload (multi-turn chats, long documents read by several users) twice: from
scratch, then with the GPU prefix cache and aiokv's CPU pool and disk tier; checks every request
against the from-scratch run (tokens identical, logits bit-exact on CPU, their largest difference
reported on a GPU; a mismatch exits 1 naming the request) and prints where prompt tokens came
from. ``--ttft`` instead measures time to first token for long prompts served from the pool, from
disk, and recomputed.

Cache hits are served through ``--load-path`` (default ``auto``): aiokv loads the match from its
last page backwards while the engine prefills it from the front, claiming chunk by chunk
(``LoadStream.claim``) where the cost model says it pays, until the two meet; then the engine
prefills the uncached tail. For a hit all in the pool the copies go layer by layer and the tail's
layer l waits only for layer l (``order_layer`` on CUDA, ``wait_layer`` on CPU); a hit that reaches
disk streams whole pages. ``plain`` awaits ``load`` first. Claimed chunks follow the page grid of a
from-scratch run, so the oracle stays bit-exact.

Only prompt pages are offloaded: answer tokens' K/V come from one-token decode steps, whose
arithmetic differs from a prefill chunk's, so serving them would break bit-exactness.

    .venv/bin/python tools/demo.py                                   # CPU, about 1.5 minutes
    .venv/bin/python tools/demo.py --tp 2                            # heads over 2 rank processes (CPU)
    .venv/bin/python tools/demo.py --preset 8b --device cuda         # H200
    .venv/bin/python tools/demo.py --preset 8b --device cuda --ttft  # headline TTFT table
    .venv/bin/python tools/demo.py --preset 8b --device cuda --ttft --load-path plain split-layered
    .venv/bin/python tools/demo.py --preset 8b --device cuda --probe-gil [--no-disk] [--scratch-run open|after]

The cached run admits requests in the scratch run's order, so each request's TTFT compares like
for like. Requests that hit nothing compare their own prefill (and its host part, ``launch_s``)
apart from their queue; ``--probe-gil`` measures how long other threads held the GIL meanwhile.

``--tp N`` splits the model's heads and MLP columns over N spawned rank processes that combine their
partial sums with a gloo all-reduce and keep their own KV buffer slice, under one ``TPCache`` in
this (scheduler) process; both runs use the same split, so the oracle stays bit-exact on CPU
(``demo_tp.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

import aiokv.cuda
from aiokv import CacheConfig, CacheStatistics, KVCache, KVLayout, TransferPath
from aiokv.storage import DiskConfig
from aiokv.tp import WorkerStatistics

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_engine import (
    MODEL_THREAD_PREFIX,
    BlockTable,
    ClaimPolicy,
    Engine,
    LoadPath,
    RequestResult,
    Runs,
    Session,
    WorkloadConfig,
    admission_order,
    make_workload,
    timed_run,
)
from demo_model import PRESETS, LlamaModel, ModelConfig, Shard, preset
from demo_probe import GilProbe
from demo_report import (
    OracleReport,
    compare,
    format_table,
    format_ttft,
    plot,
    progress_bar,
    summarize,
    tp_line,
    ttft_ratios,
    write_json,
)
from demo_tp import RankFailedError, serve_tp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Workload and tier sizes per model preset: the KV buffer holds a few requests, the pool about a
# quarter of the distinct prompt pages, so GPU prefix, pool and disk all serve hits.
WORKLOADS: dict[str, WorkloadConfig] = {
    "tiny": WorkloadConfig(
        tenants=3, chats_per_tenant=2, chat_turns=3, system_tokens=24, chat_text=(20, 40),
        docs_per_tenant=1, doc_tokens=(120, 160), users_per_doc=3, doc_turns=1, question_tokens=(6, 12),
    ),
    "small": WorkloadConfig(),
    "8b": WorkloadConfig(
        tenants=3, chats_per_tenant=4, chat_turns=4, system_tokens=512, chat_text=(300, 800),
        docs_per_tenant=2, doc_tokens=(6000, 12000), users_per_doc=3, doc_turns=2, question_tokens=(40, 200),
    ),
}
PAGE_TOKENS = {"tiny": 8, "small": 32, "8b": 256}
SCRATCH_FIELDS = ("index", "prefill_s", "launch_s", "decode_s", "prefill_at", "gil_lag_s", "model_cpu_s",
                  "model_waits", "model_preemptions", "threads_s")
"""What the JSON gives of each request's from-scratch run beside its cached one (``<field>_scratch``)."""
KV_FACTOR = 1.0
POOL_FACTOR = 0.25
TTFT_CHUNK = 2048


class ScratchWhen(enum.Enum):
    """When the from-scratch run happens relative to the cached one (a control for run order)."""

    BEFORE = "before"
    """First, before any cache exists (the default)."""
    OPEN = "open"
    """With the cache started and warm but unused, just before the cached run: is an open cache
    (its threads, its pinned and registered pool) enough to slow the engine?"""
    AFTER = "after"
    """After the cached run and the cache's close, admitting in the cached run's order: does the
    second run pay for running second (GPU clocks, allocator state)?"""


@dataclass(frozen=True)
class DemoConfig:
    """Everything one demo run needs (tokens, pages, bytes)."""

    model: ModelConfig
    workload: WorkloadConfig
    device: str = "cpu"
    page_tokens: int = 32
    chunk_tokens: int = 0  # 0: one page per chunk
    gen_tokens: int = 8
    concurrency: int = 2
    window: int = 6  # sessions open at once
    kv_blocks: int = 0  # 0: sized from the workload
    pool_pages: int = 0  # 0: sized from the workload
    disk_bytes: int = 0  # 0: twice the workload's distinct pages (TTFT: twice the longest prompt)
    disk_dir: Path | None = None  # None: a temporary directory, removed afterwards
    namespace: str = "demo-model"
    prefetch: bool = False  # prefetch a queued turn's disk pages into the pool
    settle: bool = False  # flush write-behind after each offload (with concurrency 1: reproducible tiers)
    tp: int = 1  # tensor-parallel ranks, each its own process (1: the model runs in this process)
    load_path: LoadPath = LoadPath.AUTO  # how cache hits reach the KV buffer
    claim: ClaimPolicy = ClaimPolicy.AUTO  # when a splitting path claims
    transfer_path: TransferPath | None = None  # None: aiokv's default (STAGING on CUDA)
    disk: bool = True  # False: the cache has no disk tier (the pool only)
    probe_gil: bool = False  # sample how long a Python thread waits for the GIL during both runs
    scratch_when: ScratchWhen = ScratchWhen.BEFORE  # when the from-scratch run happens

    def transfer_path_for(self, path: LoadPath) -> TransferPath | None:
        """The pool->GPU path for ``path`` (``None``: the cache's default, STAGING on CUDA).

        Layer-wise loads use STAGING too: its pipelined copies keep the SMs free for the tail's
        prefill, while DIRECT's kernels read the pool over PCIe on the SMs and compete with it (on
        the H200 a 32K pool hit's first layer landed after 36 ms with DIRECT, after ~3 with STAGING).
        """
        del path
        return self.transfer_path


@dataclass
class DemoOutcome:
    """Both runs' records, the cache statistics and the oracle's verdict."""

    cached: list[RequestResult]
    scratch: list[RequestResult]
    summary: dict[str, Any]
    stats: CacheStatistics | None
    oracle: OracleReport
    kv_blocks: int
    pool_pages: int
    disk_bytes: int
    rank_pids: tuple[int, ...] = ()  # TP: the rank processes (all joined by now)
    rank_workers: tuple[WorkerStatistics, ...] = ()  # TP: each rank's aiokv worker at its stop


def _sizes(cfg: DemoConfig, sessions: list[Session]) -> tuple[int, int, int, int]:
    """Longest request in tokens, KV buffer blocks, pool pages and disk pages for this workload."""
    page = cfg.page_tokens
    longest = max(sum(len(t) for t in s.texts) + len(s.texts) * cfg.gen_tokens for s in sessions)
    per_request = -(-longest // page)
    distinct = {t for s in sessions for t in s.texts}  # a document counts once per reader: an upper bound
    distinct_pages = sum(len(t) for t in distinct) // page
    kv_blocks = cfg.kv_blocks or max(per_request, int(KV_FACTOR * cfg.concurrency * per_request))
    pool_pages = cfg.pool_pages or max(per_request, int(POOL_FACTOR * distinct_pages))
    return longest, kv_blocks, pool_pages, 2 * distinct_pages


def _layout_and_config(
    cfg: DemoConfig, pool_pages: int, disk_dir: Path | None, disk_pages: int, path: LoadPath | None = None
) -> tuple[KVLayout, CacheConfig]:
    m = cfg.model
    layout = KVLayout.mha(
        num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype=m.dtype,
        page_tokens=cfg.page_tokens,
    )
    # disk_dir None: no disk tier (a size beside disk_dir=None is refused).
    disk = None if disk_dir is None else DiskConfig(
        directory=disk_dir, capacity_bytes=cfg.disk_bytes or max(1, disk_pages) * layout.page_bytes
    )
    config = CacheConfig(
        cpu_bytes=pool_pages * layout.page_bytes, disk=disk,
        namespace=cfg.namespace, transfer_path=cfg.transfer_path_for(cfg.load_path if path is None else path),
    )
    return layout, config


async def run_demo(cfg: DemoConfig, progress: bool = True) -> DemoOutcome:
    """Serve the workload from scratch, then through the cache; compare the two request by request.

    With ``cfg.tp > 1`` both runs use the same split over ``cfg.tp`` rank processes (``demo_tp``).
    """
    device = torch.device(cfg.device)
    sessions = make_workload(cfg.workload, cfg.model.vocab)
    longest, kv_blocks, pool_pages, disk_pages = _sizes(cfg, sessions)
    chunk = cfg.chunk_tokens or cfg.page_tokens
    tmp = None
    disk_dir = cfg.disk_dir
    if disk_dir is None and cfg.disk:
        tmp = disk_dir = Path(tempfile.mkdtemp(prefix="aiokv-demo-"))
    # This coroutine runs on the event loop's thread: named so (the model runs on demo-model_#).
    probe = GilProbe(labels={threading.get_native_id(): LOOP_THREAD}) if cfg.probe_gil else None
    try:
        layout, config = _layout_and_config(cfg, pool_pages, disk_dir if cfg.disk else None, disk_pages,
                                            cfg.load_path)
        if probe is not None:
            probe.start()
        if cfg.tp > 1:
            runs = await serve_tp(cfg, sessions, layout, config, kv_blocks, longest, progress)
        else:
            runs = await _serve_one_process(cfg, sessions, layout, config, kv_blocks, longest, progress)
    finally:
        if probe is not None:
            probe.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    # Bit-exact needs the same chunk shapes with and without hits (one page per chunk) and the CPU.
    oracle = compare(runs.cached, runs.scratch, exact=device.type == "cpu" and chunk == cfg.page_tokens)
    summary = summarize(runs.cached, runs.scratch, runs.wall, runs.wall_scratch)
    if probe is not None:
        summary["gil_probe"] = _probe_summary(probe, runs)
    return DemoOutcome(
        runs.cached, runs.scratch, summary, runs.stats, oracle, kv_blocks, pool_pages, config.disk_bytes,
        runs.rank_pids, runs.rank_workers,
    )


def _probe_summary(probe: GilProbe, runs: Runs) -> dict[str, Any]:
    """The probe's lags per run, and over the prefill of each request (``gil_lag_s``): misses' mean
    in both runs (the same requests), where the cache's work would show as a longer wait."""
    for r in (*runs.cached, *runs.scratch):
        r.gil_lag_s = probe.mean_lag(r.prefill_at, r.prefill_at + r.prefill_s)
        r.threads_s = probe.thread_run_s(r.prefill_at, r.prefill_at + r.prefill_s)
    out: dict[str, Any] = {name: asdict(probe.summary(*span)) for name, span in runs.spans.items()}
    base = {r.name: r for r in runs.scratch}
    # Which threads ran more over the slowest requests' prefill than over the same from scratch.
    slowest = sorted((r for r in runs.cached if r.name in base),
                     key=lambda r: r.ttft_s / max(base[r.name].ttft_s, 1e-9), reverse=True)[:3]
    out["slowest_threads"] = [
        {"request": r.name, "prefill_s": [r.prefill_s, base[r.name].prefill_s],
         "extra_run_s": dict(sorted(extra_run_s(r, base[r.name]).items(), key=lambda kv: -kv[1])[:5])}
        for r in slowest
    ]
    missed = [r for r in runs.cached if r.computed_tokens == r.prompt_tokens and r.name in base]
    if missed:
        # Per miss, on average: which threads ran more over its own prefill than from scratch.
        totals: dict[str, float] = {}
        for r in missed:
            for k, v in extra_run_s(r, base[r.name]).items():
                totals[k] = totals.get(k, 0.0) + v / len(missed)
        out["miss_extra_run_s"] = dict(sorted(totals.items(), key=lambda kv: -abs(kv[1])))
    misses = [(r.gil_lag_s, base[r.name].gil_lag_s) for r in missed]
    pairs = [(c, s) for c, s in misses if c is not None and s is not None]
    out["miss_prefill_lag_s"] = (
        {"requests": len(pairs), "cached": statistics.fmean(c for c, _ in pairs),
         "scratch": statistics.fmean(s for _, s in pairs)} if pairs else None
    )
    return out


LOOP_THREAD = "demo-loop"
"""The event loop's thread in ``--probe-gil``'s CPU per thread (it runs aiokv's and the demo's
coroutines and callbacks; the model runs on ``demo-model_#``, aiokv's own threads are ``aiokv-*``)."""
OWN_MODEL = "model thread (this request)"
OTHER_MODEL = "model threads (other requests)"


def extra_run_s(cached: RequestResult, scratch: RequestResult) -> dict[str, float]:
    """CPU seconds each thread ran over ``cached``'s prefill minus over the same request's from
    scratch (``threads_s``). The model threads' share is split: the request's own model work
    (``model_cpu_s``, its prefill calls) apart from other requests' model work in the same span."""
    names = cached.threads_s.keys() | scratch.threads_s.keys()
    extra = {k: cached.threads_s.get(k, 0.0) - scratch.threads_s.get(k, 0.0) for k in names}
    model = f"{MODEL_THREAD_PREFIX}_#"
    if model in extra:
        own = cached.model_cpu_s - scratch.model_cpu_s
        extra[OWN_MODEL] = own
        extra[OTHER_MODEL] = extra.pop(model) - own
    return extra


def probe_line(summary: dict[str, Any]) -> str | None:
    """One line on the GIL probe's figures (None without ``--probe-gil``)."""
    g = summary.get("gil_probe")
    if g is None:
        return None
    runs = "; ".join(f"{name} mean {g[name]['mean_s'] * 1e3:.2f} ms p99 {g[name]['p99_s'] * 1e3:.2f} ms "
                     f"(~{100 * g[name]['busy_fraction']:.0f}% of the run)"
                     for name in ("scratch", "cached") if name in g)
    m = g.get("miss_prefill_lag_s")
    misses = "" if m is None else (f"; during misses' prefill (n={m['requests']}) cached {m['cached'] * 1e3:.2f} ms "
                                   f"vs scratch {m['scratch'] * 1e3:.2f} ms")
    slow = "".join(
        f"\n  {x['request']}: prefill {x['prefill_s'][0]:.3f} vs {x['prefill_s'][1]:.3f} s; threads' extra CPU s: "
        + ", ".join(f"{k} {v:+.3f}" for k, v in x["extra_run_s"].items())
        for x in g.get("slowest_threads", [])
    )
    per_miss = g.get("miss_extra_run_s")
    if per_miss:
        shown = [(k, v) for k, v in per_miss.items() if not k.endswith("(queued)")][:6]
        slow = ("\n  misses' prefill, threads' extra CPU s per miss: " + ", ".join(f"{k} {v:+.3f}" for k, v in shown)
                + slow)
    return f"GIL probe (wake-up lag of a 1 ms sleeper): {runs}{misses}{slow}"


async def _serve_one_process(
    cfg: DemoConfig,
    sessions: list[Session],
    layout: KVLayout,
    config: CacheConfig,
    kv_blocks: int,
    longest: int,
    progress: bool,
) -> Runs:
    """Warm up, serve ``sessions`` from scratch, then through a ``KVCache``, all in this process."""
    device = torch.device(cfg.device)
    model = LlamaModel(cfg.model, device, longest + cfg.gen_tokens)
    kv = model.new_kv_buffer(kv_blocks * cfg.page_tokens)
    chunk = cfg.chunk_tokens or cfg.page_tokens

    # Warm-up outside both timed runs (first-call allocations, kernel selection).
    warm = Engine(model, kv, BlockTable(kv_blocks, cfg.page_tokens, False), None, chunk, 2, keep_logits=False)
    await warm.serve("warmup", "warmup", "warmup", 0, [i % cfg.model.vocab for i in range(min(longest, 4 * chunk))])

    spans: dict[str, tuple[float, float]] = {}

    async def run_scratch(order: list[str] | None) -> tuple[list[RequestResult], float]:
        engine = Engine(model, kv, BlockTable(kv_blocks, cfg.page_tokens, False), None, chunk, cfg.gen_tokens)
        begin = time.perf_counter()
        out = await timed_run(
            engine, sessions, cfg.concurrency, cfg.window, progress_bar("scratch", sessions, progress), order
        )
        spans["scratch"] = (begin, time.perf_counter())
        return out

    when = cfg.scratch_when
    if when is ScratchWhen.BEFORE:
        scratch, wall_scratch = await run_scratch(None)
    async with KVCache(config, layout, kv) as cache:
        # Set-up, not serving: a large pool hands out pages only from chunks already prepared, and
        # the cache's kernel warm-up (started by start) compiles every copy kernel variant of this
        # layout: compiled at the first copy instead, on the loop (~0.5 s on the H200), it made the
        # first cached requests slower than from scratch. (A throwaway cache that served one prompt
        # did this before; wait_warm also covers the variants that prompt did not reach.) The disk
        # tier's io_uring registration pins the pool region by region in the background: awaited
        # too, as an engine started long before its first request would have it done.
        await cache.wait_started()  # set-up: pool chunks, disk registration, kernel warm-up
        if when is ScratchWhen.OPEN:
            scratch, wall_scratch = await run_scratch(None)
        blocks = BlockTable(kv_blocks, cfg.page_tokens, True)
        engine = Engine(model, kv, blocks, cache, chunk, cfg.gen_tokens, prefetch=cfg.prefetch, settle=cfg.settle,
                        load_path=cfg.load_path, claim=cfg.claim)
        # The first run's admission order: each request has the same index and the same requests
        # ahead of it in both runs, so its TTFT compares like for like.
        begin = time.perf_counter()
        cached, wall = await timed_run(
            engine, sessions, cfg.concurrency, cfg.window, progress_bar("cached", sessions, progress),
            None if when is ScratchWhen.AFTER else admission_order(scratch),
        )
        spans["cached"] = (begin, time.perf_counter())
        stats = cache.stats()
    if when is ScratchWhen.AFTER:
        scratch, wall_scratch = await run_scratch(admission_order(cached))
    return Runs(cached, scratch, wall, wall_scratch, stats, spans=spans)


async def _traced_hit(path: Path, hit: Awaitable[RequestResult]) -> None:
    """Await ``hit`` under ``torch.profiler`` (host ops and the device's kernels and copies) and
    write its Chrome trace to ``path``: not timed, the profiler slows the host side."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=activities) as prof:
        r = await hit
    prof.export_chrome_trace(str(path))
    print(f"trace of a pool hit (TTFT {r.ttft_s * 1e3:.1f} ms under the profiler): {path}", file=sys.stderr)


async def _tail_alone(timer: Engine, prompt: list[int], usable: int, slots: torch.Tensor) -> float:
    """Seconds of the prefill of ``prompt[usable:]`` alone, the prefix's K/V already in ``slots``."""
    _sync(timer.kv.device)
    t = time.perf_counter()
    await timer._prefill(prompt, usable, len(prompt), slots, first=True)
    return time.perf_counter() - t


async def _disk_only(config: CacheConfig, layout: KVLayout, kv: torch.Tensor,
                     prefix: list[int]) -> tuple[float, int, Any]:
    """Seconds of ``match`` + plain ``load`` of ``prefix`` from disk into a new cache (an empty pool,
    as after a restart), nothing computed; the tokens loaded and the disk tier's statistics."""
    async with KVCache(config, layout, kv) as cache:
        await cache.wait_started()  # set-up: pool chunks, disk registration, kernel warm-up
        t = time.perf_counter()
        m = await cache.match(prefix, salt="disk")
        loaded = await cache.load(m, torch.arange(m.tokens))
        return time.perf_counter() - t, loaded.tokens, cache.stats().disk


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _median_run(runs: Sequence[RequestResult]) -> RequestResult:
    """The run whose time to first token is the median (of an even count, the faster middle one)."""
    if not runs:
        raise ValueError("no runs")
    ordered = sorted(runs, key=lambda r: r.ttft_s)
    return ordered[(len(ordered) - 1) // 2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memcpy_seconds(nbytes: int, device: torch.device, repeats: int) -> float:
    """Median time of one copy of ``nbytes`` from host memory into ``device`` (pinned on CUDA)."""
    cuda = device.type == "cuda"
    host = torch.ones(max(1, nbytes), dtype=torch.uint8, pin_memory=cuda)
    target = torch.empty_like(host, device=device)
    target.copy_(host, non_blocking=cuda)  # first touch, outside the timing
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        target.copy_(host, non_blocking=cuda)
        _sync(device)
        times.append(time.perf_counter() - t)
    return _median(times)


async def run_ttft(
    cfg: DemoConfig, lengths: list[int], repeats: int, paths: Sequence[LoadPath] | None = None,
    trace_dir: Path | None = None, batch_ab: bool = False,
) -> list[dict[str, Any]]:
    """Time to first token of one prompt per length and load path: prefix from the pool, from disk,
    and recomputed, with each tier's floor measured in the same run. One row per (length, path).

    Baselines per length: ``recompute`` (chunked prefill of the whole prompt), ``tail`` (prefill of
    the uncached tail alone, the prefix already in the buffer), ``memcpy`` (one host->device copy of
    the hit's bytes, pinned on CUDA) and ``disk_only`` (match + plain ``load`` of the prefix from
    disk after a restart, nothing computed). Pool floor: max(memcpy, tail) + tail / layers (the
    tail's last layer cannot start before the load ends); disk bound: 1 / (1/recompute + 1/disk_only),
    the compute-or-load split's ideal meeting point.

    Pool: one cache without a disk tier per path is filled once and serves one untimed hit (the
    cost model learns the pool rate, kernels compile: an engine's steady state), then ``repeats``
    timed hits. Disk: a cache with a disk tier is filled, flushed and closed; each repeat serves
    from a new cache on the same directory (an empty pool and no learned rates, as after a
    restart). Set-up (pool creation, filling) is not timed; each figure is the median of ``repeats``.
    ``tail`` and ``disk_only`` are measured per path, each repeat right before the hit it bounds
    (host speed drifts within a run); ``recompute`` and ``memcpy`` once per length.
    ``trace_dir``: after the timed pool hits, one more (untimed) under ``torch.profiler``, written as
    a Chrome trace ``pool<n>-<path>.json`` there: where the hit's time goes, stream by stream.
    ``batch_ab`` (CUDA): every repeat times two pool hits, each after its own tail, one with run
    copies batched (``cudaMemcpy3DBatchAsync``, ``aiokv.cuda.BatchCopier``) and one without, the
    order alternating; the row's ``batch_ab`` has each side's median hit, tail and hit / floor (its
    usual pool figures then take both sides' hits), the batch calls so far and a batch failure.
    """
    device = torch.device(cfg.device)
    page = cfg.page_tokens
    paths = list(paths or [cfg.load_path])
    # Recompute is a chunked prefill of TTFT_CHUNK tokens (a common engine setting), not one page
    # at a time: the baseline should be a good prefill, not a slow one.
    chunk = cfg.chunk_tokens or max(page, TTFT_CHUNK // page * page)
    longest = max(lengths)
    blocks = -(-(longest + 1) // page)
    model = LlamaModel(cfg.model, device, longest + 1)
    kv = model.new_kv_buffer(blocks * page)
    gen = torch.Generator().manual_seed(cfg.model.seed + 1)
    rows: list[dict[str, Any]] = []
    batched = True
    if batch_ab:
        if device.type != "cuda":
            raise ValueError("--memcpy-batch-ab needs a CUDA device")
        torch.cuda.init()
        batched = aiokv.cuda.batch_copier().enabled  # restored after each A/B
        if not aiokv.cuda.batch_copier().available:
            raise ValueError(f"no cudaMemcpy3DBatchAsync in this CUDA runtime "
                             f"({aiokv.cuda.batch_copier().version}): nothing to compare")

    def engine(cache: KVCache | None, path: LoadPath) -> Engine:
        return Engine(model, kv, BlockTable(blocks, page, False), cache, chunk, 1, load_path=path, claim=cfg.claim)

    async def serve(cache: KVCache | None, path: LoadPath, name: str, salt: str, prompt: list[int]) -> RequestResult:
        return await engine(cache, path).serve(name, salt, "ttft", 0, prompt)

    def first_logits(r: RequestResult) -> torch.Tensor:
        assert r.logits is not None
        return r.logits[0]

    await serve(None, LoadPath.PLAIN, "warmup", "t", [i % cfg.model.vocab for i in range(min(longest, 2 * chunk))])
    tmp = Path(tempfile.mkdtemp(prefix="aiokv-ttft-")) if cfg.disk_dir is None else cfg.disk_dir
    try:
        for n in lengths:
            prompt = torch.randint(0, cfg.model.vocab, (n,), generator=gen).tolist()
            pages = cfg.pool_pages or -(-n // page) + 1
            usable = (n - 1) // page * page  # what a hit can cover: at least one token is computed
            base: dict[str, list[float]] = {"recompute": []}
            logits: dict[str, torch.Tensor] = {}
            for _ in range(repeats):
                r = await serve(None, LoadPath.PLAIN, f"recompute{n}", "recompute", prompt)
                base["recompute"].append(r.ttft_s)
                logits["recompute"] = first_logits(r)
            # The recompute left the prompt's K/V in slots [0, n) (a fresh block table hands out
            # blocks in order), and every hit below writes the same bytes there: the tail prefill
            # alone reads the prefix in place.
            slots = BlockTable(blocks, page, False).slots(list(range(blocks)), n, torch.device("cpu"))
            timer = engine(None, LoadPath.PLAIN)

            layout, _ = _layout_and_config(cfg, pages, None, 0)
            loaded_bytes = usable // page * layout.payload_bytes
            memcpy_s = _memcpy_seconds(loaded_bytes, device, repeats)
            disk_dir = tmp / f"ttft-{n}"
            _, with_disk = _layout_and_config(cfg, pages, disk_dir, 2 * pages, LoadPath.PLAIN)
            async with KVCache(with_disk, layout, kv) as cache:
                await cache.wait_started()  # set-up: pool chunks, disk registration, kernel warm-up
                await serve(cache, LoadPath.PLAIN, f"fill{n}", "disk", prompt)
                await cache.flush()  # every page on disk before the pool goes away

            recompute_s = _median(base["recompute"])
            layers = cfg.model.num_layers
            shared: dict[str, Any] = {
                "prompt_tokens": n, "recompute_s": recompute_s, "memcpy_s": memcpy_s, "loaded_bytes": loaded_bytes,
            }
            for path in paths:
                row: dict[str, Any] = dict(shared, load_path=path.value, claim=cfg.claim.value)
                row["transfer_path"] = str(cfg.transfer_path_for(path))
                runs: dict[str, list[RequestResult]] = {"pool": [], "disk": []}
                # Each hit is timed right after its own baseline (the tail alone before a pool hit, a
                # disk-only load before a disk hit): the host's speed drifts by tens of percent within
                # a minute on the H200's VM (the tail alone took 24-45 ms at 8K between processes),
                # and a floor measured a minute before its hit made the ratio follow the drift.
                tails: list[float] = []
                disk_only_s: list[float] = []
                ab: dict[bool, list[tuple[float, float]]] = {True: [], False: []}  # (tail, hit) per side
                _, pool_cfg = _layout_and_config(cfg, pages, None, 0, path)
                async with KVCache(pool_cfg, layout, kv) as cache:
                    await cache.wait_started()  # set-up: pool chunks, disk registration, kernel warm-up
                    await serve(cache, path, f"fill{n}", "pool", prompt)
                    await serve(cache, path, f"warm{n}", "pool", prompt)
                    for rep in range(repeats):
                        sides: list[bool | None] = [None]
                        if batch_ab:
                            sides = [True, False] if rep % 2 == 0 else [False, True]
                        for side in sides:
                            if side is not None:
                                aiokv.cuda.batch_copier().enabled = side
                            tails.append(await _tail_alone(timer, prompt, usable, slots))
                            runs["pool"].append(await serve(cache, path, f"pool{n}", "pool", prompt))
                            if side is not None:
                                ab[side].append((tails[-1], runs["pool"][-1].ttft_s))
                    if batch_ab:
                        aiokv.cuda.batch_copier().enabled = batched
                    if trace_dir is not None:
                        await _traced_hit(trace_dir / f"pool{n}-{path.value}.json",
                                          serve(cache, path, f"trace{n}", "pool", prompt))
                _, disk_cfg = _layout_and_config(cfg, pages, disk_dir, 2 * pages, path)
                for _ in range(repeats):
                    seconds, disk_only_tokens, disk_stats = await _disk_only(with_disk, layout, kv, prompt[:usable])
                    disk_only_s.append(seconds)
                    async with KVCache(disk_cfg, layout, kv) as cache:
                        await cache.wait_started()  # set-up: pool chunks, disk registration, kernel warm-up
                        runs["disk"].append(await serve(cache, path, f"disk{n}", "disk", prompt))
                tail_s, row["disk_only_s"] = _median(tails), _median(disk_only_s)
                row["tail_s"], row["tail_runs"], row["disk_only_runs"] = tail_s, tails, disk_only_s
                row["disk_only_tokens"] = disk_only_tokens
                # Buffered I/O (no O_DIRECT, e.g. on tmpfs) would read from the page cache, not the device.
                row["disk_backend"] = str(getattr(disk_stats, "backend", None))
                row["disk_direct_io"] = getattr(disk_stats, "direct_io", None)
                row["pool_floor_s"] = max(memcpy_s, tail_s) + tail_s / layers
                row["disk_bound_s"] = 1.0 / (1.0 / recompute_s + 1.0 / row["disk_only_s"])
                # What served the run at the median, not the last: repeats may plan differently (a
                # fresh cache learns the rates again), and the last run's plan beside the median
                # time labelled a 32K split as declined on the H200.
                r = _median_run(runs["pool"])
                row["pool_hit_tokens"] = r.pool_tokens
                row["pool_claimed_tokens"] = r.claimed_tokens
                row["pool_declined_tokens"] = r.declined_tokens
                d = _median_run(runs["disk"])
                row["disk_hit_tokens"] = d.disk_tokens
                row["disk_pool_tokens"] = d.pool_tokens
                row["disk_claimed_tokens"] = d.claimed_tokens
                row["disk_declined_tokens"] = d.declined_tokens
                row["disk_plan"], row["disk_plan_prices"] = d.plan, d.plan_prices
                # Where each pool hit's time went (host clocks): before the prefill (blocks, input
                # staging, match, start_load: ttft - prefill), the prefill until the first token
                # (the tail, waiting on layers), its host-side launch share, the model thread's CPU.
                row["pool_runs"] = [{"s": x.ttft_s, "match_s": x.match_s, "before_prefill_s": x.ttft_s - x.prefill_s,
                                     "prefill_s": x.prefill_s, "launch_s": x.launch_s, "load_wait_s": x.load_s,
                                     "model_cpu_s": x.model_cpu_s, "model_waits": x.model_waits}
                                    for x in runs["pool"]]
                row["disk_runs"] = [{"s": x.ttft_s, "plan": x.plan, "disk_tokens": x.disk_tokens,
                                     "pool_tokens": x.pool_tokens, "claimed_tokens": x.claimed_tokens,
                                     "declined_tokens": x.declined_tokens} for x in runs["disk"]]
                # Every run's first token is checked, not one run's: the farthest from recomputing.
                for tier in ("pool", "disk"):
                    logits[tier] = max((first_logits(x) for x in runs[tier]),
                                       key=lambda t: float((t - logits["recompute"]).abs().max()))
                row["pool_s"] = _median([x.ttft_s for x in runs["pool"]])
                row["disk_s"] = _median([x.ttft_s for x in runs["disk"]])
                row["pool_speedup"] = row["recompute_s"] / row["pool_s"]
                row["disk_speedup"] = row["recompute_s"] / row["disk_s"]
                row["pool_vs_floor"] = row["pool_s"] / row["pool_floor_s"]
                if batch_ab:
                    row["batch_ab"] = {}
                    for side, name in ((True, "batch"), (False, "2d")):
                        side_tail = _median([t for t, _ in ab[side]])
                        side_hit = _median([h for _, h in ab[side]])
                        row["batch_ab"][name] = {
                            "pool_s": side_hit, "tail_s": side_tail, "runs": ab[side],
                            "pool_vs_floor": side_hit / (max(memcpy_s, side_tail) + side_tail / layers),
                        }
                    copier = aiokv.cuda.batch_copier()
                    row["batch_ab"]["batch_calls"] = copier.batch_calls
                    row["batch_ab"]["batch_failure"] = copier.failure
                    on, off = row["batch_ab"]["batch"], row["batch_ab"]["2d"]
                    print(f"  {n:>7} tokens {path.value:>13}: pool hit / floor batched {on['pool_vs_floor']:.2f}x "
                          f"({on['pool_s'] * 1e3:.1f} ms, tail {on['tail_s'] * 1e3:.1f}), 2-D "
                          f"{off['pool_vs_floor']:.2f}x ({off['pool_s'] * 1e3:.1f} ms, "
                          f"tail {off['tail_s'] * 1e3:.1f}); "
                          f"{copier.batch_calls} batch calls so far, failure {copier.failure}", file=sys.stderr)
                row["disk_vs_bound"] = row["disk_s"] / row["disk_bound_s"]
                ref = logits["recompute"]
                row["max_abs_logit_diff"] = max(float((logits[k] - ref).abs().max()) for k in ("pool", "disk"))
                rows.append(row)
                print(
                    f"  {n:>7} tokens {path.value:>13}: recompute {row['recompute_s'] * 1e3:.1f} ms; pool "
                    f"{row['pool_s'] * 1e3:.1f} ms ({row['pool_vs_floor']:.2f}x floor "
                    f"{row['pool_floor_s'] * 1e3:.1f}); disk {row['disk_s'] * 1e3:.1f} ms "
                    f"({row['disk_vs_bound']:.2f}x bound {row['disk_bound_s'] * 1e3:.1f}); hits "
                    f"pool={row['pool_hit_tokens']} disk={row['disk_hit_tokens']}; declined "
                    f"pool={row['pool_declined_tokens']} disk={row['disk_declined_tokens']}; disk plans "
                    f"{'/'.join(str(x['plan']) for x in row['disk_runs'])}",
                    file=sys.stderr,
                )
            shutil.rmtree(disk_dir, ignore_errors=True)
    finally:
        if cfg.disk_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model and workload shape")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--tp", type=int, default=1,
        help="tensor-parallel ranks, one spawned process each (on CUDA all share the device)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), help="model/KV dtype (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="weights and workload seed")
    for name in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab"):
        p.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    p.add_argument("--page-tokens", type=int, help="tokens per page (default: per preset)")
    p.add_argument(
        "--chunk-tokens", type=int, default=0, help="prefill chunk, a multiple of the page (0: a page; 2048 in --ttft)"
    )
    p.add_argument("--gen-tokens", type=int, default=8, help="tokens decoded per request")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight at once")
    p.add_argument("--window", type=int, default=6, help="sessions open at once (users between turns)")
    p.add_argument("--kv-blocks", type=int, default=0, help="KV buffer size in pages (0: from the workload)")
    p.add_argument("--pool-pages", type=int, default=0, help="CPU pool size in pages (0: from the workload)")
    p.add_argument("--disk-bytes", type=int, default=0, help="disk tier budget in bytes (0: twice the working set)")
    p.add_argument("--disk-dir", type=Path, help="disk tier directory (default: a temporary one)")
    p.add_argument("--tenants", type=int, help="override the workload's tenant count")
    p.add_argument("--prefetch", action="store_true", help="prefetch disk pages of queued turns into the pool")
    p.add_argument(
        "--settle", action="store_true",
        help="wait for disk writes after each offload (with --concurrency 1 the tier counts are reproducible)",
    )
    p.add_argument(
        "--load-path", nargs="+", choices=[x.value for x in LoadPath], default=[LoadPath.AUTO.value],
        help="how cache hits reach the KV buffer: plain (await load), split (compute-or-load: the engine "
        "prefills the match from the front while aiokv loads it from the back), layered (the tail prefill "
        "waits per layer), split-layered (both), auto (default: split-layered for hits all in the pool, "
        "split for hits reaching disk). Several compare side by side in --ttft",
    )
    p.add_argument(
        "--claim", choices=[x.value for x in ClaimPolicy], default=ClaimPolicy.AUTO.value,
        help="when a split path claims: auto (when the cost model expects it to pay), always (Cake's dynamic split)",
    )
    p.add_argument(
        "--transfer-path", choices=["auto", *(x.value for x in TransferPath)], default="auto",
        help="aiokv's pool<->GPU path (auto: direct for layer-wise loads on CUDA, else aiokv's default)",
    )
    p.add_argument(
        "--scratch-run", choices=[x.value for x in ScratchWhen], default=ScratchWhen.BEFORE.value,
        help="when the from-scratch run happens: before the cache exists (default), with the cache open and "
        "idle, or after the cached run (a control for what slows the cached run's own compute)",
    )
    p.add_argument("--no-disk", action="store_true", help="the cache without a disk tier (the CPU pool only)")
    p.add_argument(
        "--probe-gil", action="store_true",
        help="sample a sleeping thread's wake-up lag during both runs (how long other threads hold the GIL)",
    )
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG of per-request prefill time and hit sources here")
    p.add_argument("--ttft", action="store_true", help="measure time to first token instead of the workload")
    p.add_argument("--ttft-lengths", default="8192,16384,32768", help="prompt lengths for --ttft")
    p.add_argument("--repeats", type=int, default=3, help="repeats per --ttft measurement (median)")
    p.add_argument("--trace", type=Path, metavar="DIR",
                   help="--ttft: also write a torch.profiler Chrome trace of one extra pool hit per length here")
    p.add_argument("--memcpy-batch-ab", action="store_true",
                   help="--ttft on CUDA: each repeat times a pool hit with run copies batched and one without")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> DemoConfig:
    """The run's configuration from parsed flags."""
    model = preset(a.preset, DTYPES[a.dtype] if a.dtype else None, a.seed)
    overrides = {
        "num_layers": a.layers, "hidden": a.hidden, "num_heads": a.heads, "num_kv_heads": a.kv_heads,
        "intermediate": a.intermediate, "vocab": a.vocab,
    }
    model = replace(model, **{k: v for k, v in overrides.items() if v is not None})
    workload = replace(WORKLOADS[a.preset], seed=a.seed)
    if a.tenants:
        workload = replace(workload, tenants=a.tenants)
    return DemoConfig(
        model=model, workload=workload, device=a.device, page_tokens=a.page_tokens or PAGE_TOKENS[a.preset],
        chunk_tokens=a.chunk_tokens, gen_tokens=a.gen_tokens, concurrency=a.concurrency, window=a.window,
        kv_blocks=a.kv_blocks, pool_pages=a.pool_pages, prefetch=a.prefetch, settle=a.settle,
        disk_bytes=a.disk_bytes,
        disk_dir=a.disk_dir,
        tp=a.tp,
        load_path=LoadPath(a.load_path[0]), claim=ClaimPolicy(a.claim),
        transfer_path=None if a.transfer_path == "auto" else TransferPath(a.transfer_path),
        disk=not a.no_disk, probe_gil=a.probe_gil, scratch_when=ScratchWhen(a.scratch_run),
    )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    cfg = config_from_args(a)
    m = cfg.model
    if cfg.tp < 1:
        raise SystemExit("--tp must be at least 1")
    if a.no_disk and (a.ttft or a.disk_dir is not None or a.disk_bytes):
        raise SystemExit("--no-disk goes with the workload alone, without --disk-dir or --disk-bytes")
    if len(a.load_path) > 1 and not a.ttft:
        raise SystemExit("several --load-path values compare only in --ttft; the workload takes one")
    if cfg.tp > 1:
        if a.ttft:
            raise SystemExit("--ttft runs in one process; drop --tp")
        if cfg.scratch_when is not ScratchWhen.BEFORE:
            raise SystemExit("--scratch-run runs in one process; drop --tp")
        try:
            Shard(0, cfg.tp).check(m)
        except ValueError as exc:
            raise SystemExit(f"--tp {cfg.tp}: {exc}") from None
    print(
        f"model: {m.num_layers} layers, hidden {m.hidden}, {m.num_heads} heads / {m.num_kv_heads} KV heads, "
        f"vocab {m.vocab}, {str(m.dtype).removeprefix('torch.')}, {m.params / 1e6:.1f}M params on {cfg.device}; "
        f"page {cfg.page_tokens} tokens ({m.kv_bytes_per_token() * cfg.page_tokens / 2**10:.0f} KiB)",
        file=sys.stderr,
    )
    if a.ttft:
        lengths = [int(x) for x in a.ttft_lengths.split(",")]
        paths = [LoadPath(x) for x in dict.fromkeys(a.load_path)]
        KVCache.preload(cfg.device)  # before the loop runs: the first start then imports nothing
        rows = asyncio.run(run_ttft(cfg, lengths, a.repeats, paths, a.trace, a.memcpy_batch_ab))
        print(
            f"time to first token, {m.num_layers}L/{m.hidden} {str(m.dtype).removeprefix('torch.')} on {cfg.device}, "
            f"page {cfg.page_tokens}, median of {a.repeats}, claim {cfg.claim.value}"
        )
        print(format_ttft(rows))
        if a.json:
            write_json(a.json, {"config": asdict(cfg), "ttft": rows})
        return 0
    failed: list[Exception] = []
    if cfg.tp == 1:
        KVCache.preload(cfg.device)  # before the loop runs: the first start then imports nothing
    try:
        out = asyncio.run(run_demo(cfg, progress=not a.quiet))
    except* RankFailedError as group:  # a rank process died: nothing to compare, say which
        failed += group.exceptions
    if failed:
        for error in failed:
            print(f"TP RANK FAILED {error}", file=sys.stderr)
        return 2
    disk = f"disk tier {out.disk_bytes >> 20} MiB" if cfg.disk else "no disk tier"
    print(f"KV buffer {out.kv_blocks} pages, CPU pool {out.pool_pages} pages, {disk}; "
          f"hits through {cfg.load_path.value} "
          f"(claim {cfg.claim.value})")
    if cfg.tp > 1:
        print(tp_line(cfg.tp, out.rank_pids, out.rank_workers))
    print(format_table(out.summary, out.stats, out.oracle))
    if (line := probe_line(out.summary)) is not None:
        print(line)
    if a.json:
        scratch = {r.name: r for r in out.scratch}

        def from_scratch(name: str) -> dict[str, Any]:
            r = scratch.get(name)
            return {} if r is None else {f"{k}_scratch": getattr(r, k) for k in SCRATCH_FIELDS}

        write_json(a.json, {
            "config": asdict(cfg), "kv_blocks": out.kv_blocks, "pool_pages": out.pool_pages,
            "disk_bytes": out.disk_bytes,
            "summary": out.summary, "stats": out.stats, "oracle": out.oracle,
            "requests": [
                {f.name: getattr(r, f.name) for f in fields(r) if f.name not in ("logits", "prompt_digest")}
                | from_scratch(r.name) | {"ttft_s_scratch": ratio.scratch_s, "ttft_ratio": ratio.ratio}
                for r, ratio in zip(out.cached, ttft_ratios(out.cached, out.scratch), strict=True)
            ],
        })
    if a.plot:
        title = (f"{m.num_layers}L/{m.hidden} {str(m.dtype).removeprefix('torch.')} on {cfg.device}: "
                 f"{out.summary['requests']} requests, page {cfg.page_tokens}")
        plot(a.plot, out.cached, out.scratch, title)
    for line in out.oracle.mismatches:
        print(f"ORACLE MISMATCH {line}", file=sys.stderr)
    return 1 if out.oracle.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
