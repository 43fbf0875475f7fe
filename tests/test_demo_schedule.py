"""The demo's two runs compare request by request: same admission order, same work, own prefill apart."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from demo_engine import (
    BlockTable,
    Engine,
    RequestResult,
    Session,
    SessionKind,
    admission_order,
    request_names,
    run_sessions,
)
from demo_model import LlamaModel, preset
from demo_report import OracleReport, compare_misses, format_table, summarize

PAGE = 8


class GatedEngine(Engine):
    """The real engine; ``held`` starts only once ``until`` finished (a slower request, on demand)."""

    def __init__(self, held: str | None, until: str | None) -> None:
        cfg = preset("tiny")
        model = LlamaModel(cfg, torch.device("cpu"), 128)
        super().__init__(model, model.new_kv_buffer(16 * PAGE), BlockTable(16, PAGE, False), None, PAGE, 2)
        self.held, self.until = held, until
        self.released = asyncio.Event()

    async def serve(self, name: str, tenant: str, kind: str, index: int, prompt: list[int]) -> RequestResult:
        if name == self.held:
            await self.released.wait()
        try:
            return await super().serve(name, tenant, kind, index, prompt)
        finally:
            if name == self.until:
                self.released.set()


def two_sessions() -> list[Session]:
    def text(seed: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(seed)).tolist())

    return [Session(f"s{i}", "t", SessionKind.CHAT, (text(2 * i), text(2 * i + 1))) for i in range(2)]


async def serve(engine: Engine, order: list[str] | None = None) -> list[RequestResult]:
    return await run_sessions(engine, two_sessions(), concurrency=2, window=2, on_done=lambda r: None, order=order)


@pytest.mark.asyncio
async def test_a_replayed_order_admits_requests_as_the_recorded_run_did() -> None:
    # Two sessions in flight: whichever first turn finishes first queues its second turn first.
    free = await serve(GatedEngine(None, None))
    assert admission_order(free) == ["s0/turn0", "s1/turn0", "s0/turn1", "s1/turn1"]
    # s0's first turn held until s1's is done: left alone, the order follows the finishing order...
    held = await serve(GatedEngine("s0/turn0", "s1/turn0"))
    assert admission_order(held) == ["s0/turn0", "s1/turn0", "s1/turn1", "s0/turn1"]
    # ...replayed, the held run admits as the free run did: same index per request.
    replayed = await serve(GatedEngine("s0/turn0", "s1/turn0"), admission_order(free))
    assert admission_order(replayed) == admission_order(free)
    assert {r.name: r.index for r in replayed} == {r.name: r.index for r in free}
    assert summarize(replayed, free, 1.0, 1.0)["admitted_elsewhere"] == 0
    assert summarize(held, free, 1.0, 1.0)["admitted_elsewhere"] == 2
    # Same tokens whatever the order (no cache: nothing else differs).
    assert {r.name: r.generated for r in replayed} == {r.name: r.generated for r in free}


@pytest.mark.asyncio
async def test_an_order_that_does_not_name_every_request_once_is_refused() -> None:
    names = request_names(two_sessions())
    for bad in (names[:-1], [*names, names[0]], [*names[:-1], "s9/turn0"]):
        with pytest.raises(ValueError, match="every request"):
            await serve(GatedEngine(None, None), bad)


@pytest.mark.asyncio
async def test_every_request_reports_the_host_part_of_its_prefill_and_its_model_threads_work() -> None:
    for r in await serve(GatedEngine(None, None)):
        assert 0 < r.launch_s <= r.prefill_s <= r.ttft_s
        # The model thread's own counters over its prefill and decode calls.
        assert r.model_cpu_s > 0
        assert r.model_waits >= 0 and r.model_preemptions >= 0


def test_misses_compare_their_own_prefill_not_their_queue() -> None:
    def result(name: str, computed: int, prefill: float, launch: float, ttft: float) -> RequestResult:
        return RequestResult(name, "t", "doc", 0, 16, computed_tokens=computed, prefill_s=prefill, launch_s=launch,
                             ttft_s=ttft, pool_tokens=16 - computed)

    scratch = [result("a", 16, 0.10, 0.05, 0.10), result("b", 16, 0.10, 0.05, 0.30), result("c", 16, 0.10, 0.05, 0.1),
               result("d", 16, 0.10, 0.05, 0.10)]
    # a: slower queue, same prefill; b: faster queue, prefill 2x (launch 2x); c: a hit; d: 1.5x.
    cached = [result("a", 16, 0.10, 0.05, 0.30), result("b", 16, 0.20, 0.10, 0.25), result("c", 8, 0.30, 0.3, 0.3),
              result("d", 16, 0.15, 0.05, 0.15)]
    m = compare_misses(cached, scratch)
    assert m.requests == 3
    assert m.prefill_median == pytest.approx(1.5)
    assert m.prefill_worst == pytest.approx(2.0)
    assert m.worst_request == "b"
    assert m.launch_median == pytest.approx(1.0)
    assert m.waits_per_s == (0.0, 0.0)
    for r, waits in zip(cached, (3, 60, 0, 5), strict=True):  # per second of prefill + decode: 30, 300, -, 33.3
        r.model_waits, r.model_preemptions, r.model_cpu_s = waits, 1, 0.05
    m = compare_misses(cached, scratch)
    assert m.waits_per_s == (pytest.approx(100 / 3), 0.0)
    assert m.preemptions_per_s == (pytest.approx(1 / 0.15), 0.0)
    assert m.cpu_share == (pytest.approx(1 / 3), 0.0)
    s = summarize(cached, scratch, 1.0, 1.0)
    assert s["worst_request"] == "a"  # by TTFT: its queue, not its prefill
    assert s["miss_prefill_worst_request"] == "b"
    table = format_table(s, None, OracleReport(4, (), 0.0, True))
    assert "1.50x" in table and "2.00x" in table
    assert compare_misses(cached[2:3], scratch).requests == 0
    assert "misses (no hit): requests" in format_table(summarize(cached[2:3], scratch, 1.0, 1.0), None,
                                                       OracleReport(1, (), 0.0, True))
