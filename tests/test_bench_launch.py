"""tools/bench_launch.py measures what it says: both variants' offloads and hits, bit-exact, with
the launch groups each took (``launch_pages`` alone: exactly ceil(pages / 2))."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools"))
import bench_launch

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_both_variants_are_timed_and_grouped() -> None:
    args = argparse.Namespace(pages=9, repeats=2, device="cpu", spinners=1)
    out = asyncio.run(bench_launch._page_size(args, 16))
    assert out["page_count"] == 9 and out["page_kib"] == 16
    pages, budget = out["pages"], out["budget"]
    assert pages["offload_groups"] == pages["hit_groups"] == 5  # ceil(9 / launch_pages=2)
    assert 1 <= budget["offload_groups"] <= 5 and 1 <= budget["hit_groups"] <= 5
    for variant in (pages, budget):
        assert variant["offload_ms"] > 0 and variant["hit_ms"] > 0
        assert 0 < variant["step_p99_ms"] <= variant["step_max_ms"]
    assert out["hit_ratio"] > 0 and out["offload_ratio"] > 0


def test_group_costs_time_each_fixed_size_both_ways() -> None:
    args = argparse.Namespace(pages=6, repeats=2, device="cpu", group_costs=[1, 3])
    out = asyncio.run(bench_launch._group_costs(args, 16))
    assert out["page_kib"] == 16 and sorted(out["sizes"]) == [1, 3]
    for times in out["sizes"].values():
        assert sorted(times) == ["load", "offload"] and all(t > 0 for t in times.values())


def test_group_costs_leave_the_sizer_as_it_was() -> None:
    record = bench_launch.launches.LaunchSizer.record
    asyncio.run(bench_launch._group_costs(argparse.Namespace(pages=2, repeats=1, device="cpu", group_costs=[2]), 16))
    assert bench_launch.launches.LaunchSizer.record is record


@pytest.mark.slow(seconds=11)
def test_bad_arguments_are_refused() -> None:
    for bad in (["--repeats", "0"], ["--group-costs", "0"]):
        done = subprocess.run([sys.executable, str(TOOLS / "bench_launch.py"), *bad], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and "must be positive" in done.stderr, (bad, done.stderr)
