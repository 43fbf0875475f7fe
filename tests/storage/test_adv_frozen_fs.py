"""Adversarial: a frozen file system (``fsfreeze -f``: a snapshot, a stuck device) under a whole KVCache.

A freeze blocks page-file writes in the kernel, not reads. A load of pages that are on disk only must
not wait behind the blocked write-behind (#11: on the threads backend it waited in the one shared
worker queue until the thaw, 14 s; io_uring: 0.00 s). A watchdog thaws after THAW_S so nothing stays
stuck when the check fails. Root only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from fs_helpers import loop_ext4
from test_adv_cache_fs import LAYOUT, SLOTS, cache_config, offload_all, oracle, prompts

from aiokv import DiskBackend, KVCache

THAW_S = 20.0
READ_BOUND_S = 2.0


def _freeze(mount: Path) -> None:
    subprocess.run(["fsfreeze", "-f", str(mount)], check=True, capture_output=True)


def _thaw(mount: Path) -> None:
    subprocess.run(["fsfreeze", "-u", str(mount)], check=False, capture_output=True)


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.URING, DiskBackend.THREADS],
                         ids=lambda b: b.value)
async def test_loads_of_disk_pages_never_wait_behind_writes_a_freeze_blocks(tmp_path: Path,
                                                                           backend: DiskBackend) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = cache_config(mount / "kv")
        assert cfg.disk is not None
        cfg = dataclasses.replace(cfg, disk=dataclasses.replace(cfg.disk, backend=backend))
        watchdog = threading.Timer(THAW_S, _thaw, args=(mount,))
        try:
            async with KVCache(cfg, LAYOUT, kv) as cache:
                old = prompts(1, 10)
                await offload_all(cache, kv, old)
                await cache.flush()
                await offload_all(cache, kv, prompts(3, 10))  # old's pages now on disk only
                await cache.flush()
                _freeze(mount)
                watchdog.start()
                await offload_all(cache, kv, prompts(2, 8))  # write-behind blocks in the kernel
                await asyncio.sleep(0.5)
                stats = cache.stats().disk
                assert stats is not None and stats.in_flight > 0, "no write is blocked: the freeze did not bite"
                match = await cache.match(old[0])
                assert match.disk_pages > 0
                kv.zero_()
                began = time.perf_counter()
                result = await cache.load(match, torch.arange(match.tokens))
                took = time.perf_counter() - began
                assert took < READ_BOUND_S, f"a disk read waited {took:.1f} s behind writes blocked by the freeze"
                assert result.tokens == match.tokens
                assert torch.equal(kv[:, : result.tokens], oracle(old[0][: result.tokens]))
                _thaw(mount)  # the close waits for the blocked writes (bounding it is another matter)
        finally:
            watchdog.cancel()
            _thaw(mount)
