"""tools/gil_drops.py counts the GIL takes of each hit, per thread, through its preloaded library."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.mark.slow(seconds=13)
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_every_hit_reports_its_threads_takes(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(TOOLS / "gil_drops.py"), "--pages", "4", "--page-kib", "16", "--repeats", "1",
         "--top", "3", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, check=True,
    ).stdout
    hits = re.findall(r"^(\w+) +(pool|disk|offload) .* loop thread +(\d+) .* copy thread +(\d+) ", out,
                      re.MULTILINE)
    assert sorted((backend, tier) for backend, tier, _, _ in hits) == [
        ("threads", "disk"), ("threads", "offload"), ("threads", "pool"),
        ("uring_fixed", "disk"), ("uring_fixed", "offload"), ("uring_fixed", "pool")], out
    # Every hit and offload copies on the copy thread (a torch op lets the GIL go) after the loop woke it.
    assert all(int(loop) > 0 and int(copy) > 0 for _, _, loop, copy in hits), out
    assert "aiokv-copy" in out, out  # takes attributed to the copy thread's C calls
