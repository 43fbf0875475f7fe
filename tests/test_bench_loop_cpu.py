"""tools/bench_loop_cpu.py measures what it says: the loop thread's CPU over real offloads and disk writes."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools"))
import bench_loop_cpu
from bench_loop_cpu import measure


def _args(tmp_path: Path, **over: object) -> argparse.Namespace:
    base: dict[str, object] = dict(shape="small", pages=4, calls=3, warm=1, dir=str(tmp_path), device="cpu")
    base.update(over)
    return argparse.Namespace(**base)


def test_the_figures_cover_every_timed_page_and_add_up(tmp_path: Path) -> None:
    out = asyncio.run(measure(_args(tmp_path)))
    assert out["pages"] == 12 and out["page_bytes"] == 128 << 10
    assert out["gb"] == pytest.approx(12 * (128 << 10) / 1e9)
    assert out["offload_us_per_page"] > 0 and out["write_us_per_page"] > 0
    assert out["loop_us_per_page"] == pytest.approx(out["offload_us_per_page"] + out["write_us_per_page"])
    assert out["loop_s_per_gb"] == pytest.approx(out["offload_loop_s_per_gb"] + out["write_loop_s_per_gb"])
    assert list(tmp_path.iterdir()) == []  # its disk tier's directory is removed


def test_loop_work_added_to_a_write_shows_in_the_write_behind_figure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 ms of loop CPU more per page written must show as about 2,000 us more per page.
    from aiokv.storage.jobs import WriteJob
    from aiokv.storage.writepath import WritePath

    base = asyncio.run(measure(_args(tmp_path)))
    claim = WritePath._claim

    def slow_claim(self: WritePath, job: WriteJob) -> None:
        end = time.thread_time() + 0.002
        while time.thread_time() < end:
            pass
        claim(self, job)

    monkeypatch.setattr(WritePath, "_claim", slow_claim)
    slow = asyncio.run(measure(_args(tmp_path)))
    assert slow["write_us_per_page"] - base["write_us_per_page"] >= 1500
    assert slow["offload_us_per_page"] < base["offload_us_per_page"] + 1000


def test_bad_counts_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_loop_cpu.py", "--pages", "0"])
    with pytest.raises(SystemExit):
        bench_loop_cpu.main()
