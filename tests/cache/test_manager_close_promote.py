"""A close that begins while a disk promotion waits for pool room counts its pages withdrawn.

Right after start the pool may still be preparing chunks: a promotion that finds the usable pages
all referenced waits for the next chunk. When the cache's close began during that wait, the
promotion used to go on once the chunk came, read from the closed disk tier and count
``disk_read_failed`` (and the load ``load_shortened``). Now the close ends the wait: the pages
count as ``pages_withdrawn``, never a fault, and the load, stream or prefetch returns at once.

Everything is real: page files written by an earlier cache, a pool of two chunks whose second
chunk's preparation (``SharedSegment.prepare_chunk``) is held on a ``threading.Event`` until the test
lets it run, the first chunk full of pages a ``Match`` references.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, config, make_kv, prompt

from aiokv import CacheStatistics, KVCache
from aiokv.shm import ChunkResult, SharedSegment
from aiokv.storage import DiskTier

T = LAYOUT.page_tokens
PAGES = 4  # one pool chunk (cache_helpers: 4 pages a chunk)
BOUND_S = 30.0  # every wait of the test is bounded: a hang fails instead


async def _fill_disk(path: Path, tokens: list[int]) -> None:
    async with KVCache(config(path, pool_pages=32), LAYOUT, make_kv(70)) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(len(tokens)))
        await cache.flush()


def _hold_later_chunks(monkeypatch: pytest.MonkeyPatch, release: threading.Event) -> None:
    """Chunks after the first are prepared (for real) only once ``release`` is set."""
    real = SharedSegment.prepare_chunk

    def held(self: SharedSegment, index: int, offset: int, length: int, register_cuda: bool) -> ChunkResult:
        if index > 0:
            release.wait(BOUND_S)
        return real(self, index, offset, length, register_cuda)

    monkeypatch.setattr(SharedSegment, "prepare_chunk", held)


def _pause_after_disk_close(monkeypatch: pytest.MonkeyPatch, disk: DiskTier, go_on: asyncio.Event) -> asyncio.Event:
    """The cache's close runs the real disk-tier close, then pauses until ``go_on``. Returns the
    event set once the disk tier is closed."""
    disk_closed = asyncio.Event()
    real_close = disk.aclose

    async def close_disk() -> None:
        await real_close()
        disk_closed.set()
        async with asyncio.timeout(BOUND_S):
            await go_on.wait()

    monkeypatch.setattr(disk, "aclose", close_disk)
    return disk_closed


async def _stats_then_close(cache: KVCache, closing: asyncio.Future[None], go_on: asyncio.Event) -> CacheStatistics:
    """The statistics taken while the close pauses after the disk tier's, then the rest of the close."""
    stats = cache.stats()
    go_on.set()
    async with asyncio.timeout(BOUND_S):
        await closing
    return stats


def _assert_withdrawn_without_faults(stats: CacheStatistics, kv: torch.Tensor, target: torch.Tensor,
                                     before: torch.Tensor) -> None:
    """All PAGES pages counted withdrawn, no fault of any kind (disk_read_failed, pool_exhausted,
    load_shortened among them), and nothing reached the slots ``target``."""
    assert stats.pages_withdrawn == PAGES
    errors = {kind: n for kind, n in stats.errors.items() if n}
    assert not errors, errors
    assert torch.equal(kv[:, target.to(DEVICE)], before)


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["load", "stream", "prefetch"])
async def test_a_close_during_a_promotions_wait_for_room_withdraws_its_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    on_disk = prompt(71, PAGES * T)
    await _fill_disk(tmp_path, on_disk)
    release = threading.Event()
    _hold_later_chunks(monkeypatch, release)
    kv = make_kv(72)
    # offload_wait far beyond the test: the wait ends by the close or by the chunk, not by time.
    cache = KVCache(config(tmp_path, pool_pages=2 * PAGES, offload_wait=600.0), LAYOUT, kv)
    go_on = asyncio.Event()
    try:
        await cache.start()
        assert not cache.pool.ready  # the second chunk is held
        manager, disk = cache.manager, cache.disk
        assert disk is not None
        # The usable chunk is full of referenced pages: a promotion must wait for the second one.
        other = prompt(73, PAGES * T)
        assert (await cache.offload(other, torch.arange(PAGES * T))).stored == PAGES
        holding = await cache.match(other)
        assert holding.pool_pages == PAGES
        match = await cache.match(on_disk)
        assert (match.pool_pages, match.disk_pages) == (0, PAGES)

        waiting = asyncio.Event()
        real_wait = manager._wait_for_room

        async def wait_for_room(*, disk_io: bool = True) -> bool:  # a spy: the real wait runs
            waiting.set()
            return await real_wait(disk_io=disk_io)

        real_load_wait = manager._wait_for_load_room

        async def wait_for_load_room() -> bool:  # a load's or stream's wait (62ee642: its own loop)
            waiting.set()
            return await real_load_wait()

        monkeypatch.setattr(manager, "_wait_for_room", wait_for_room)
        monkeypatch.setattr(manager, "_wait_for_load_room", wait_for_load_room)
        disk_closed = _pause_after_disk_close(monkeypatch, disk, go_on)
        target = torch.arange(100, 100 + PAGES * T)
        before = kv[:, target.to(DEVICE)].clone()
        stream = None
        if call == "load":
            work: asyncio.Future[Any] = asyncio.ensure_future(cache.load(match, target))
        elif call == "stream":
            stream = await cache.start_load(match, target)
            work = asyncio.ensure_future(stream.wait_front(0))
        else:
            match.release()
            work = asyncio.ensure_future(cache.prefetch(on_disk))
        async with asyncio.timeout(BOUND_S):
            await waiting.wait()
        assert not work.done()
        closing = asyncio.ensure_future(cache.aclose())
        async with asyncio.timeout(BOUND_S):
            # Fixed: the call ends as the close begins. Before: it waited on, through the disk
            # tier's close, for the chunk released below.
            await asyncio.wait([work, asyncio.ensure_future(disk_closed.wait())],
                               return_when=asyncio.FIRST_COMPLETED)
        release.set()  # the second chunk becomes usable
        async with asyncio.timeout(BOUND_S):
            outcome: Any = await work
            if stream is not None:
                assert outcome == PAGES * T  # the front never moved: nothing was launched
                outcome = await stream.finish()
        holding.release()
        stats = await _stats_then_close(cache, closing, go_on)
    finally:
        release.set()
        go_on.set()
        await cache.aclose()
    _assert_withdrawn_without_faults(stats, kv, target, before)  # a prefetch's counted nowhere before
    assert stats.pages_promoted == 0
    if call == "load":
        assert (outcome.tokens, outcome.pool_pages, outcome.disk_pages) == (0, 0, 0)
    elif call == "stream":
        assert outcome.loaded_from == PAGES * T and outcome.disk_pages == 0
    else:
        assert outcome.promoted == 0


@pytest.mark.asyncio
async def test_a_load_whose_disk_reads_land_after_the_close_began_withdraws_their_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk part of a load cut by the close: its reads ran in the tier (and landed: the pages
    # stay promoted), but their results reached the load only once the close had begun. Nothing
    # is copied into the slots, the pages count withdrawn, nothing counts as a fault.
    on_disk = prompt(74, PAGES * T)
    await _fill_disk(tmp_path, on_disk)
    kv = make_kv(75)
    cache = KVCache(config(tmp_path, pool_pages=4 * PAGES), LAYOUT, kv)
    gate, go_on = asyncio.Event(), asyncio.Event()
    try:
        await cache.start()
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        real_read = disk.read_many  # a load reads its disk pages in batches
        read: list[bool] = []
        all_read = asyncio.Event()

        async def landed_late(*args: Any) -> list[bool]:  # the real reads, their results held back
            oks = await real_read(*args)
            read.extend(oks)
            if len(read) == PAGES:
                all_read.set()
            await gate.wait()
            return oks

        monkeypatch.setattr(disk, "read_many", landed_late)
        disk_closed = _pause_after_disk_close(monkeypatch, disk, go_on)
        match = await cache.match(on_disk)
        assert match.disk_pages == PAGES
        target = torch.arange(100, 100 + PAGES * T)
        before = kv[:, target.to(DEVICE)].clone()
        work = asyncio.ensure_future(cache.load(match, target))
        async with asyncio.timeout(BOUND_S):
            await all_read.wait()  # every read ran in the tier and landed
        assert all(read) and not work.done()
        closing = asyncio.ensure_future(cache.aclose())
        async with asyncio.timeout(BOUND_S):
            await disk_closed.wait()
        gate.set()
        async with asyncio.timeout(BOUND_S):
            result = await work
        stats = await _stats_then_close(cache, closing, go_on)
    finally:
        gate.set()
        go_on.set()
        await cache.aclose()
    assert (result.tokens, result.disk_pages) == (0, 0)
    _assert_withdrawn_without_faults(stats, kv, target, before)
