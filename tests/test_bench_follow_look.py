"""tools/bench_follow_look.py times looks of a real follower (the writer in a process of its own)
and leaves nothing below --dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_follow_look.py"


def test_it_times_each_look_kind_beside_each_neighbour_and_cleans_up(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--pages", "48", "--changed", "2", "--repeats", "2",
                           "--backend", "threads", "--dir", str(scratch), "--json", str(out)],
                          capture_output=True, text=True, timeout=240, check=True)
    times = json.loads(out.read_text())["threads"]
    assert sorted(times) == sorted(f"{kind} {mode}" for kind in ("steady", "changed")
                                   for mode in ("idle", "python", "loop"))
    assert all(len(samples) == 2 and all(0 < t < 60 for t in samples) for samples in times.values()), times
    assert "threads      steady" in proc.stdout and "threads      changed" in proc.stdout
    assert list(scratch.iterdir()) == []
