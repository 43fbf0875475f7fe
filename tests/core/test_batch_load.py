"""A load's and a prefetch's disk pages are read in `DiskTier.read_many` batches, one per read group
(#14), with the per-page guarantees of the single reads they replaced: bytes exact, a bad page ends
the valid prefix there, and a cancelled load never leaves a read running into pool pages it freed.
Real caches over real page files (the threads backend and io_uring)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from cancel_points import most_attempts, pause
from group_helpers import GROUP, LAYOUT, T, group_config, put_on_disk, random_kv, random_tokens, take_free_pages

from aiokv import CacheConfig, DiskBackend, KVCache
from aiokv.storage import DiskTier

PAGES = GROUP + 5  # two read groups, the second short
N = PAGES * T
POOL_PAGES = 2 * PAGES + 8
BACKENDS = [DiskBackend.URING_FIXED, DiskBackend.THREADS]
DENSE = 300
"""The cancelled-load sweep's attempts counted in loop turns (cancel_points.pause), then growing sleeps."""


def _config(root: Path, backend: DiskBackend) -> CacheConfig:
    return group_config(root, PAGES, POOL_PAGES, backend)


def _kv(seed: int) -> torch.Tensor:
    return random_kv(seed, 4 * N)


def _tokens(seed: int) -> list[int]:
    return random_tokens(seed, N)


async def _on_disk(root: Path, backend: DiskBackend, tokens: list[int], kv: torch.Tensor) -> None:
    await put_on_disk(_config(root, backend), tokens, kv)


def _count_batches(disk: DiskTier, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the read_many batches ``disk`` is asked for; a single read fails the test."""
    sizes: list[int] = []
    real = disk.read_many

    async def counted(keys: Any, handles: Any) -> list[bool]:
        sizes.append(len(keys))
        return await real(keys, handles)

    async def no_single_read(*_: Any) -> bool:
        raise AssertionError("a page was read on its own")

    monkeypatch.setattr(disk, "read_many", counted)
    monkeypatch.setattr(disk, "read", no_single_read)
    return sizes


async def _quiescent(cache: KVCache) -> None:
    await cache.flush()
    cache.pool.table.check_invariants()
    stats = cache.stats()
    assert (stats.pool_reserved, stats.pool_referenced, stats.background_jobs) == (0, 0, 0), stats


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_a_load_reads_one_batch_per_group_bit_exact(tmp_path: Path, backend: DiskBackend,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    source = _kv(1)
    tokens = _tokens(1)
    await _on_disk(tmp_path, backend, tokens, source)
    kv = _kv(2)
    async with KVCache(_config(tmp_path, backend), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert cache.disk is not None
        sizes = _count_batches(cache.disk, monkeypatch)
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES
        target = torch.arange(N + T + 1, 2 * N)
        result = await cache.load(match, target, from_token=T + 1)  # skips a page and a token
        assert (result.tokens, result.disk_pages) == (N, PAGES - 1)
        assert sizes == [GROUP, PAGES - 1 - GROUP]
        assert torch.equal(kv[:, target], source[:, T + 1 : N])
        assert cache.stats().pages_promoted == PAGES - 1
        await _quiescent(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_a_read_groups_pages_are_copied_in_launch_groups_not_one_a_page(
        tmp_path: Path, backend: DiskBackend) -> None:
    """Regression: every disk page was its own copy (a copy-thread round trip, or a GPU launch's
    fixed cost, each a GIL hand-over beside an engine thread running Python: a 39-page disk hit of
    64 KiB pages took 2.8-3.5 s beside one on the 2-vCPU VM, 0.2-0.4 s now; tools/bench_gil.py).
    A read group's pages now go in launch groups (here ``launch_pages`` 3, no growth), bit-exact."""
    source = _kv(21)
    tokens = _tokens(21)
    await _on_disk(tmp_path, backend, tokens, source)
    kv = _kv(22)
    config = dataclasses.replace(_config(tmp_path, backend), launch_pages=3, launch_turn_s=0.0)
    async with KVCache(config, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        transfers = cache._transfers
        assert transfers is not None
        sizes: list[int] = []
        real = transfers.load

        def counted(ids: Any, *args: Any, **kwargs: Any) -> Any:
            sizes.append(len(ids))
            return real(ids, *args, **kwargs)

        transfers.load = counted  # type: ignore[method-assign]
        match = await cache.match(tokens)
        target = torch.arange(N + T + 1, 2 * N)
        result = await cache.load(match, target, from_token=T + 1)  # skips a page and a token
        assert (result.tokens, result.disk_pages) == (N, PAGES - 1)
        want: list[int] = []
        for group in (GROUP, PAGES - 1 - GROUP):  # the read groups, from the first page loaded
            want += [3] * (group // 3) + ([group % 3] if group % 3 else [])
        assert sizes == want
        assert torch.equal(kv[:, target], source[:, T + 1 : N])
        await _quiescent(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("group_pages", [1, 3])
async def test_read_group_bytes_sets_the_pages_of_each_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               group_pages: int) -> None:
    """``CacheConfig.read_group_bytes``: groups of that many bytes' worth of pages (1 byte: one page)."""
    source = _kv(11)
    tokens = _tokens(11)
    backend = DiskBackend.THREADS
    await _on_disk(tmp_path, backend, tokens, source)
    kv = _kv(12)
    group_bytes = 1 if group_pages == 1 else group_pages * LAYOUT.page_bytes + LAYOUT.page_bytes // 2
    config = dataclasses.replace(_config(tmp_path, backend), read_group_bytes=group_bytes)
    async with KVCache(config, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert cache.disk is not None
        sizes = _count_batches(cache.disk, monkeypatch)
        result = await cache.load(await cache.match(tokens), torch.arange(N))
        assert result.disk_pages == PAGES
        assert sizes == [group_pages] * (PAGES // group_pages) + ([PAGES % group_pages] if PAGES % group_pages else [])
        assert torch.equal(kv[:, :N], source[:, :N])
        await _quiescent(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_a_corrupt_page_in_a_group_ends_the_valid_prefix_there(tmp_path: Path, backend: DiskBackend) -> None:
    """A page file corrupted on disk (a payload byte flipped): the load stops at that page, the
    pages before it are exact, and every reference the groups took is let go."""
    source = _kv(3)
    tokens = _tokens(3)
    await _on_disk(tmp_path, backend, tokens, source)
    bad = 7
    kv = _kv(4)
    async with KVCache(_config(tmp_path, backend), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert cache.disk is not None
        _flip_payload(cache.disk.files.path(cache.keys(tokens)[bad]))
        match = await cache.match(tokens)
        target = torch.arange(N, 2 * N)
        result = await cache.load(match, target)
        assert (result.tokens, result.disk_pages) == (bad * T, bad)
        assert torch.equal(kv[:, target[: bad * T]], source[:, : bad * T])
        stats = cache.stats()
        assert stats.errors["disk_read_failed"] == 1 and stats.errors["load_shortened"] == 1
        assert cache.disk.statistics().corrupt == 1
        await _quiescent(cache)


def _flip_payload(path: str) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, 4096 + 5)
        os.pwrite(fd, bytes([byte[0] ^ 0x10]), 4096 + 5)
    finally:
        os.close(fd)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_a_cancelled_load_never_frees_a_page_a_read_still_writes(tmp_path: Path, backend: DiskBackend) -> None:
    """Cancel a load after 0, 1, 2, ... loop turns, then ever longer sleeps, until one completes
    (cancel_points.pause): right after each cancel every pool page the pool will hand out is
    taken and overwritten; once all abandoned reads ended none of them changed (a page under a
    read is still reserved by its group), and the cache is quiescent."""
    source = _kv(5)
    tokens = _tokens(5)
    await _on_disk(tmp_path, backend, tokens, source)
    kv = _kv(6)
    async with KVCache(_config(tmp_path, backend), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        pool = cache.pool
        step = 0
        while True:
            assert step < most_attempts(DENSE), "the load never completed"
            for key in cache.keys(tokens):  # every page from disk again
                pool.table.discard(key)
            match = await cache.match(tokens)
            task = asyncio.create_task(cache.load(match, torch.arange(N, 2 * N)))
            await pause(step, DENSE)
            task.cancel()
            try:
                result = await task
            except asyncio.CancelledError:
                fill = 1 + step % 250
                taken = take_free_pages(cache, POOL_PAGES, step % 256, fill)
                await cache.flush()  # every abandoned read and copy ended
                for h in taken:
                    assert bytes(pool.memory.page_view(pool.table.check(h))) == bytes([fill]) * LAYOUT.page_bytes
                    pool.table.abort(h)
                await _quiescent(cache)
                step += 1
                continue
            assert result.tokens == N
            assert torch.equal(kv[:, N : 2 * N], source[:, :N])
            break
        assert step > 0
        await _quiescent(cache)


@pytest.mark.asyncio
async def test_a_prefetch_reads_one_batch_per_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _kv(7)
    tokens = _tokens(7)
    await _on_disk(tmp_path, DiskBackend.AUTO, tokens, source)
    async with KVCache(_config(tmp_path, DiskBackend.AUTO), LAYOUT, _kv(8)) as cache:
        await cache.pool.wait_ready()
        assert cache.disk is not None
        sizes = _count_batches(cache.disk, monkeypatch)
        fetched = await cache.prefetch(tokens)
        assert (fetched.pool_pages, fetched.promoted) == (0, PAGES)
        assert sizes == [GROUP, PAGES - GROUP]
        again = await cache.prefetch(tokens)  # all in the pool now: nothing read
        assert (again.pool_pages, again.promoted, len(sizes)) == (PAGES, 0, 2)
        await _quiescent(cache)


@pytest.mark.asyncio
async def test_a_prefetch_whose_group_raises_leaves_no_reference_behind(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review 111 by reading: a prefetch adopted its other groups only when cancelled; a group that
    raised anything else left the references the others took for good (pages never evictable)."""
    from aiokv.loadpath import LoadPath

    source = _kv(13)
    tokens = _tokens(13)
    await _on_disk(tmp_path, DiskBackend.THREADS, tokens, source)
    real = LoadPath._promote_group
    calls = [0]

    async def second_raises(self: LoadPath, keys: Any, windowed: bool = False) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("an unexpected failure in a read group (injected)")
        return await real(self, keys, windowed)

    monkeypatch.setattr(LoadPath, "_promote_group", second_raises)
    async with KVCache(_config(tmp_path, DiskBackend.THREADS), LAYOUT, _kv(14)) as cache:
        await cache.pool.wait_ready()
        with pytest.raises(RuntimeError, match="injected"):
            await cache.prefetch(tokens)
        await _quiescent(cache)  # the first group's pages were read and released
