"""The demo inference loop (tools/demo.py) at a tiny size: oracle holds and every tier serves hits."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import demo
import demo_engine
from demo_engine import (
    BlockTable,
    ClaimPolicy,
    Engine,
    LoadPath,
    RequestResult,
    claim_pays,
    claim_size,
    make_workload,
)
from demo_model import LlamaModel, preset
from demo_report import OracleReport, compare, format_table, plot, summarize

from aiokv import KVCache, Match
from aiokv.costs import LoadEstimate
from aiokv.stream import LoadStream
from aiokv.tp import RankStatus
from aiokv.tp.cache import TPCache

# TP runs decode 2 tokens, not 8: each step is a round trip through both ranks (the GPU host spent
# 100-110 s on each of these runs, the longest tests there after the TP layered ones); 2 tokens
# still decode over loaded KV.
TP_SHORT = ("--gen-tokens", "2")


def tiny_config(tmp_path: Path, *flags: str) -> demo.DemoConfig:
    # One request at a time and write-behind settled after each: which tier serves what does not
    # depend on how fast the disk is while other processes load the machine.
    args = ["--preset", "tiny", "--disk-dir", str(tmp_path / "disk"), "--concurrency", "1", "--settle", *flags]
    return demo.config_from_args(demo.parse_args(args))


@pytest.mark.slow
@pytest.mark.asyncio
async def test_tiny_demo_matches_from_scratch_and_uses_every_tier(tmp_path: Path) -> None:
    out = await demo.run_demo(tiny_config(tmp_path), progress=False)
    assert out.oracle.mismatches == ()
    assert out.oracle.logits_bit_exact
    assert out.oracle.compared == len(out.scratch) > 10
    s = out.summary
    assert s["gpu_prefix_tokens"] > 0
    assert s["pool_tokens"] > 0
    assert s["disk_tokens"] > 0
    assert s["lost_tokens"] == 0
    assert s["computed_tokens"] + s["gpu_prefix_tokens"] + s["pool_tokens"] + s["disk_tokens"] == s["prompt_tokens"]
    assert s["computed_tokens_scratch"] == s["prompt_tokens"]
    assert out.stats.bytes_moved["disk_to_pool"] > 0
    assert not any(out.stats.errors.values())
    assert "bit-exact" in format_table(out.summary, out.stats, out.oracle)


@pytest.mark.asyncio
async def test_tiny_demo_with_prefetch_and_bfloat16_stays_exact(tmp_path: Path) -> None:
    out = await demo.run_demo(tiny_config(tmp_path, "--prefetch", "--dtype", "bfloat16"), progress=False)
    assert out.oracle.mismatches == ()
    assert out.oracle.logits_bit_exact
    assert out.summary["pool_tokens"] > 0
    assert out.summary["computed_tokens"] < out.summary["computed_tokens_scratch"]


@pytest.mark.slow(seconds=60)
@pytest.mark.asyncio
async def test_tiny_demo_on_two_tp_rank_processes_matches_from_scratch(tmp_path: Path) -> None:
    """--tp 2: heads split over two spawned rank processes; the pool serves both ranks, bit-exact."""
    out = await demo.run_demo(tiny_config(tmp_path, "--tp", "2", *TP_SHORT), progress=False)
    assert out.oracle.mismatches == ()
    assert out.oracle.logits_bit_exact
    assert out.oracle.compared == len(out.scratch) > 10
    s = out.summary
    assert s["pool_tokens"] > 0  # a load counts only when every rank's copy of its heads completed
    assert s["disk_tokens"] > 0
    assert s["lost_tokens"] == 0
    assert s["computed_tokens"] + s["gpu_prefix_tokens"] + s["pool_tokens"] + s["disk_tokens"] == s["prompt_tokens"]
    assert out.stats.bytes_moved["pool_to_gpu"] > 0
    assert not any(out.stats.errors.values())
    assert [w.rank for w in out.rank_workers] == [0, 1]
    for worker in out.rank_workers:
        assert worker.specs > 0
        assert set(worker.reports) == {RankStatus.OK}
    assert not multiprocessing.active_children()  # every rank process was joined


@pytest.mark.slow(seconds=20)
@pytest.mark.asyncio
async def test_tp_oracle_catches_wrong_bytes_in_one_ranks_heads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pool pages whose rank-1 V head is off by 0.5 reach only rank 1, and still fail the oracle."""
    original = TPCache.start_load

    def corrupting_start_load(self: TPCache, match: Match, slots: torch.Tensor, *, from_token: int = 0,
                              layered: bool = False) -> LoadStream:
        # TP pages are rank-major [parts, L, T, rows/parts, D]; with --tp 2 part 1 is rank 1's
        # [K, V] head: part 1, layer 0, every token, row 1 is its V head.
        assert self.pool.pages.dim() == 6 and self.pool.pages.shape[1] == 2
        self.pool.pages[:, 1, 0, :, 1] += 0.5
        return original(self, match, slots, from_token=from_token, layered=layered)

    monkeypatch.setattr(TPCache, "start_load", corrupting_start_load)
    # Two tenants: with one, the only pool page hit sits in front of disk pages and the split computes it.
    out = await demo.run_demo(tiny_config(tmp_path, "--tp", "2", "--tenants", "2", *TP_SHORT), progress=False)
    assert out.summary["pool_tokens"] > 0
    assert out.oracle.mismatches
    loaded = {r.name for r in out.cached if r.pool_tokens + r.disk_tokens}
    assert any(m.split(":")[0] in loaded for m in out.oracle.mismatches)
    assert not multiprocessing.active_children()


def test_oracle_names_the_request_that_differs() -> None:
    def result(name: str, logits: torch.Tensor, generated: list[int]) -> RequestResult:
        return RequestResult(name, "t", "chat", 0, 10, generated=generated, logits=logits, prompt_digest=b"p")

    base = [result("a", torch.zeros(2, 4), [1, 2]), result("b", torch.zeros(2, 4), [3, 4])]
    same = [dataclasses.replace(r) for r in base]
    assert compare(same, base, exact=True).mismatches == ()
    nudged = torch.zeros(2, 4)
    nudged[1, 3] = 1e-6
    off = [base[0], result("b", nudged, [3, 4])]
    report = compare(off, base, exact=True)
    assert len(report.mismatches) == 1
    assert report.mismatches[0].startswith("b:")
    # On a GPU only the tokens must agree; the logit difference is reported.
    gpu = compare(off, base, exact=False)
    assert gpu.mismatches == ()
    assert gpu.max_abs_logit_diff == pytest.approx(1e-6)
    wrong = [base[0], result("b", torch.zeros(2, 4), [3, 5])]
    assert compare(wrong, base, exact=False).mismatches[0].startswith("b:")


def test_prefill_from_copied_prefix_is_bit_exact() -> None:
    cfg = preset("tiny")
    model = LlamaModel(cfg, torch.device("cpu"), 128)
    tokens = torch.randint(0, cfg.vocab, (45,), generator=torch.Generator().manual_seed(3))
    page = 8
    kv_a, kv_b = model.new_kv_buffer(64), model.new_kv_buffer(64)
    slots_a, slots_b = torch.arange(45), torch.randperm(64)[:45]
    for s in range(0, 45, page):
        logits_a = model.forward(tokens[s : s + page], s, slots_a[: s + page], kv_a)
    hit = 4 * page
    kv_b[:, slots_b[:hit]] = kv_a[:, slots_a[:hit]]
    for s in range(hit, 45, page):
        logits_b = model.forward(tokens[s : s + page], s, slots_b[: s + page], kv_b)
    assert torch.equal(logits_a, logits_b)
    assert torch.equal(kv_a[:, slots_a], kv_b[:, slots_b])


def test_block_table_reuses_prefix_and_evicts_lru() -> None:
    table = BlockTable(num_blocks=4, block_tokens=2, prefix_reuse=True)
    got = table.try_acquire([b"k0", b"k1"], 3)
    assert got == ([], [0, 1, 2])
    table.publish([0, 1], [b"k0", b"k1"])
    assert table.try_acquire([], 2) is None  # one block free, three referenced
    table.release([0, 1, 2])
    hits, new = table.try_acquire([b"k0", b"k1", b"k2"], 3) or ([], [])
    assert hits == [0, 1]
    assert len(new) == 1
    table.release(hits + new)
    # Needing all four blocks evicts the cached ones (LRU) and forgets their keys.
    assert table.try_acquire([], 4) is not None
    assert table.evictions == 2
    assert table.try_acquire([b"k0"], 0) == ([], [])
    assert table.slots([3, 1], 3, torch.device("cpu")).tolist() == [6, 7, 2]


def test_workload_shares_documents_within_a_tenant_only() -> None:
    sessions = make_workload(demo.WORKLOADS["tiny"], vocab=256)
    docs = [s for s in sessions if s.kind.value == "doc"]
    by_doc: dict[str, set[tuple[int, ...]]] = {}
    for s in docs:
        key = s.name.rsplit("/", 1)[0]
        by_doc.setdefault(key, set()).add(s.texts[0][:100])
    assert all(len(v) == 1 for v in by_doc.values())  # the readers of one document share its text
    assert len({s.tenant for s in sessions}) == demo.WORKLOADS["tiny"].tenants
    assert sessions == make_workload(demo.WORKLOADS["tiny"], vocab=256)  # deterministic


@pytest.mark.asyncio
async def test_oracle_catches_a_corrupted_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain load that leaves one wrong value in the KV buffer must fail the oracle, naming the request."""
    original = demo_engine.Engine._load

    async def corrupting_load(
        self: demo_engine.Engine, res: RequestResult, prefix: list[int], slots: torch.Tensor, start: int
    ) -> int:
        end = await original(self, res, prefix, slots, start)
        if end > start:
            self.kv[:, slots[start]] += 0.5
        return end

    monkeypatch.setattr(demo_engine.Engine, "_load", corrupting_load)
    out = await demo.run_demo(tiny_config(tmp_path, "--load-path", "plain", "--tenants", "1"), progress=False)
    assert out.summary["pool_tokens"] + out.summary["disk_tokens"] > 0
    assert out.oracle.mismatches
    loaded = {r.name for r in out.cached if r.pool_tokens + r.disk_tokens}
    assert any(m.split(":")[0] in loaded for m in out.oracle.mismatches)


def test_main_exits_nonzero_on_a_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def failing(cfg: demo.DemoConfig, progress: bool = True) -> demo.DemoOutcome:
        oracle = OracleReport(1, ("tenant0/chat0/turn1: final logits differ (max abs diff 0.1)",), 0.1, False)
        summary = summarize([], [], 1.0, 2.0)
        return demo.DemoOutcome([], [], summary, None, oracle, 4, 4, 1 << 20)

    monkeypatch.setattr(demo, "run_demo", failing)
    assert demo.main(["--preset", "tiny", "--quiet"]) == 1
    assert "ORACLE MISMATCH tenant0/chat0/turn1" in capsys.readouterr().err


def test_ttft_mode_serves_the_prefix_from_pool_and_disk_beside_floors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One page per chunk: recomputed and cache-served prompts then prefill the same chunk shapes, so
    # the logits agree bit for bit by construction (with one 2048-token chunk they only happened to).
    out = tmp_path / "ttft.json"
    argv = ["--preset", "tiny", "--disk-dir", str(tmp_path / "disk"), "--ttft", "--ttft-lengths", "64,100",
            "--chunk-tokens", "8", "--repeats", "3", "--load-path", "plain", "auto", "--json", str(out)]
    assert demo.main(argv) == 0
    printed = capsys.readouterr().out
    assert "floor = max(memcpy of the loaded bytes, tail prefill alone) + one layer" in printed
    assert "bound = 1 / (1/recompute + 1/disk-only load)" in printed
    rows = json.loads(out.read_text())["ttft"]
    assert [(r["prompt_tokens"], r["load_path"]) for r in rows] == [
        (64, "plain"), (64, "auto"), (100, "plain"), (100, "auto")]
    page = 8
    for row in rows:
        n = row["prompt_tokens"]
        usable = (n - 1) // page * page  # at least one token is computed
        # Every matched token is loaded, (split) computed by the engine, or recomputed where the cost
        # model expected no gain; the disk tier holds them all.
        assert row["pool_hit_tokens"] + row["pool_claimed_tokens"] + row["pool_declined_tokens"] == usable
        assert (row["disk_hit_tokens"] + row["disk_pool_tokens"] + row["disk_claimed_tokens"]
                + row["disk_declined_tokens"]) == usable
        assert row["disk_only_tokens"] == usable
        assert row["max_abs_logit_diff"] == 0.0
        assert min(row["recompute_s"], row["pool_s"], row["disk_s"], row["tail_s"], row["disk_only_s"]) > 0
        # Each hit's baseline is timed beside it, per path: one tail and one disk-only load per repeat.
        assert len(row["tail_runs"]) == len(row["disk_only_runs"]) == len(row["disk_runs"]) == 3
        assert row["tail_s"] == statistics.median(row["tail_runs"])
        assert row["disk_only_s"] == statistics.median(row["disk_only_runs"])
        assert row["pool_floor_s"] == pytest.approx(
            max(row["memcpy_s"], row["tail_s"]) + row["tail_s"] / demo.PRESETS["tiny"].num_layers)
        assert row["disk_bound_s"] == pytest.approx(1 / (1 / row["recompute_s"] + 1 / row["disk_only_s"]))
        assert row["pool_vs_floor"] == pytest.approx(row["pool_s"] / row["pool_floor_s"])
        assert row["disk_vs_bound"] == pytest.approx(row["disk_s"] / row["disk_bound_s"])
        assert f"{row['pool_vs_floor']:.2f}x" in printed
        assert f"{row['disk_vs_bound']:.2f}x" in printed
        # The labels are those of the run at the median time, not of the last run (repeats may plan
        # differently: the H200's 32K disk hit read "declined" beside a median set by splits).
        disk_runs = sorted(row["disk_runs"], key=lambda x: x["s"])
        assert len(disk_runs) == 3 and row["disk_s"] == pytest.approx(disk_runs[1]["s"])
        median_run = disk_runs[1]
        # Each pool hit's breakdown adds up: the time before its prefill plus the prefill is its TTFT.
        assert len(row["pool_runs"]) == 3 and row["pool_s"] == statistics.median(x["s"] for x in row["pool_runs"])
        for x in row["pool_runs"]:
            assert x["before_prefill_s"] + x["prefill_s"] == pytest.approx(x["s"])
            assert 0 < x["match_s"] < x["before_prefill_s"] and 0 < x["launch_s"] <= x["prefill_s"]
        assert (row["disk_plan"], row["disk_hit_tokens"], row["disk_pool_tokens"], row["disk_claimed_tokens"],
                row["disk_declined_tokens"]) == (median_run["plan"], median_run["disk_tokens"],
                                                 median_run["pool_tokens"], median_run["claimed_tokens"],
                                                 median_run["declined_tokens"])
    assert rows[0]["pool_claimed_tokens"] == rows[0]["disk_claimed_tokens"] == 0  # plain never claims


@pytest.mark.slow
@pytest.mark.asyncio
async def test_split_path_is_bit_exact_with_tokens_from_pool_disk_and_the_engine(tmp_path: Path) -> None:
    """--claim always: the engine computes the front of every streamed hit, the cache loads the back."""
    out = await demo.run_demo(tiny_config(tmp_path, "--load-path", "split", "--claim", "always"), progress=False)
    assert out.oracle.mismatches == ()
    assert out.oracle.logits_bit_exact
    s = out.summary
    assert s["claimed_tokens"] > 0
    assert s["pool_tokens"] > 0
    assert s["disk_tokens"] > 0
    assert s["lost_tokens"] == 0
    assert s["computed_tokens"] + s["gpu_prefix_tokens"] + s["pool_tokens"] + s["disk_tokens"] == s["prompt_tokens"]
    # A claim starts where the GPU prefix ends: hits the engine computed itself went on from the front.
    assert all(r.claimed_tokens % 8 == 0 and r.claimed_tokens <= r.computed_tokens for r in out.cached)
    assert not any(out.stats.errors.values())
    assert 0 <= s["slower_requests"] <= s["compared_ttft"] == len(out.cached)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_oracle_catches_wrong_bytes_served_by_a_layered_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pool pages off by 0.5 in one K row reach the tail prefill through the per-layer waits: the oracle fails."""
    original = KVCache.start_load
    layered_hits: list[int] = []

    async def corrupting_start_load(
        self: KVCache, match: Match, slots: torch.Tensor, *, from_token: int = 0, layered: bool = False
    ) -> LoadStream:
        if layered:  # the default path loads a hit all in the pool layer by layer
            layered_hits.append(match.tokens)
            self.pool.pages[:, 1, :, 0] += 0.5  # layer 1 (the last), K head 0, every token of every page
        return await original(self, match, slots, from_token=from_token, layered=layered)

    monkeypatch.setattr(KVCache, "start_load", corrupting_start_load)
    out = await demo.run_demo(tiny_config(tmp_path, "--tenants", "2"), progress=False)
    assert layered_hits
    assert out.summary["pool_tokens"] > 0
    assert out.oracle.mismatches
    loaded = {r.name for r in out.cached if r.pool_tokens + r.disk_tokens}
    assert any(m.split(":")[0] in loaded for m in out.oracle.mismatches)


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[4096 + 10] ^= 0xFF  # a payload byte (after the 4096-byte header)
    path.write_bytes(bytes(data))


@pytest.mark.asyncio
@pytest.mark.parametrize("path", [LoadPath.LAYERED, LoadPath.SPLIT_LAYERED])
async def test_a_corrupt_disk_page_leaves_the_prefix_below_it_to_the_engine(tmp_path: Path, path: LoadPath) -> None:
    """The stream stops at a page that fails its checksum; the engine computes what lies below: still exact."""
    cfg = tiny_config(tmp_path)
    page, blocks, n = cfg.page_tokens, 16, 100
    model = LlamaModel(cfg.model, torch.device("cpu"), blocks * page)
    kv = model.new_kv_buffer(blocks * page)
    prompt = torch.randint(0, cfg.model.vocab, (n,), generator=torch.Generator().manual_seed(5)).tolist()

    def engine(cache: KVCache | None) -> Engine:
        return Engine(model, kv, BlockTable(blocks, page, False), cache, page, 2, load_path=path,
                      claim=ClaimPolicy.ALWAYS)

    reference = await engine(None).serve("reference", "t", "x", 0, prompt)
    layout, config = demo._layout_and_config(cfg, blocks, tmp_path / "disk", 2 * blocks, path)
    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        await engine(cache).serve("fill", "t", "x", 0, prompt)
        await cache.flush()
        assert cache.disk is not None
        victim = Path(cache.disk.files.path(cache.keys(prompt, salt="t")[7]))
    _flip_payload_byte(victim)
    async with KVCache(config, layout, kv) as cache:  # restarted: every hit comes from disk
        await cache.pool.wait_ready()
        served = await engine(cache).serve("served", "t", "x", 0, prompt)
        shortened = cache.stats().errors.get("load_shortened", 0)
    usable = (n - 1) // page * page
    if path.claims:  # the loader stopped at the corrupt page, or the engine's claims passed it first
        assert shortened == 1 or (shortened == 0 and served.claimed_tokens >= 8 * page), (shortened, served)
    else:
        assert shortened == 1
    assert served.computed_tokens == n - served.disk_tokens
    assert served.disk_tokens + served.claimed_tokens + served.lost_tokens == usable
    if path.claims:  # the engine's claims may also have reached above the corrupt page first
        assert served.disk_tokens <= usable - 8 * page
    else:
        assert served.disk_tokens == usable - 8 * page  # the pages above the corrupt one
        assert served.lost_tokens == 8 * page
    assert served.generated == reference.generated
    assert served.logits is not None and reference.logits is not None
    assert torch.equal(served.logits, reference.logits)


def test_claims_pay_unless_a_layer_wise_load_hides_behind_the_tail_or_the_load_is_far_faster() -> None:
    page, pages = 256, 31
    shape = {"share": 1.0, "tail_tokens": 256, "match_tokens": page * pages, "page_tokens": page}
    # 8B-like rates on an H200: a pool hit loads in ~21 ms, recomputing it takes ~300 ms.
    pool = LoadEstimate(0.021, 0.0, 0.30, 2 * page)
    assert not claim_pays(pool, **shape, layered=True, disk=False)  # the tail prefill hides the load
    # Whole pages: the fronts would meet a page (~10 ms) into a 21 ms load, saving ~1.5 ms at best.
    assert not claim_pays(pool, **shape, layered=False, disk=False)
    disk = LoadEstimate(0.021, 0.48, 0.30, 18 * page)  # a disk hit: slower than recomputing
    assert claim_pays(disk, **shape, layered=True, disk=True)
    assert claim_pays(disk, **shape, layered=False, disk=True)
    unknown = LoadEstimate(None, None, 0.30, None)  # a new cache: claim for disk hits only
    assert claim_pays(unknown, **shape, layered=True, disk=True)
    assert not claim_pays(unknown, **shape, layered=True, disk=False)


def test_claims_are_sized_to_where_the_fronts_meet() -> None:
    grid = {"page": 8, "chunk": 64}
    # Before both paces are known: one page (a long first chunk would race a load it cannot see).
    assert claim_size(gap=200, loaded=0, load_s=0.01, computed=0, compute_s=0.0, **grid) == 8
    assert claim_size(gap=200, loaded=16, load_s=0.01, computed=0, compute_s=0.01, **grid) == 8
    # Equal paces: half the gap, capped at a chunk; a fast load leaves one page; the grid holds.
    assert claim_size(gap=80, loaded=16, load_s=0.01, computed=16, compute_s=0.01, **grid) == 40
    assert claim_size(gap=800, loaded=16, load_s=0.01, computed=16, compute_s=0.01, **grid) == 64
    assert claim_size(gap=80, loaded=160, load_s=0.01, computed=8, compute_s=0.01, **grid) == 8


def test_summary_counts_requests_slower_with_the_cache_and_the_plot_marks_them(tmp_path: Path) -> None:
    def result(name: str, index: int, ttft: float) -> RequestResult:
        return RequestResult(name, "t", "chat", index, 16, ttft_s=ttft, pool_tokens=8, computed_tokens=8)

    scratch = [result("a", 0, 0.10), result("b", 1, 0.10), result("c", 2, 0.10), result("d", 3, 0.10)]
    cached = [result("a", 0, 0.05), result("b", 1, 0.105), result("c", 2, 0.20), result("d", 3, 0.10)]
    s = summarize(cached, scratch, 1.0, 1.0)
    assert s["slower_requests"] == 2
    assert s["slower_fraction"] == 0.5
    assert s["slower_beyond_noise"] == 1
    assert s["slower_names"] == ["b", "c"]
    assert s["worst_ttft_ratio"] == pytest.approx(2.0)
    assert s["worst_request"] == "c"
    table = format_table(s, None, OracleReport(4, (), 0.0, True))
    assert "2/4 (50%)" in table
    assert "2.00x" in table
    png = tmp_path / "requests.png"
    plot(png, cached, scratch, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_paths_name_their_parts() -> None:
    assert [p for p in LoadPath if p.claims] == [LoadPath.SPLIT, LoadPath.SPLIT_LAYERED, LoadPath.AUTO]
    assert [p for p in LoadPath if p.layered_for(True)] == [LoadPath.LAYERED, LoadPath.SPLIT_LAYERED]
    assert [p for p in LoadPath if p.layered_for(False)] == [LoadPath.LAYERED, LoadPath.SPLIT_LAYERED, LoadPath.AUTO]
    assert [p.without_layers() for p in LoadPath] == [LoadPath.PLAIN, LoadPath.SPLIT, LoadPath.PLAIN,
                                                      LoadPath.SPLIT, LoadPath.SPLIT]
    with pytest.raises(SystemExit, match="only in --ttft"):
        demo.main(["--preset", "tiny", "--load-path", "plain", "split"])
