"""Review 263 / helper 267: a loop-wide cancel (an application's SIGTERM handler cancelling every
task of the loop but its own) ended the disk tier's write-behind workers and nothing replaced them
until the close: ``flush()`` waited for ever, every later offload's pages stayed queued (and
referenced: the pool filled, offloads gave up for room), none of it written.

Each test cuts a cache with a real disk tier (the suite's conftest runs it under asyncio and
uvloop), bounds every wait, then reopens the directory and loads the pages: bit-exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, prompt
from loop_probes import cancel_every_task_but, until, waiting_in

from aiokv import KVCache

T = LAYOUT.page_tokens
BOUND_S = 10.0

pytestmark = [pytest.mark.asyncio, pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: compared directly")]


async def reopened_serves(directory: Path, prompts: list[list[int]], kv: torch.Tensor, sources: list[torch.Tensor],
                          pool_pages: int = 16) -> None:
    """A fresh cache on ``directory`` loads every prompt whole from disk, its KV bit-exact."""
    target = torch.zeros_like(kv)
    async with KVCache(config(directory, pool_pages=pool_pages), LAYOUT, target) as cache:
        for tokens, source in zip(prompts, sources, strict=True):
            slots = torch.arange(len(tokens))
            target.zero_()
            async with asyncio.timeout(BOUND_S):
                match = await cache.match(tokens)
                assert match.tokens == len(tokens), match
                got = await cache.load(match, slots)
            assert got.tokens == len(tokens), got
            assert torch.equal(target[:, slots], kv[:, source])
        await assert_quiescent(cache)


async def test_flush_after_a_cut_writes_the_later_offload(tmp_path: Path) -> None:
    """The reviewer's reproduction: cut while idle, offload four pages, flush (hung: queued=4)."""
    kv = make_kv(1)
    tokens, source = prompt(1, 4 * T), torch.arange(4 * T)
    async with KVCache(config(tmp_path / "disk"), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert await cancel_every_task_but(asyncio.current_task()) > 0
        assert (await cache.offload(tokens, source)).stored == 4
        async with asyncio.timeout(BOUND_S):
            await cache.flush()
        disk = cache.disk
        assert disk is not None
        stats = disk.statistics()
        assert (stats.write_behind_queued, stats.write_behind_writing, stats.writes) == (0, 0, 4), stats
        await assert_quiescent(cache)
    await reopened_serves(tmp_path / "disk", [tokens], kv, [source])


async def test_pages_queued_at_the_cut_are_written_by_flush_alone(tmp_path: Path) -> None:
    """The cut lands while the offload's pages are queued (no worker took one yet); nothing is
    offloaded after it: the flush alone brings workers back."""
    kv = make_kv(2)
    tokens, source = prompt(2, 6 * T), torch.arange(6 * T)
    async with KVCache(config(tmp_path / "disk"), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, source)).stored == 6
        disk = cache.disk
        assert disk is not None
        queued = disk.statistics().write_behind_queued
        assert queued == 6, disk.statistics()  # no worker ran since: all six wait in the queue
        assert await cancel_every_task_but(asyncio.current_task()) > 0
        async with asyncio.timeout(BOUND_S):
            await cache.flush()
        stats = disk.statistics()
        assert (stats.write_behind_queued, stats.writes) == (0, 6), stats
        await assert_quiescent(cache)
    await reopened_serves(tmp_path / "disk", [tokens], kv, [source])


async def test_a_cut_while_flush_waits_spares_the_flush(tmp_path: Path) -> None:
    """The cancel spares a flush already waiting (and this test): the workers it cut are replaced
    under that wait, which returns; every page is on disk."""
    kv = make_kv(3)
    tokens, source = prompt(3, 6 * T), torch.arange(6 * T)
    base = config(tmp_path / "disk")
    assert base.disk is not None
    # One worker: it holds one page at the cut, five wait queued (with a worker per page the
    # queue was empty at the cut and the cut workers' own pages ended the join).
    cfg = dataclasses.replace(base, disk=dataclasses.replace(base.disk, write_behind_workers=1))
    async with KVCache(cfg, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, source)).stored == 6
        flushing = asyncio.create_task(cache.flush())
        await until(lambda: waiting_in(flushing, "join"))  # the write-behind's join
        disk = cache.disk
        assert disk is not None
        assert disk.statistics().write_behind_queued >= 4, disk.statistics()
        await cancel_every_task_but(asyncio.current_task(), flushing)
        async with asyncio.timeout(BOUND_S):
            await flushing
        await assert_quiescent(cache)
    # A write the cancel cut in flight is the tier's (its job's) to finish or abandon: pages the
    # queue still held at the cut are all written; the loads check whatever the disk serves.
    target = torch.zeros_like(kv)
    async with KVCache(config(tmp_path / "disk"), LAYOUT, target) as cache:
        async with asyncio.timeout(BOUND_S):
            match = await cache.match(tokens)
            got = await cache.load(match, torch.arange(len(tokens)))
        assert got.tokens >= 5 * T, got  # at most the page the worker had taken was cut
        n = got.tokens
        assert torch.equal(target[:, :n], kv[:, source[:n]])
        await assert_quiescent(cache)


async def test_offloads_get_room_from_pages_queued_at_the_cut(tmp_path: Path) -> None:
    """A pool of 8 pages, all queued for writing when the cut lands: the next offload (8 other
    pages) waits for room. Before, no worker was left to free it: after ``offload_wait`` the
    offload gave up (pool_exhausted) and the pool stayed full until the close."""
    kv = make_kv(4)
    first, second = prompt(41, 8 * T), prompt(42, 8 * T)
    src1, src2 = torch.arange(8 * T), torch.arange(8 * T, 16 * T)
    async with KVCache(config(tmp_path / "disk", pool_pages=8, offload_wait=BOUND_S), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert (await cache.offload(first, src1)).stored == 8
        assert await cancel_every_task_but(asyncio.current_task()) > 0
        async with asyncio.timeout(BOUND_S / 2):  # under offload_wait: a give-up is a timeout here
            result = await cache.offload(second, src2)
        assert result.stored == 8, (result, cache.stats().errors)
        async with asyncio.timeout(BOUND_S):
            await cache.flush()
        await assert_quiescent(cache)
    await reopened_serves(tmp_path / "disk", [first, second], kv, [src1, src2], pool_pages=8)


@pytest.mark.parametrize("drain", [True, False])
async def test_close_after_a_cut_drains_or_drops_the_queue(tmp_path: Path, drain: bool) -> None:
    """``aclose`` right after a cut with pages queued: drained (written) or dropped (counted),
    within a bound either way."""
    kv = make_kv(5)
    tokens, source = prompt(5, 6 * T), torch.arange(6 * T)
    base = config(tmp_path / "disk")
    assert base.disk is not None
    cfg = dataclasses.replace(base, disk=dataclasses.replace(base.disk, drain_on_close=drain))
    cache = KVCache(cfg, LAYOUT, kv)
    await cache.start()
    try:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, source)).stored == 6
        assert await cancel_every_task_but(asyncio.current_task()) > 0
    finally:
        async with asyncio.timeout(BOUND_S):
            await cache.aclose()
    disk = cache.disk
    assert disk is not None
    stats = disk.statistics()
    if drain:
        assert (stats.writes, stats.dropped) == (6, 0), stats
        await reopened_serves(tmp_path / "disk", [tokens], kv, [source])
    else:
        assert (stats.writes, stats.dropped) == (0, 6), stats


async def test_cancelling_until_none_is_left_ends_then_flush_writes(tmp_path: Path) -> None:
    """A canceller that cancels every other task until none is left (a shutdown's idiom) ends: no
    worker comes back on its own (a done callback that replaced them spawned one per round, for
    ever). The next flush brings them back and writes what the cut left queued."""
    kv = make_kv(6)
    tokens, source = prompt(6, 6 * T), torch.arange(6 * T)
    async with KVCache(config(tmp_path / "disk"), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, source)).stored == 6
        rounds = 0
        while await cancel_every_task_but(asyncio.current_task()):
            rounds += 1
            assert rounds < 20, "tasks keep coming back"
        disk = cache.disk
        assert disk is not None
        assert disk.statistics().write_behind_queued == 6, disk.statistics()
        async with asyncio.timeout(BOUND_S):
            await cache.flush()
        stats = disk.statistics()
        assert (stats.write_behind_queued, stats.writes) == (0, 6), stats
        await assert_quiescent(cache)
    await reopened_serves(tmp_path / "disk", [tokens], kv, [source])
