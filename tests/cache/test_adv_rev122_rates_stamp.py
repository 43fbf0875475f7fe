"""Review 122: a rates file whose measurement time lies ahead of this process's clock.

A save is dropped when the file in place "holds a later measurement" (d31cd60: boot id and
``CLOCK_BOOTTIME`` of the newest fold). That time was trusted whatever file carried it, so a
file stamped ahead of every clock this process will read kept every later save out, silently (a
log line each time; the cache counted nothing and cleared its dirty flag) until the next reboot:

- a cache in a time namespace whose boot clock is ahead (``unshare --time --boottime``: a
  container, a CRIU restore) saved its rates; every save of a cache outside it was dropped;
- a file that is not even a rates file (a torn or foreign one, refused when read) with such a
  stamp did the same.

Now a stamp counts only in a rates file and only when it is not ahead of this process's own boot
clock (nothing it saves can be later than "now": such a file is replaced). Injected for real: the
ahead-of-time file is saved by a process in a real time namespace.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cache_helpers import DEVICE, LAYOUT, make_kv

from aiokv import CacheConfig, KVCache
from aiokv.costs import BOOT_CLOCK, CostModel
from aiokv.rates_file import RATES_FILE, decode_rates, encode_rates, write_rates_file
from aiokv.storage import DiskConfig

PAGE = LAYOUT.page_bytes
AHEAD_S = 10_000_000
"""The namespace's boot clock is this far ahead (about four months)."""
NAMESPACED, HERE = 0.010, 0.002
"""Seconds per page read that each writer learned: the files are told apart by their disk rate."""


def _can_unshare_time() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--time", "--boottime", "1", "--fork", "true"], capture_output=True,
                           timeout=30)
    return probe.returncode == 0


needs_time_namespace = pytest.mark.skipif(not _can_unshare_time(), reason="needs root and unshare --time")


def _learned(seconds: float) -> bytes:
    costs = CostModel()
    costs.disk.update(PAGE, seconds)
    return encode_rates(costs, LAYOUT.fingerprint.hex(), DEVICE.type)


def _disk_rate(path: Path) -> float:
    return decode_rates(path.read_bytes(), LAYOUT.fingerprint.hex(), DEVICE.type).rates["disk"][0]


def _save_ahead(directory: Path) -> None:
    """Save rates (NAMESPACED) into ``directory`` from a process whose boot clock is AHEAD_S ahead."""
    code = ("import sys; from pathlib import Path; import test_adv_rev122_rates_stamp as t; "
            "from aiokv.rates_file import write_rates_file; "
            "assert write_rates_file(Path(sys.argv[1]), t._learned(t.NAMESPACED))")
    subprocess.run(["unshare", "--time", "--boottime", str(AHEAD_S), "--fork", sys.executable, "-c", code,
                    str(directory)], check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    stamp = json.loads((directory / RATES_FILE).read_bytes())["measured"][1]
    assert stamp > time.clock_gettime_ns(BOOT_CLOCK) + (AHEAD_S - 60) * 10**9  # really ahead of us


@needs_time_namespace
def test_a_file_saved_ahead_of_this_clock_is_replaced(tmp_path: Path) -> None:
    _save_ahead(tmp_path)
    mine = _learned(HERE)
    assert write_rates_file(tmp_path, mine)  # before: False, and so every save until a reboot
    assert (tmp_path / RATES_FILE).read_bytes() == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == [RATES_FILE]


def test_a_stamp_in_a_file_that_is_no_rates_file_keeps_nothing_out(tmp_path: Path) -> None:
    # Torn or foreign: refused when read, so it must not decide what replaces it either.
    now = json.loads(_learned(HERE))["measured"]
    (tmp_path / RATES_FILE).write_text(json.dumps({"measured": [now[0], now[1] + 10**9]}))
    mine = _learned(HERE)
    assert json.loads(mine)["measured"][1] < now[1] + 10**9  # the stamp there is later than ours
    assert write_rates_file(tmp_path, mine)
    assert (tmp_path / RATES_FILE).read_bytes() == mine


def test_a_later_file_of_this_clock_still_wins(tmp_path: Path) -> None:
    # d31cd60's rule holds: a save measured before the file in place (and not ahead of now) is dropped.
    older, newer = _learned(NAMESPACED), _learned(HERE)
    assert write_rates_file(tmp_path, newer)
    assert not write_rates_file(tmp_path, older)
    assert (tmp_path / RATES_FILE).read_bytes() == newer


@pytest.mark.slow(seconds=14)
@needs_time_namespace
@pytest.mark.asyncio
async def test_a_cache_after_an_ahead_of_time_save_saves_its_own_rates(tmp_path: Path) -> None:
    root = tmp_path / "root"
    disk = DiskConfig(directory=root, capacity_bytes=16 * (PAGE + 4096), min_free_bytes=0)
    cfg = CacheConfig(cpu_bytes=8 * PAGE, disk=disk, namespace="test-model", pool_chunk_bytes=4 * PAGE)
    cache = KVCache(cfg, LAYOUT, make_kv(1))
    await cache.start()
    layout_dir = cache.manager.disk.files.layout_dir  # type: ignore[union-attr]
    await asyncio.to_thread(_save_ahead, layout_dir)
    for _ in range(8):
        cache.manager.costs.disk.update(PAGE, HERE)
    await cache.aclose()
    assert "rates_not_saved" not in cache.stats().errors, cache.stats().errors
    # Before: the namespaced process's rates stayed (this cache's save was dropped as "late").
    assert _disk_rate(layout_dir / RATES_FILE) == pytest.approx(PAGE / HERE, rel=0.01)
