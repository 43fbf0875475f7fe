"""What the README says about set-up, the demo and disk pages is what the Makefile, the demo and
the library do (issue #11, operations: "README truths")."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aiokv.storage.config import default_disk_dir

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _make_dry_run(*args: str) -> str:
    """The commands ``make`` would run to install (nothing runs: ``-n``, a venv path that does not exist)."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    done = subprocess.run(
        ["make", "-n", "-B", "setup", "VENV=/nonexistent-aiokv-venv", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_torch_index_is_configurable_as_the_readme_says() -> None:
    # The README's own example, taken from its text.
    (url,) = re.findall(r"make test TORCH_INDEX_URL=(\S+?)`", README)
    with_index = [line for line in _make_dry_run(f"TORCH_INDEX_URL={url}").splitlines() if "torch==" in line]
    assert with_index and all(f"--index-url {url}" in line for line in with_index), with_index
    plain = [line for line in _make_dry_run().splitlines() if "torch==" in line]
    assert plain and not any("--index-url" in line for line in plain), plain


def test_the_demo_has_one_duration() -> None:
    durations = {m.group(0) for m in re.finditer(r"~\d+(?:\.\d+)? minutes?", README)
                 if "demo" in README[max(0, m.start() - 200) : m.start()]}
    assert len(durations) == 1, durations


@pytest.mark.slow(seconds=30)
def test_the_demo_flags_the_readme_names_exist() -> None:
    help_text = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "demo.py"), "--help"], capture_output=True, text=True, timeout=120,
    ).stdout
    named = set(re.findall(r"`(--[a-z][a-z-]*)", README))
    assert {"--json", "--plot", "--ttft", "--load-path", "--probe-gil", "--no-disk"} <= named
    missing = {flag for flag in named if flag not in help_text and flag != "--legacy"}  # --legacy: aiokv.segments
    assert not missing, missing


def test_the_disk_directory_the_readme_names_is_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "Disk pages persist across restarts" in README and "to purge" in README
    assert "default `$XDG_CACHE_HOME/aiokv`, i.e. `~/.cache/aiokv`" in README
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_disk_dir() == tmp_path / "xdg" / "aiokv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_disk_dir() == tmp_path / "home" / ".cache" / "aiokv"
    assert os.stat(tmp_path / "home" / ".cache" / "aiokv").st_mode & 0o077 == 0  # created 0700


@pytest.mark.slow(seconds=12)
def test_the_segment_tool_the_readme_names_runs() -> None:
    assert "python -m aiokv.segments list" in README and "python -m aiokv.segments clean" in README
    done = subprocess.run([sys.executable, "-m", "aiokv.segments", "list"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
