"""aiokv's demo inference loop: a Llama-shaped model served from one asyncio loop over aiokv's tiers.

Runs a multi-tenant workload (multi-turn chats, long documents read by several users) twice: from
scratch, then with the GPU prefix cache and aiokv's CPU pool and disk tier; checks every request
against the from-scratch run (tokens identical, logits bit-exact on CPU, their largest difference
reported on a GPU; a mismatch exits 1 naming the request) and prints where prompt tokens came
from. ``--ttft`` instead measures time to first token for long prompts served from the pool, from
disk, and recomputed.

Only prompt pages are offloaded: answer tokens' K/V come from one-token decode steps, whose
arithmetic differs from a prefill chunk's, so serving them would break bit-exactness.

    .venv/bin/python tools/demo.py                                   # CPU, about 1.5 minutes
    .venv/bin/python tools/demo.py --tp 2                            # heads over 2 rank processes (CPU)
    .venv/bin/python tools/demo.py --preset 8b --device cuda         # H200
    .venv/bin/python tools/demo.py --preset 8b --device cuda --ttft  # headline TTFT table
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from aiokv import CacheConfig, CacheStatistics, KVCache, KVLayout
from aiokv.tp import WorkerStatistics

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_engine import (
    BlockTable,
    Engine,
    RequestResult,
    Runs,
    Session,
    WorkloadConfig,
    make_workload,
    timed_run,
)
from demo_model import PRESETS, LlamaModel, ModelConfig, Shard, preset
from demo_report import OracleReport, compare, format_table, plot, progress_bar, summarize, tp_line, write_json
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
KV_FACTOR = 1.0
POOL_FACTOR = 0.25
TTFT_CHUNK = 2048


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
    cfg: DemoConfig, pool_pages: int, disk_dir: Path | None, disk_pages: int
) -> tuple[KVLayout, CacheConfig]:
    m = cfg.model
    layout = KVLayout.mha(
        num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype=m.dtype,
        page_tokens=cfg.page_tokens,
    )
    config = CacheConfig(
        cpu_bytes=pool_pages * layout.page_bytes, disk_dir=disk_dir,
        disk_bytes=cfg.disk_bytes or max(1, disk_pages) * layout.page_bytes,
        namespace=cfg.namespace,
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
    if disk_dir is None:
        tmp = disk_dir = Path(tempfile.mkdtemp(prefix="aiokv-demo-"))
    try:
        layout, config = _layout_and_config(cfg, pool_pages, disk_dir, disk_pages)
        if cfg.tp > 1:
            runs = await serve_tp(cfg, sessions, layout, config, kv_blocks, longest, progress)
        else:
            runs = await _serve_one_process(cfg, sessions, layout, config, kv_blocks, longest, progress)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    # Bit-exact needs the same chunk shapes with and without hits (one page per chunk) and the CPU.
    oracle = compare(runs.cached, runs.scratch, exact=device.type == "cpu" and chunk == cfg.page_tokens)
    summary = summarize(runs.cached, runs.scratch, runs.wall, runs.wall_scratch)
    return DemoOutcome(
        runs.cached, runs.scratch, summary, runs.stats, oracle, kv_blocks, pool_pages, config.disk_bytes,
        runs.rank_pids, runs.rank_workers,
    )


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

    scratch_engine = Engine(model, kv, BlockTable(kv_blocks, cfg.page_tokens, False), None, chunk, cfg.gen_tokens)
    scratch, wall_scratch = await timed_run(
        scratch_engine, sessions, cfg.concurrency, cfg.window, progress_bar("scratch", sessions, progress)
    )
    async with KVCache(config, layout, kv) as cache:
        # Set-up, not serving: a large pool hands out pages only from chunks already prepared.
        await cache.pool.wait_ready()
        blocks = BlockTable(kv_blocks, cfg.page_tokens, True)
        engine = Engine(model, kv, blocks, cache, chunk, cfg.gen_tokens, prefetch=cfg.prefetch, settle=cfg.settle)
        cached, wall = await timed_run(
            engine, sessions, cfg.concurrency, cfg.window, progress_bar("cached", sessions, progress)
        )
        stats = cache.stats()
    return Runs(cached, scratch, wall, wall_scratch, stats)


async def run_ttft(cfg: DemoConfig, lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    """Time to first token of one prompt per length: prefix from the pool, from disk, and recomputed.

``--tp N`` splits the model's heads and MLP columns over N spawned rank processes that combine their
partial sums with a gloo all-reduce and keep their own KV buffer slice, under one ``TPCache`` in
this (scheduler) process; both runs use the same split, so the oracle stays bit-exact on CPU
(``demo_tp.py``).

    Pool: one cache without a disk tier is filled once, then the prompt is served ``repeats``
    times. Disk: a cache with a disk tier is filled, flushed and closed; each repeat serves from a
    new cache on the same directory (an empty pool, as after a restart). Set-up (pool creation,
    filling) is not timed; each figure is the median of ``repeats``.
    """
    device = torch.device(cfg.device)
    page = cfg.page_tokens
    # Recompute is a chunked prefill of TTFT_CHUNK tokens (a common engine setting), not one page
    # at a time: the baseline should be a good prefill, not a slow one.
    chunk = cfg.chunk_tokens or max(page, TTFT_CHUNK // page * page)
    longest = max(lengths)
    blocks = -(-(longest + 1) // page)
    model = LlamaModel(cfg.model, device, longest + 1)
    kv = model.new_kv_buffer(blocks * page)
    gen = torch.Generator().manual_seed(cfg.model.seed + 1)
    rows: list[dict[str, Any]] = []

    async def serve(cache: KVCache | None, name: str, salt: str, prompt: list[int]) -> RequestResult:
        engine = Engine(model, kv, BlockTable(blocks, page, False), cache, chunk, 1)
        return await engine.serve(name, salt, "ttft", 0, prompt)

    def first_logits(r: RequestResult) -> torch.Tensor:
        assert r.logits is not None
        return r.logits[0]

    await serve(None, "warmup", "t", [i % cfg.model.vocab for i in range(min(longest, 2 * chunk))])
    tmp = Path(tempfile.mkdtemp(prefix="aiokv-ttft-")) if cfg.disk_dir is None else cfg.disk_dir
    try:
        for n in lengths:
            prompt = torch.randint(0, cfg.model.vocab, (n,), generator=gen).tolist()
            pages = cfg.pool_pages or -(-n // page) + 1
            row: dict[str, Any] = {"prompt_tokens": n}
            times: dict[str, list[float]] = {"recompute": [], "pool": [], "disk": []}
            logits: dict[str, torch.Tensor] = {}
            for _ in range(repeats):
                r = await serve(None, f"recompute{n}", "recompute", prompt)
                times["recompute"].append(r.ttft_s)
                logits["recompute"] = first_logits(r)
            layout, pool_only = _layout_and_config(cfg, pages, None, 0)
            async with KVCache(pool_only, layout, kv) as cache:
                await cache.pool.wait_ready()
                await serve(cache, f"fill{n}", "pool", prompt)
                for _ in range(repeats):
                    r = await serve(cache, f"pool{n}", "pool", prompt)
                    times["pool"].append(r.ttft_s)
                row["pool_hit_tokens"] = r.pool_tokens
                logits["pool"] = first_logits(r)
            disk_dir = tmp / f"ttft-{n}"
            _, with_disk = _layout_and_config(cfg, pages, disk_dir, 2 * pages)
            async with KVCache(with_disk, layout, kv) as cache:
                await cache.pool.wait_ready()
                await serve(cache, f"fill{n}", "disk", prompt)
                await cache.flush()  # every page on disk before the pool goes away
            for _ in range(repeats):
                async with KVCache(with_disk, layout, kv) as cache:
                    await cache.pool.wait_ready()
                    r = await serve(cache, f"disk{n}", "disk", prompt)
                    times["disk"].append(r.ttft_s)
                    disk_stats = cache.stats().disk
            # Buffered I/O (no O_DIRECT, e.g. on tmpfs) would read from the page cache, not the device.
            row["disk_backend"] = str(getattr(disk_stats, "backend", None))
            row["disk_direct_io"] = getattr(disk_stats, "direct_io", None)
            row["disk_hit_tokens"] = r.disk_tokens
            row["disk_pool_tokens"] = r.pool_tokens
            logits["disk"] = first_logits(r)
            shutil.rmtree(disk_dir, ignore_errors=True)
            for k, v in times.items():
                row[f"{k}_s"] = sorted(v)[len(v) // 2]
            row["pool_speedup"] = row["recompute_s"] / row["pool_s"]
            row["disk_speedup"] = row["recompute_s"] / row["disk_s"]
            ref = logits["recompute"]
            row["max_abs_logit_diff"] = max(float((logits[k] - ref).abs().max()) for k in ("pool", "disk"))
            rows.append(row)
            print(
                f"  {n:>7} tokens: recompute {row['recompute_s'] * 1e3:9.1f} ms  pool {row['pool_s'] * 1e3:9.1f} ms "
                f"({row['pool_speedup']:.1f}x)  disk {row['disk_s'] * 1e3:9.1f} ms ({row['disk_speedup']:.1f}x)  "
                f"hits pool={row['pool_hit_tokens']} disk={row['disk_hit_tokens']}",
                file=sys.stderr,
            )
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
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG of per-request prefill time and hit sources here")
    p.add_argument("--ttft", action="store_true", help="measure time to first token instead of the workload")
    p.add_argument("--ttft-lengths", default="8192,16384,32768", help="prompt lengths for --ttft")
    p.add_argument("--repeats", type=int, default=3, help="repeats per --ttft measurement (median)")
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
    )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    cfg = config_from_args(a)
    m = cfg.model
    if cfg.tp < 1:
        raise SystemExit("--tp must be at least 1")
    if cfg.tp > 1:
        if a.ttft:
            raise SystemExit("--ttft runs in one process; drop --tp")
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
        rows = asyncio.run(run_ttft(cfg, lengths, a.repeats))
        print(
            f"time to first token, {m.num_layers}L/{m.hidden} {str(m.dtype).removeprefix('torch.')} on {cfg.device}, "
            f"page {cfg.page_tokens}, median of {a.repeats}"
        )
        if rows:
            print(f"  disk tier: {rows[0]['disk_backend']}, O_DIRECT={rows[0]['disk_direct_io']}")
        print(
            f"  {'prompt':>8} {'recompute ms':>13} {'pool ms':>9} {'speedup':>8} {'disk ms':>9} {'speedup':>8}"
            f" {'pool hit':>9} {'disk hit':>9} {'max |dlogit|':>13}"
        )
        for r in rows:
            print(
                f"  {r['prompt_tokens']:>8} {r['recompute_s'] * 1e3:>13.1f} {r['pool_s'] * 1e3:>9.1f} "
                f"{r['pool_speedup']:>7.1f}x {r['disk_s'] * 1e3:>9.1f} {r['disk_speedup']:>7.1f}x"
                f" {r['pool_hit_tokens']:>9} {r['disk_hit_tokens']:>9} {r['max_abs_logit_diff']:>13.3g}"
            )
        if a.json:
            write_json(a.json, {"config": asdict(cfg), "ttft": rows})
        return 0
    failed: list[Exception] = []
    try:
        out = asyncio.run(run_demo(cfg, progress=not a.quiet))
    except* RankFailedError as group:  # a rank process died: nothing to compare, say which
        failed += group.exceptions
    if failed:
        for error in failed:
            print(f"TP RANK FAILED {error}", file=sys.stderr)
        return 2
    print(f"KV buffer {out.kv_blocks} pages, CPU pool {out.pool_pages} pages, disk tier {out.disk_bytes >> 20} MiB")
    if cfg.tp > 1:
        print(tp_line(cfg.tp, out.rank_pids, out.rank_workers))
    print(format_table(out.summary, out.stats, out.oracle))
    if a.json:
        write_json(a.json, {
            "config": asdict(cfg), "kv_blocks": out.kv_blocks, "pool_pages": out.pool_pages,
            "disk_bytes": out.disk_bytes,
            "summary": out.summary, "stats": out.stats, "oracle": out.oracle,
            "requests": [{f.name: getattr(r, f.name) for f in fields(r) if f.name not in ("logits", "prompt_digest")}
                         for r in out.cached],
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
