"""Shared by the planted-record tests (rev264, rev289): the page oracle, a snapshot of a directory
outside the cache, a tier started and closed within a bound, a read checked against the oracle."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskConfig, DiskTier

WAIT_S = 30.0

Snapshot = dict[str, tuple[int, int, int, str]]


def bytes_of(key: PageKey, size: int) -> bytes:
    """The one content of ``key`` (the oracle)."""
    return hashlib.shake_256(key).digest(size)


def snapshot(directory: Path) -> Snapshot:
    """Every entry under ``directory`` (never followed): mode, size, mtime, a regular file's digest."""
    out: Snapshot = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(root) / name
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
            out[str(path.relative_to(directory))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


@contextlib.asynccontextmanager
async def started(cfg: DiskConfig, layout: KVLayout, pool: PagePool) -> AsyncIterator[DiskTier]:
    tier = DiskTier(cfg, layout, pool)
    async with asyncio.timeout(WAIT_S):
        await tier.start()
    try:
        yield tier
    finally:
        async with asyncio.timeout(WAIT_S):
            await tier.aclose()


async def served(tier: DiskTier, key: PageKey, size: int) -> bool:
    """Whether ``key`` is served; a page served must be the bytes written for it."""
    buf = bytearray(b"\x5a" * size)
    async with asyncio.timeout(WAIT_S):
        ok = await tier.read_into(key, memoryview(buf))
    if ok:
        assert bytes(buf) == bytes_of(key, size), f"wrong bytes served for {key.hex()}"
    return ok
