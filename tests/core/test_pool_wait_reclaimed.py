"""`PagePool.wait_reclaimed()`: awaiting the background reclaim of dead processes' segments that
creating the pool started (tests polled /dev/shm for it), and a cancelled wait leaves it running."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from collections.abc import Iterator

import pytest
import torch

import aiokv.pool
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.reclaim import SegmentInfo
from aiokv.shm import SHM_DIR

LAYOUT = KVLayout.mha(2, 2, 16, torch.bfloat16, page_tokens=8)
BOUND_S = 10.0


@pytest.fixture
def prefix() -> Iterator[str]:
    """A name prefix of this test only: concurrent test runs reclaim "aiokv" segments, never these."""
    p = f"aiokvtest{secrets.token_hex(4)}"
    yield p
    for name in os.listdir(SHM_DIR):
        if name.startswith(p):
            os.unlink(os.path.join(SHM_DIR, name))


def _plant_dead(prefix: str) -> str:
    """A segment of a creator that cannot be alive (a pid above pid_max), nobody holding it."""
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) + 1
    path = os.path.join(SHM_DIR, f"{prefix}-{pid}-12345-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.ftruncate(fd, 8192)
    os.close(fd)
    return path


def _exists(path: str) -> bool:
    return os.path.exists(path)  # in /dev/shm (tmpfs): never blocks


@pytest.mark.asyncio
async def test_wait_reclaimed_returns_once_the_background_reclaim_ended(
        prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seg = _plant_dead(prefix)
    gate, entered = threading.Event(), threading.Event()
    real = aiokv.pool.reclaim

    def gated(name_prefix: str, legacy: bool = False) -> list[SegmentInfo]:
        entered.set()
        assert gate.wait(BOUND_S)  # held in its thread until the test lets it go
        return real(name_prefix, legacy=legacy)

    monkeypatch.setattr(aiokv.pool, "reclaim", gated)
    pool = await PagePool.open(LAYOUT, LAYOUT.page_bytes, name_prefix=prefix)
    try:
        assert await asyncio.to_thread(entered.wait, BOUND_S), "the reclaim did not start in its thread"
        waiting = asyncio.ensure_future(pool.wait_reclaimed())
        await asyncio.sleep(0)
        assert not waiting.done() and _exists(seg)
        waiting.cancel()  # a cancelled wait leaves the reclaim running
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not pool.reclaimed.cancelled()
        gate.set()
        async with asyncio.timeout(BOUND_S):
            reclaimed = await pool.wait_reclaimed()
        assert [SHM_DIR + s.name for s in reclaimed] == [seg]
        assert not _exists(seg)
        assert await pool.wait_reclaimed() == reclaimed  # again: at once
    finally:
        gate.set()
        await pool.aclose()
