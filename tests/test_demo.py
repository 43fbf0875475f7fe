"""The demo inference loop (tools/demo.py) at a tiny size: oracle holds and every tier serves hits."""

from __future__ import annotations

import dataclasses
import multiprocessing
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import demo
import demo_engine
from demo_engine import BlockTable, RequestResult, make_workload
from demo_model import LlamaModel, preset
from demo_report import OracleReport, compare, format_table, summarize

from aiokv import LoadResult, Match
from aiokv.tp import RankStatus
from aiokv.tp.cache import TPCache


def tiny_config(tmp_path: Path, *flags: str) -> demo.DemoConfig:
    # One request at a time and write-behind settled after each: which tier serves what does not
    # depend on how fast the disk is while other processes load the machine.
    args = ["--preset", "tiny", "--disk-dir", str(tmp_path / "disk"), "--concurrency", "1", "--settle", *flags]
    return demo.config_from_args(demo.parse_args(args))


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


@pytest.mark.asyncio
async def test_tiny_demo_on_two_tp_rank_processes_matches_from_scratch(tmp_path: Path) -> None:
    """--tp 2: heads split over two spawned rank processes; the pool serves both ranks, bit-exact."""
    out = await demo.run_demo(tiny_config(tmp_path, "--tp", "2"), progress=False)
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


@pytest.mark.asyncio
async def test_tp_oracle_catches_wrong_bytes_in_one_ranks_heads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pool pages whose rank-1 V head is off by 0.5 reach only rank 1, and still fail the oracle."""
    original = TPCache.load

    async def corrupting_load(
        self: TPCache, match: Match, slots: torch.Tensor, *, from_token: int = 0
    ) -> LoadResult:
        # Page rows are [K0, K1, V0, V1]; with --tp 2 row 3 is rank 1's V head, layer 0, every token.
        self.pool.pages[:, 0, :, 3] += 0.5
        return await original(self, match, slots, from_token=from_token)

    monkeypatch.setattr(TPCache, "load", corrupting_load)
    out = await demo.run_demo(tiny_config(tmp_path, "--tp", "2", "--tenants", "1"), progress=False)
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
    """A load that leaves one wrong value in the KV buffer must fail the oracle, naming the request."""
    original = demo_engine.Engine._load

    async def corrupting_load(
        self: demo_engine.Engine, res: RequestResult, prefix: list[int], slots: torch.Tensor, start: int
    ) -> int:
        end = await original(self, res, prefix, slots, start)
        if end > start:
            self.kv[:, slots[start]] += 0.5
        return end

    monkeypatch.setattr(demo_engine.Engine, "_load", corrupting_load)
    out = await demo.run_demo(tiny_config(tmp_path), progress=False)
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


@pytest.mark.asyncio
async def test_ttft_mode_serves_the_prefix_from_pool_and_disk(tmp_path: Path) -> None:
    # One page per chunk: recomputed and cache-served prompts then prefill the same chunk shapes, so
    # the logits agree bit for bit by construction (with one 2048-token chunk they only happened to).
    cfg = tiny_config(tmp_path, "--chunk-tokens", "8")
    rows = await demo.run_ttft(cfg, [64, 100], repeats=1)
    page = cfg.page_tokens
    for row, n in zip(rows, [64, 100], strict=True):
        usable = (n - 1) // page * page  # at least one token is computed
        assert row["prompt_tokens"] == n
        assert row["pool_hit_tokens"] == usable
        assert row["disk_hit_tokens"] == usable
        assert row["max_abs_logit_diff"] == 0.0
        assert min(row["recompute_s"], row["pool_s"], row["disk_s"]) > 0
