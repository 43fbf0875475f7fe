"""tools/bench_start_trim.py starts a real tier over a directory both ways (every file kept, trimmed)
and checks what each start indexed; nothing is left below --dir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_start_trim.py"


def test_it_times_both_starts_and_cleans_up(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(TOOL), "--files", "200", "--kept", "10", "--repeats", "1",
                           "--backend", "threads", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, check=True)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("python ") and "200 files, trimmed to 10" in lines[0]
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[2:4]}
    assert set(rows) == {"keep", "trim"} and all(gap > 0 and took > 0 for gap, took in rows.values())
    assert lines[4].startswith("trim / keep: longest gap ")
    assert list(tmp_path.iterdir()) == []
