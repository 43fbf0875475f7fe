"""Review of #14's cold-name streak: after one cold name (``openat2`` RESOLVE_CACHED answered
EAGAIN) the next reads go straight to the chain from the open, without the look on the loop. Names
that are hot in the kernel's caches then take the chain too: each planted name must still be a
counted miss (never its bytes, never a file outside the cache followed), on every backend (the
threads backend has no streak: the same plants, its own way).

Plants: a symlink to a valid copy of the page's own file outside the cache, a FIFO, our file of
another owner (root), a truncated file, another key's file renamed over the name, the same key's
file written by a tier of another layout (another fingerprint); and files swapped under two names
by a thread while both are read.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from disk_helpers import (
    assert_clean,
    config,
    fill,
    is_root,
    key_of,
    read_copy,
    ready_pool,
    small_layout,
    stored_page,
)

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage.backends import COLD_READ_STREAK, UringPageIO

READ_TIMEOUT_S = 10.0  # a read of a FIFO that blocked would hang: fail instead


async def _load(tier: DiskTier, pool: PagePool, i: int) -> torch.Tensor | None:
    return await read_copy(tier, pool, i, key_of(5000 + i), READ_TIMEOUT_S)


class _Streak:
    """Makes the next look on the loop answer 'cold' once (EAGAIN), then counts the looks."""

    def __init__(self, tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
        io = tier.backend
        self.io = io if isinstance(io, UringPageIO) else None
        self.looks = 0
        self._cold_once = True
        if self.io is not None:
            assert self.io.direct and self.io.chain_reads and self.io._cached.available
            real = self.io._cached.open

            def look(dir_fd: int, name: bytes, flags: int) -> int | None:
                self.looks += 1
                if self._cold_once:
                    self._cold_once = False
                    return None
                return real(dir_fd, name, flags)

            monkeypatch.setattr(self.io._cached, "open", look)

    def left(self) -> int:
        return self.io._cold_streak if self.io is not None else 0


def _copy_outside(path: str, outside: Path) -> Callable[[str], None]:
    def plant(name: str) -> None:
        shutil.copyfile(name, outside)  # a valid copy of this very page's file
        os.unlink(name)
        os.symlink(outside, name)
    del path
    return plant


def _fifo(name: str) -> None:
    os.unlink(name)
    os.mkfifo(name, 0o600)


def _truncated(name: str) -> None:
    os.truncate(name, os.stat(name).st_size - 4096)


def _other_owner(name: str) -> None:
    os.chown(name, 12345, 12345)


@pytest.mark.asyncio
async def test_planted_names_in_a_streak_are_counted_misses(tier: DiskTier, pool: PagePool, layout: KVLayout,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = [await stored_page(tier, pool, i) for i in range(10)]
    streak = _Streak(tier, monkeypatch)
    # One cold name starts the streak; its read is right.
    got = await _load(tier, pool, 0)
    assert got is not None and torch.equal(got, data[0])
    if streak.io is not None:
        assert streak.looks == 1 and streak.left() == COLD_READ_STREAK
    outside = tmp_path / "outside-copy"
    plants: dict[int, tuple[Callable[[str], None], str]] = {
        1: (_copy_outside(tier.files.path(key_of(1)), outside), "unsafe"),
        2: (_fifo, "unsafe"),
        3: (_truncated, "corrupt"),
        4: (lambda name: os.rename(tier.files.path(key_of(9)), name), "corrupt"),
    }
    if is_root():
        plants[5] = (_other_owner, "unsafe")
    # Key 6: the same key written by a tier of another layout (another fingerprint), copied here.
    other_layout = small_layout(torch.bfloat16)
    assert other_layout.fingerprint != layout.fingerprint and other_layout.page_bytes == layout.page_bytes
    with ready_pool(other_layout, 4) as other_pool:
        async with DiskTier(config(tmp_path / "other", tier.config.backend), other_layout, other_pool) as other:
            h = fill(other_pool, key_of(6), 66)
            assert await other.write(key_of(6), h)
            other_pool.table.release(h)
            foreign = other.files.path(key_of(6))
        plants[6] = (lambda name: shutil.copyfile(foreign, name), "corrupt")
        for i, (plant, _kind) in plants.items():
            plant(tier.files.path(key_of(i)))
        before = tier.statistics()
        for i in plants:
            assert await _load(tier, pool, i) is None, f"planted page {i} was served"
    if streak.io is not None:
        assert streak.looks == 1, "the planted reads were meant to go through the streak's chain"
        assert streak.left() == COLD_READ_STREAK - len(plants)
    stats = tier.statistics()
    unsafe = sum(kind == "unsafe" for _p, kind in plants.values())
    corrupt = sum(kind == "corrupt" for _p, kind in plants.values())
    assert stats.misses - before.misses == len(plants)
    assert stats.errors[ErrorKind.UNSAFE] - before.errors[ErrorKind.UNSAFE] == unsafe, stats
    assert stats.corrupt - before.corrupt == corrupt, stats
    assert stats.hits == before.hits
    for i in plants:
        assert not tier.contains(key_of(i))
    # The file outside the cache was never written or removed; honest pages still read right.
    assert outside.read_bytes()[:8] == b"AIOKVPG\0"
    for i in (7, 8, 0):
        got = await _load(tier, pool, i)
        assert got is not None and torch.equal(got, data[i])
    assert_clean(pool)


@pytest.mark.asyncio
async def test_files_swapped_under_two_names_in_a_streak_never_serve_the_other_page(
        tier: DiskTier, pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = await stored_page(tier, pool, 1), await stored_page(tier, pool, 2)
    streak = _Streak(tier, monkeypatch)
    name_a, name_b = tier.files.path(key_of(1)), tier.files.path(key_of(2))
    spare = name_a + ".swap"
    stop = threading.Event()
    swaps = 0

    def swapper() -> None:
        nonlocal swaps
        while not stop.is_set():
            try:
                os.rename(name_a, spare)
                os.rename(name_b, name_a)
                os.rename(spare, name_b)
            except FileNotFoundError:
                return  # a refused read removed one of them: nothing left to swap
            swaps += 1

    thread = threading.Thread(target=swapper, daemon=True)
    served = {1: 0, 2: 0}
    thread.start()
    try:
        for _ in range(3 * COLD_READ_STREAK):
            if streak.io is not None and streak.left() == 0:
                streak._cold_once = True  # a new streak
            for i, want in ((1, a), (2, b)):
                got = await _load(tier, pool, i)
                if got is not None:
                    assert torch.equal(got, want), f"page {i} served another page's bytes"
                    served[i] += 1
    finally:
        stop.set()
        await asyncio.to_thread(thread.join)
    assert swaps > 0
    stats = tier.statistics()
    assert stats.hits == sum(served.values())
    assert_clean(pool)
    if streak.io is not None:
        assert streak.looks < 3 * COLD_READ_STREAK  # most reads went through the streak


@pytest.mark.asyncio
async def test_a_streak_read_of_a_name_unlinked_or_renamed_away_is_a_miss(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        data = [await stored_page(tier, pool, i) for i in range(4)]
        streak = _Streak(tier, monkeypatch)
        assert await _load(tier, pool, 0) is not None
        os.unlink(tier.files.path(key_of(1)))
        os.rename(tier.files.path(key_of(2)), tier.files.path(key_of(2)) + ".away")
        assert await _load(tier, pool, 1) is None
        assert await _load(tier, pool, 2) is None
        got = await _load(tier, pool, 3)
        assert got is not None and torch.equal(got, data[3])
        if streak.io is not None:
            assert streak.looks == 1
        assert not tier.contains(key_of(1)) and not tier.contains(key_of(2))
    assert_clean(pool)
