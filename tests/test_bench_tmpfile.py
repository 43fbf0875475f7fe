"""tools/bench_tmpfile.py writes what it measures, only below --dir, and its crash check can tell a partial file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools"))
from bench_tmpfile import HEADER_BYTES, VARIANTS, check_files

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_tmpfile.py"
UNIT = HEADER_BYTES + (1 << 20)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=240, check=True)


def test_every_variant_writes_its_pages_intact_inside_the_directory(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = tmp_path / "out.json"
    proc = _run("--dir", str(scratch), "--page-mib", "1", "--depth", "2", "--total-mib", "4", "--rounds", "1",
                "--keep", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == list(VARIANTS)
    for row in rows:
        assert row["pages"] == 4 and row["gbs"] > 0 and row["core_s_per_gb"] > 0 and len(row["samples"]) == 1
        # One round: each paired ratio is that round's ratio (against the tier's chain too).
        tier = next(r for r in rows if r["variant"] == "temp-rename")
        assert row["gbs_vs_tier"] == row["gbs"] / tier["gbs"]
        assert row["cpu_vs_tier_range"] == [row["cpu_vs_tier"]] * 2
        assert f"| 1/2 | {row['variant']} |" in proc.stdout
    direct = next(r for r in rows if r["variant"] == "direct")
    assert direct["gbs_vs_direct"] == 1.0 and direct["cpu_vs_direct"] == 1.0
    # Nothing outside --dir but the JSON we asked for; below it, one directory per pass.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "scratch"]
    (root,) = scratch.iterdir()
    passes = sorted(root.iterdir())
    assert [p.name for p in passes] == sorted(f"p1-q2-r0-{v}" for v in VARIANTS)
    for directory in passes:
        # Every final name holds a whole page (no temporary names left) and is a key in hex.
        assert check_files(directory, UNIT, keyed=False) == (4, 0, 0), directory.name
        assert all(len(f.name) == 32 for sub in directory.iterdir() for f in sub.iterdir())


def test_without_keep_the_run_leaves_nothing(tmp_path: Path) -> None:
    _run("--dir", str(tmp_path), "--page-mib", "1", "--depth", "2", "--total-mib", "2", "--rounds", "1",
         "--variants", "direct", "tmpfile-empty")
    assert list(tmp_path.iterdir()) == []


def test_the_check_counts_truncated_and_foreign_files_as_partial(tmp_path: Path) -> None:
    fan = tmp_path / "ab"
    fan.mkdir()
    key = bytes(range(0xAB, 0xAB + 16))
    (fan / key.hex()).write_bytes(key * (UNIT // 16))
    other = bytes(16)
    (fan / other.hex()).write_bytes(key * (UNIT // 16))  # whole, but not its own bytes
    third = b"\x01" * 16
    (fan / third.hex()).write_bytes(third * (UNIT // 32))  # cut in half
    (fan / ".tmp-x").write_bytes(b"")
    assert check_files(tmp_path, UNIT) == (1, 2, 1)
    assert check_files(tmp_path, UNIT, keyed=False) == (2, 1, 1)  # only the cut one is short


@pytest.mark.slow(seconds=18)
def test_killed_tmpfile_writers_leave_no_partial_final_file(tmp_path: Path) -> None:
    out = tmp_path / "crash.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    _run("--dir", str(scratch), "--page-mib", "1", "--depth", "4", "--rounds", "0", "--crash-rounds", "2",
         "--crash-variants", "tmpfile-empty", "--json", str(out))
    (row,) = json.loads(out.read_text())["crash"]
    assert row["kills"] == 2 and row["partial"] == 0 and row["temporary"] == 0
    assert row["intact"] > 0
    assert os.listdir(scratch) == []
