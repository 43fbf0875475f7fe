"""Review 114: a start whose rates-file read is held in the kernel.

The cache directory lives on an ext4 whose block device stops answering on command
(``gate_helpers``: a loop device over a FUSE file, reads and writes held for real). The rates file
of an earlier cache is dropped from the page cache, the device is held and a cache starts: the disk
tier starts from what the kernel has cached, then the start read the rates file, a hint of a few
hundred bytes, and waited for it as long as the device hung (the whole ``start()``: the engine never
got its cache). Now the start waits ``RATES_READ_WAIT_S`` at most, goes on (``rates_late``), and the
read restores the rates once the device answers. Root only.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, make_kv, prompt

from aiokv import CacheConfig, KVCache
from aiokv.manager import RATES_READ_WAIT_S
from aiokv.rates_file import RATES_FILE
from aiokv.storage import DiskConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from gate_helpers import gated_ext4

T = LAYOUT.page_tokens
N = 8 * T
START_S = RATES_READ_WAIT_S + 4.0
"""Bound on the start with the rates read held (the disk tier's own start reads nothing held)."""
BOUND_S = 30.0


def config(root: Path) -> CacheConfig:
    """A small cache over ``root`` (the small ext4 keeps a MiB free, not the default reserve)."""
    disk = DiskConfig(directory=root, capacity_bytes=64 * (LAYOUT.page_bytes + 4096), min_free_bytes=1 << 20)
    return CacheConfig(cpu_bytes=16 * LAYOUT.page_bytes, disk=disk, namespace="test-model",
                       pool_chunk_bytes=4 * LAYOUT.page_bytes)


@pytest.mark.asyncio
async def test_a_start_goes_on_while_its_rates_read_is_held_and_restores_them_later(tmp_path: Path) -> None:
    with gated_ext4(tmp_path, 64) as (mount, gate):
        root = mount / "kv"
        tokens = prompt(114, N)
        source = make_kv(1)
        async with KVCache(config(root), LAYOUT, source) as first:
            await first.pool.wait_ready()
            await first.offload(tokens, torch.arange(N))
            await first.flush()
            assert first.stats().disk.pages == N // T
            first.manager.costs.disk.update(LAYOUT.page_bytes, 0.010)  # learned: saved at close
            saved = first.manager.costs.disk.rate
        rates = root / LAYOUT.fingerprint.hex() / RATES_FILE
        assert rates.exists()
        os.sync()
        fd = os.open(rates, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # its next read reaches the device
        finally:
            os.close(fd)
        target = make_kv(2)
        cache = KVCache(config(root), LAYOUT, target)
        gate.hold()
        try:
            async with asyncio.timeout(START_S):  # hung as long as the device before the fix
                await cache.start()
            assert gate.held() >= 1, "the rates read did not reach the held device"
            assert cache.stats().errors["rates_late"] == 1
            assert cache.manager.costs.disk.rate is None  # not read yet: nothing made up meanwhile
            gate.release()
            async with asyncio.timeout(BOUND_S):
                await cache.flush()  # waits for the read's job
            assert cache.manager.costs.disk.rate == pytest.approx(saved)
            match = await cache.match(tokens)
            assert match.disk_pages == N // T
            result = await cache.load(match, torch.arange(N))
            assert result.tokens == N and torch.equal(target[:, :N], source[:, :N])
            await assert_quiescent(cache)
        finally:
            gate.release()
            await cache.aclose()
