"""``tools/demo.py --tp 2`` with layer-wise hits: each rank's tail waits per layer on its own copies.

The scheduler starts ``TPCache.start_load(..., layered=True)`` and carries ``stream.layered_load()``
in the tail's steps; each rank process calls ``wait_layer`` before every layer's attention. The
oracle (the same split served from scratch) must stay bit-exact on CPU.
"""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import demo

from aiokv import Match
from aiokv.stream import LoadStream
from aiokv.tp import RankStatus
from aiokv.tp.cache import TPCache

pytestmark = pytest.mark.slow(seconds=45)  # the longest tests on the GPU host: each starts a worker under xdist


def _config(tmp_path: Path, *flags: str) -> demo.DemoConfig:
    # One request at a time, write-behind settled after each (as tests/test_demo.py does). Two
    # decoded tokens, not 8: every step is a round trip through both ranks (2-3x the development
    # VM's time on the GPU host, 180 s for the whole run), and 2 still decode over loaded KV.
    args = ["--preset", "tiny", "--disk-dir", str(tmp_path / "disk"), "--concurrency", "1", "--settle", "--tp", "2",
            "--gen-tokens", "2", *flags]
    return demo.config_from_args(demo.parse_args(args))


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["layered", "split-layered"])
async def test_tp_demo_streams_hits_layer_by_layer_bit_exact(tmp_path: Path, path: str) -> None:
    out = await demo.run_demo(_config(tmp_path, "--load-path", path), progress=False)
    assert out.oracle.mismatches == ()
    assert out.oracle.logits_bit_exact
    assert out.oracle.compared == len(out.scratch) > 10
    s = out.summary
    assert s["pool_tokens"] > 0
    assert s["lost_tokens"] == 0
    assert s["computed_tokens"] + s["gpu_prefix_tokens"] + s["pool_tokens"] + s["disk_tokens"] == s["prompt_tokens"]
    assert not any(out.stats.errors.values())
    assert [w.rank for w in out.rank_workers] == [0, 1]
    for worker in out.rank_workers:
        # Before: TP hits streamed whole pages whatever --load-path said (no layered spec at all).
        assert worker.layered_loads > 0, f"rank {worker.rank} copied no load layer by layer"
        assert set(worker.reports) == {RankStatus.OK}
    assert not multiprocessing.active_children()


@pytest.mark.asyncio
async def test_tp_oracle_catches_wrong_bytes_served_by_a_layered_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pool pages whose rank-1 V head is off by 0.5, loaded layer by layer, reach only rank 1's
    attention (after its wait_layer) and still fail the oracle: the layered bytes are what it reads."""
    original = TPCache.start_load
    layered_starts: list[bool] = []

    def corrupting_start_load(
        self: TPCache, match: Match, slots: torch.Tensor, *, from_token: int = 0, layered: bool = False
    ) -> LoadStream:
        # Rank-major pages [N, parts, L, T, rows/parts, D]: part 1, layer 0, row 1 is rank 1's V head.
        assert self.pool.pages.dim() == 6 and self.pool.pages.shape[1] == 2
        self.pool.pages[:, 1, 0, :, 1] += 0.5
        layered_starts.append(layered)
        return original(self, match, slots, from_token=from_token, layered=layered)

    monkeypatch.setattr(TPCache, "start_load", corrupting_start_load)
    out = await demo.run_demo(_config(tmp_path, "--load-path", "layered", "--tenants", "2"), progress=False)
    assert out.summary["pool_tokens"] > 0
    assert layered_starts and all(layered_starts)
    assert out.oracle.mismatches
    loaded = {r.name for r in out.cached if r.pool_tokens + r.disk_tokens}
    assert any(m.split(":")[0] in loaded for m in out.oracle.mismatches)
    assert not multiprocessing.active_children()
