"""tools/bench_follow_look.py times looks of a real follower (the writer in a process of its own)
and leaves nothing below --dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_follow_look.py"


@pytest.mark.slow(seconds=25)
def test_it_times_each_look_kind_beside_each_neighbour_and_cleans_up(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--pages", "48", "--changed", "2", "--repeats", "1",
                           "--backend", "threads", "--dir", str(scratch), "--json", str(out)],
                          capture_output=True, text=True, timeout=240, check=True)
    report = json.loads(out.read_text())
    assert sorted(report) == ["threads fstat", "threads statx"]  # --stat both: each way, one run
    for times in report.values():
        assert sorted(times) == sorted(f"{kind} {mode}" for kind in ("steady", "changed", "settled")
                                       for mode in ("idle", "python", "loop"))
        assert all(len(samples) == 1 and all(0 < t < 60 for t in samples) for samples in times.values()), times
    for how in ("fstat", "statx"):
        assert f"threads      {how:6} steady" in proc.stdout and f"threads      {how:6} changed" in proc.stdout
    assert "fstat/statx" in proc.stdout
    assert list(scratch.iterdir()) == []
