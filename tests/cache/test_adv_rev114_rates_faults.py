"""Review 114: saving the learned rates under real file-system faults.

A cache over an ext4 on a loop device learns a rate; then, with the rates file of an earlier
cache in place, the file system fills up (a filler file, then no inode left), dies (ext4
shutdown: EIO on everything), is remounted read-only, or is frozen (writes hang in the kernel),
and the cache closes. Checked: the close keeps its bound, the failed save is counted
(``rates_not_saved``), nothing but the layout directory's rates files is ever touched, no
temporary file is left, and once the file system is healed the rates file is the old one or the
new one, whole (a later start reads it without a fault). Root only.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest
from cache_helpers import LAYOUT, make_kv
from loop_probes import until_thread

from aiokv import CacheConfig, KVCache
from aiokv.rates_file import RATES_FILE, RATES_TEMP
from aiokv.storage import DiskConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import fill_up, freeze, loop_ext4, remount, shut_down_ext4, thaw, use_up_inodes

CLOSE_S = 1.0
FAULTS = ["enospc", "inodes", "eio", "ro", "frozen"]


def _config(root: Path) -> CacheConfig:
    disk = DiskConfig(directory=root, capacity_bytes=16 * (LAYOUT.page_bytes + 4096), min_free_bytes=0)
    return CacheConfig(cpu_bytes=8 * LAYOUT.page_bytes, disk=disk, namespace="test-model",
                       pool_chunk_bytes=4 * LAYOUT.page_bytes, close_timeout=CLOSE_S)


def _tree(top: Path) -> set[str]:
    return {str(p.relative_to(top)) for p in top.rglob("*")}


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", FAULTS)
async def test_a_save_under_a_file_system_fault_is_bounded_counted_and_never_torn(tmp_path: Path,
                                                                                  fault: str) -> None:
    with loop_ext4(tmp_path, 16, inodes=2048 if fault == "inodes" else None) as mount:
        root = mount / "kv"
        async with KVCache(_config(root), LAYOUT, make_kv(1)) as first:
            first.manager.costs.disk.update(LAYOUT.page_bytes, 0.010)
        layout_dir = root / LAYOUT.fingerprint.hex()
        old = (layout_dir / RATES_FILE).read_bytes()
        cache = KVCache(_config(root), LAYOUT, make_kv(2))
        await cache.start()
        try:
            assert cache.manager.costs.disk.rate is not None  # read back
            before = _tree(mount)
            if fault == "enospc":
                await asyncio.to_thread(fill_up, mount / "filler", 0)
            elif fault == "inodes":
                await asyncio.to_thread(use_up_inodes, mount / "lost+found")
            elif fault == "eio":
                shut_down_ext4(mount)
            elif fault == "ro":
                remount(mount, "ro")
            else:
                freeze(mount)
            for _ in range(8):  # a new rate, different enough to tell the files apart
                cache.manager.costs.disk.update(LAYOUT.page_bytes, 0.002)
            started = time.monotonic()
            await cache.aclose()
            assert time.monotonic() - started < CLOSE_S + 3.0, "the close did not keep its bound"
            errors = cache.stats().errors
            assert errors.get("rates_not_saved", 0) >= 1 or fault in ("enospc", "inodes"), errors
        finally:
            thaw(mount)
            await cache.aclose()
        if fault == "eio":
            return  # nothing on it can be read any more: what mattered was the bounded close
        if fault == "ro":
            remount(mount, "rw")
        # A write held by the freeze goes on once thawed, on its thread (the close no longer waits
        # for it): until that thread ended and its temporary file is gone, bounded. The thread first:
        # held before it made the temporary file, it makes it only once thawed (the GPU host saw the
        # file checked absent, then made).
        await until_thread(lambda: not any(t.name == "aiokv-rates" for t in threading.enumerate())
                           and not any(p.name.startswith(RATES_TEMP) for p in layout_dir.iterdir()),
                           "a rates thread or a temporary rates file was left", timeout_s=10.0)
        made = _tree(mount) - before - {"filler"} - {f"lost+found/inode-{i}" for i in range(4096)}
        assert made <= {str((layout_dir / RATES_FILE).relative_to(mount))}, made
        now = (layout_dir / RATES_FILE).read_bytes()
        async with KVCache(_config(root), LAYOUT, make_kv(3)) as again:
            assert again.stats().errors.get("rates_ignored", 0) == 0, (now, again.stats().errors)
            rate = again.manager.costs.disk.rate
            assert rate is not None
        if now != old:  # the new one, whole (a full disk may still have had room for it)
            assert rate > 1.5 * LAYOUT.page_bytes / 0.010
