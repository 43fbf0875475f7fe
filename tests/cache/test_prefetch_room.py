"""A prefetch beside loads waiting for pool room: nobody gives up, nobody sleeps ``offload_wait``.

A load (or stream) that finds the pool full and holds nothing waits for room, and gives up at once
(``pool_exhausted``) when every load and stream running waits for room and nothing in flight can
free a page (``LoadPath._nothing_frees_room``: no background work, no disk I/O, no reservation).
A prefetch was not counted among the loads running: between its reads' end (its pages committed,
each still referenced by the prefetch) and its release of them (a few loop turns: the gather over
its read groups, the shield), the disk was idle and nothing was reserved, so a load that looked
then saw "nothing frees room" and gave up, although the prefetch's pages went onto the LRU a
moment later. Here the load's look is pinned into that window (the disk reads are gated, the
load's wait begins at the first loop turn after the prefetch's pages were committed): it gave up
(``pool_exhausted``, ``load_shortened``, nothing loaded) before the fix; now the prefetch counts as
a load running while it promotes and holds pages, and the load loads whole once they go back.

The reverse: a prefetch's own promotion never waits for room that loads hold (only for chunks
being prepared): with the pool full it stops at once (``pool_exhausted``), so a load waiting
beside it neither waits on it for ``offload_wait`` nor makes it wait.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, errors_of, make_kv, prompt
from loop_probes import until_spin

from aiokv import DiskBackend, KVCache

T = LAYOUT.page_tokens
POOL = 4
WAIT_S = 30.0
"""``offload_wait``: a wait nothing ends shows as one this long."""
SHORT_S = 2.0
SPIN_S = 30.0
"""Seconds a test waits for a state at most (then it fails)."""

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: results read it directly")


async def _turns(until: Any) -> None:
    """Yield loop turns until ``until()``, checked at each turn (the first turn it holds is the
    window a later step lands in); fails after :data:`SPIN_S` seconds. Threads make these states
    hold (disk reads), so the bound is in seconds: 2,000 turns were not enough under load in CI."""
    await until_spin(until, "the state", SPIN_S)


async def _store(tmp_path: Path, source: torch.Tensor, *prompts: list[int]) -> None:
    """Write ``prompts`` whole to the disk tier in ``tmp_path`` (prompt k's KV from ``source``'s
    slots ``[k * 8 * T, ...)``)."""
    async with KVCache(config(tmp_path, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        for k, tokens in enumerate(prompts):
            await writer.offload(tokens, torch.arange(k * 8 * T, k * 8 * T + len(tokens)))
        await writer.flush()


def _gate_reads(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every page read of a THREADS tier (its worker threads read through ``os.preadv``)
    until the returned event is set (a test must always set it)."""
    gate, real = threading.Event(), os.preadv

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        gate.wait(60)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return gate


def _cache(tmp_path: Path, kv: torch.Tensor) -> KVCache:
    return KVCache(config(tmp_path, pool_pages=POOL, disk_pages=96, backend=DiskBackend.THREADS,
                          offload_wait=WAIT_S), LAYOUT, kv)


@pytest.mark.asyncio
async def test_a_load_waits_while_a_prefetch_holds_the_pages_it_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = make_kv(601)
    p, x = prompt(601, POOL * T), prompt(602, T)
    await _store(tmp_path, source, p, x)
    kv = make_kv(602)
    cache = _cache(tmp_path, kv)
    await cache.start()
    gate = _gate_reads(monkeypatch)
    try:
        await cache.pool.wait_ready()
        manager = cache._manager
        table = cache.pool.table
        mx = await cache.match(x)
        assert (mx.pool_pages, mx.disk_pages) == (0, 1)
        # The load's wait for room begins at the first loop turn after the prefetch committed its
        # pages (they are still referenced by it; the disk is idle): the window to pin.
        real = manager._wait_for_load_room
        arrived = asyncio.Event()
        looked: list[bool] = []  # per wait: whether the prefetch still ran at its look
        took: list[float] = []
        prefetch: asyncio.Future[Any] | None = None

        async def wait() -> bool:
            arrived.set()
            await _turns(lambda: table.statistics().reserved == 0)
            assert prefetch is not None
            looked.append(not prefetch.done())
            began = time.perf_counter()
            try:
                return await real()
            finally:
                took.append(time.perf_counter() - began)

        manager._wait_for_load_room = wait  # type: ignore[method-assign]
        prefetch = asyncio.ensure_future(cache.prefetch(p))
        await _turns(lambda: table.statistics().reserved == POOL)  # its reads are submitted (and held)
        target = torch.arange(100, 100 + T)
        load = asyncio.ensure_future(cache.load(mx, target))
        await asyncio.wait_for(arrived.wait(), SHORT_S)  # the pool was full of the prefetch's pages
        gate.set()
        async with asyncio.timeout(WAIT_S * 2):
            fetched = await prefetch
            result = await load
        assert fetched.promoted == POOL, fetched
        assert looked and looked[0], "the load's look did not land while the prefetch held its pages"
        assert result.tokens == T, (result, errors_of(cache), took)
        assert torch.equal(kv[:, target], source[:, 8 * T : 9 * T])
        assert errors_of(cache) == {}, errors_of(cache)
        assert all(t < SHORT_S for t in took), took
        await assert_quiescent(cache)
        assert (manager._room_waiters, manager._room_holders, manager.loads_running) == (0, set(), 0)
    finally:
        gate.set()
        await cache.aclose()


@pytest.mark.asyncio
async def test_a_prefetch_never_waits_for_room_that_loads_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's match holds 3 pages, a prefetch reads the 4th (gated), a load waits for room
    (the read may free a page). A second prefetch then finds the pool full: it stops at once
    (``pool_exhausted``), never waiting ``offload_wait`` for the load, nor making the load wait
    for it. Once the read ends, the first prefetch's page goes back and the load loads whole."""
    source = make_kv(611)
    held_tokens, y, x, q = prompt(611, (POOL - 1) * T), prompt(612, T), prompt(613, T), prompt(614, T)
    await _store(tmp_path, source, held_tokens, y, x, q)
    kv = make_kv(612)
    cache = _cache(tmp_path, kv)
    await cache.start()
    gate: threading.Event | None = None
    try:
        await cache.pool.wait_ready()
        manager = cache._manager
        table = cache.pool.table
        assert (await cache.prefetch(held_tokens)).promoted == POOL - 1
        held = await cache.match(held_tokens)
        mx = await cache.match(x)
        assert (mx.pool_pages, mx.disk_pages) == (0, 1)
        gate = _gate_reads(monkeypatch)
        first = asyncio.ensure_future(cache.prefetch(y))
        await _turns(lambda: table.statistics().reserved == 1)
        target = torch.arange(100, 100 + T)
        load = asyncio.ensure_future(cache.load(mx, target))
        await _turns(lambda: manager._room_waiters == 1)
        began = time.perf_counter()
        async with asyncio.timeout(WAIT_S * 2):
            second = await cache.prefetch(q)
        assert time.perf_counter() - began < SHORT_S
        assert second.promoted == 0, second
        assert errors_of(cache) == {"pool_exhausted": 1}, errors_of(cache)
        assert not load.done(), "the load gave up while a read could still free a page"
        assert manager._room_waiters == 1
        began = time.perf_counter()
        gate.set()
        async with asyncio.timeout(WAIT_S * 2):
            assert (await first).promoted == 1
            result = await load
        assert time.perf_counter() - began < SHORT_S
        assert result.tokens == T, (result, errors_of(cache))
        assert torch.equal(kv[:, target], source[:, 16 * T : 17 * T])
        assert errors_of(cache) == {"pool_exhausted": 1}, errors_of(cache)
        held.release()
        await assert_quiescent(cache)
        assert (manager._room_waiters, manager._room_holders, manager.loads_running) == (0, set(), 0)
    finally:
        if gate is not None:
            gate.set()
        await cache.aclose()
