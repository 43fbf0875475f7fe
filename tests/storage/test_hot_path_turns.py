"""The disk tier's per-page hot path with less Python per page (#14), same guarantees.

- The checksum's inline batch of a turn runs from the ring's submission callback (no loop
  callback of its own), within the turn's budget; every page still verified.
- After a cold name (``openat2`` RESOLVE_CACHED answered EAGAIN) the next reads go straight to the
  chain from the open, sparing the look on the loop; planted names are still refused there.
- The public calls check their arguments once, with the same errors as before, leaking nothing.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, payload, reserve, stored_page

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage import checksum as checksum_module
from aiokv.storage.backends import COLD_READ_STREAK, UringPageIO


async def _load(tier: DiskTier, pool: PagePool, i: int) -> torch.Tensor | None:
    into = reserve(pool, key_of(1000 + i))
    try:
        return payload(pool, into).clone() if await tier.read(key_of(i), into) else None
    finally:
        pool.table.abort(into)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.URING], ids=["uring_fixed", "uring"])
@pytest.mark.parametrize("budget_pages", [64, 1])
async def test_the_inline_hash_batch_runs_in_the_rings_submission(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, budget_pages: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight writes, then eight reads at once: each turn's inline hashes run from the ring's
    submission callback (no loop callback of their own), within the turn's budget (one page: the
    rest go to the thread); right bytes either way, and a corrupt payload is still refused."""
    monkeypatch.setattr(checksum_module, "INLINE_WRITE_BYTES_PER_TURN", budget_pages * layout.payload_bytes)
    tier = DiskTier(config(disk_dir, backend), layout, pool)
    await tier.start()
    try:
        io = tier.backend
        assert isinstance(io, UringPageIO)
        turn_calls: list[str] = []
        real = io.engine.call_next_turn

        def recording(fn: Any) -> None:
            turn_calls.append(fn.__qualname__)
            real(fn)

        monkeypatch.setattr(io.engine, "call_next_turn", recording)
        handles = [fill(pool, key_of(i), i) for i in range(8)]
        data = [payload(pool, h) for h in handles]
        assert all(await asyncio.gather(*(tier.write(key_of(i), h) for i, h in enumerate(handles))))
        for h in handles:
            pool.table.release(h)
        got = await asyncio.gather(*(_load(tier, pool, i) for i in range(8)))
        for want, read in zip(data, got, strict=True):
            assert read is not None and torch.equal(read, want)
        assert "Checksums._hash_inline" in turn_calls
        # Flip one payload byte of page 3's file: its read is a counted miss.
        _flip_payload_byte(tier.files.path(key_of(3)), layout)
        assert await _load(tier, pool, 3) is None
        stats = tier.statistics()
        assert (stats.hits, stats.corrupt) == (8, 1)
    finally:
        await tier.aclose()
    assert_clean(pool)


def _lexists(path: str) -> bool:
    return os.path.lexists(path)


def _flip_payload_byte(path: str, layout: KVLayout) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        at = os.fstat(fd).st_size - layout.page_bytes + 5
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
    finally:
        os.close(fd)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.URING], ids=["uring_fixed", "uring"])
async def test_cold_names_skip_the_look_on_the_loop_and_planted_ones_are_refused(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(config(disk_dir, backend), layout, pool)
    await tier.start()
    try:
        io = tier.backend
        assert isinstance(io, UringPageIO) and io.direct and io.chain_reads
        data = [await stored_page(tier, pool, i) for i in range(6)]
        looks: list[bytes] = []

        def cold(dir_fd: int, name: bytes, flags: int) -> int | None:
            looks.append(name)
            return None  # as openat2 answers for a name not in the lookup caches (EAGAIN)

        monkeypatch.setattr(io._cached, "open", cold)
        for i in range(4):
            read = await _load(tier, pool, i)
            assert read is not None and torch.equal(read, data[i])
        assert len(looks) == 1  # the first cold name started a streak: the others went straight on
        assert io._cold_streak == COLD_READ_STREAK - 3
        # A name planted during the streak: the chain's O_NOFOLLOW open refuses it, counted.
        outside = tmp_path / "outside.txt"
        outside.write_bytes(b"outside" * 100)
        path = tier.files.path(key_of(4))
        os.unlink(path)
        os.symlink(outside, path)
        assert await _load(tier, pool, 4) is None
        stats = tier.statistics()
        assert (stats.misses, stats.corrupt, stats.errors[ErrorKind.UNSAFE]) == (1, 0, 1)
        io._cold_streak = 0  # streak over: the loop looks again
        read = await _load(tier, pool, 5)
        assert read is not None and torch.equal(read, data[5])
        assert len(looks) == 2
    finally:
        await tier.aclose()
    assert not _lexists(path)  # the planted name removed, never followed
    assert outside.read_bytes() == b"outside" * 100
    assert_clean(pool)


class _Key(bytes):
    """A bytes subclass: accepted as a key, through the full check."""


@pytest.mark.asyncio
async def test_edge_checks_raise_as_before_and_leak_nothing(disk_dir: Path, backend: DiskBackend,
                                                            layout: KVLayout, pool: PagePool) -> None:
    tier = DiskTier(config(disk_dir, backend), layout, pool)
    held = fill(pool, key_of(1), 1)
    with pytest.raises(RuntimeError, match="not started"):
        await tier.write(key_of(1), held)
    await tier.start()
    try:
        (res,) = pool.reserve([key_of(2)])
        assert res.handle is not None
        reserved = res.handle
        with pytest.raises(ValueError, match="is a reservation"):
            await tier.write(key_of(2), reserved)
        with pytest.raises(ValueError, match="is not a reservation"):
            await tier.read(key_of(1), held)
        with pytest.raises(TypeError, match="PageHandle"):
            await tier.write(key_of(1), "handle")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="PageHandle"):
            await tier.read(key_of(1), None)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="16 bytes"):
            await tier.write(key_of(1)[:15], held)
        with pytest.raises(TypeError, match="bytes"):
            await tier.read("k" * 16, reserved)  # type: ignore[arg-type]
        assert pool.table.statistics().referenced == 1  # the caller's own: no reference was taken
        assert await tier.write(_Key(key_of(1)), held)
        pool.table.abort(reserved)
        gone = fill(pool, key_of(3), 3)
        pool.table.release(gone)
        with pytest.raises(ValueError, match="already released"):
            await tier.write(key_of(3), gone)
        into = reserve(pool, key_of(4))
        assert await tier.read(_Key(key_of(1)), into)
        assert torch.equal(payload(pool, into), payload(pool, held))
        pool.table.abort(into)
        pool.table.release(held)
    finally:
        await tier.aclose()
    assert_clean(pool)
