"""Adversarial review of 62ee642 (room waits: callers waiting only on each other give up at once).

Two defects, each with a case that failed before the fix:

* A wait for room that the write-behind could still end (``_nothing_frees_room`` said no while it
  wrote) slept to ``offload_wait`` once the writes ended: the write-behind gives its references
  back, but a page another caller still holds (here the engine's match) goes onto no LRU, and
  nothing woke the waiter. A load beside the engine's match waited the whole ``offload_wait``
  (30 s here) although nothing could free a page from the writes' end on.
* An offload's reservations (its copy in flight) fill the pool: its pages are committed onto the
  write-behind and come back, but two loads waiting for room found "every load waits, nothing in
  flight" and gave up at once (``pool_exhausted``); before 62ee642 they waited for those pages.

Then a seeded drive (``AIOKV_REV163_SEEDS``, default 0-5): concurrent loads, streams (claims,
layered, from_token), prefetches and offloads over 3-8 page pools with a disk tier, random
cancels and acloses, slowed copies; per round no call takes more than a few seconds with
``offload_wait`` 60 s, what a result says loaded is bit-exact, and once quiescent no room waiter,
holder or running load is left.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, CopyThreadGate, assert_quiescent, config, make_kv, prompt, slow_host_copies
from loop_probes import until_spin

from aiokv import DiskBackend, KVCache

T = LAYOUT.page_tokens
WAIT_S = 30.0
"""``offload_wait``: a missed wake-up shows as a wait this long."""
SHORT_S = 2.0
SPIN_S = 30.0
"""Seconds a test waits for a state at most (then it fails)."""

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: results read it directly")


async def _turns(until: Any) -> None:
    """Yield loop turns until ``until()``, checked at each turn (the first turn it holds is the
    window a later step lands in); fails after :data:`SPIN_S` seconds. Threads make these states
    hold (disk reads), so the bound is in seconds: 2,000 turns were not enough under load in CI."""
    await until_spin(until, "the state", SPIN_S)


async def _store(tmp_path: Path, tokens: list[int], source: torch.Tensor) -> None:
    async with KVCache(config(tmp_path, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(tokens, torch.arange(len(tokens)))
        await writer.flush()


@pytest.mark.asyncio
async def test_a_waiter_looks_again_when_the_write_behind_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = make_kv(301)
    x = prompt(301, 2 * T)
    await _store(tmp_path, x, source)
    held_tokens = prompt(302, 4 * T)
    gate, real = threading.Event(), os.pwritev

    def pwritev(fd: int, buffers: Any, offset: int) -> int:
        gate.wait(60)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)  # the tier's worker threads write through it
    kv = make_kv(302)
    cache = KVCache(config(tmp_path, pool_pages=4, disk_pages=96, backend=DiskBackend.THREADS,
                           offload_wait=WAIT_S), LAYOUT, kv)
    await cache.start()
    try:
        await cache.pool.wait_ready()
        assert (await cache.offload(held_tokens, torch.arange(4 * T))).stored == 4
        held = await cache.match(held_tokens)  # the engine's match: the pool's 4 pages
        match = await cache.match(x)
        assert (match.pool_pages, match.disk_pages) == (0, 2)
        manager = cache._manager
        load = asyncio.ensure_future(cache.load(match, torch.arange(100, 100 + 2 * T)))
        await _turns(lambda: manager._room_waiters == 1)
        began = time.perf_counter()
        gate.set()  # the writes end: their references go back, the match still holds every page
        async with asyncio.timeout(WAIT_S * 2):
            result = await load
        took = time.perf_counter() - began
        assert result.tokens == 0, result
        assert took < SHORT_S, f"the waiter slept {took:.1f} s after the write-behind ended"
        assert cache.stats().errors.get("pool_exhausted", 0) == 1
        held.release()
        await assert_quiescent(cache)
        assert (manager._room_waiters, manager._room_holders, manager.loads_running) == (0, set(), 0)
    finally:
        gate.set()
        await cache.aclose()


@pytest.mark.asyncio
async def test_loads_wait_for_an_offloads_reservations(tmp_path: Path) -> None:
    source = make_kv(311)
    x, y = prompt(311, T), prompt(312, T)
    await _store(tmp_path, x, source)
    await _store(tmp_path, y, source)
    kv = make_kv(313)
    cache = KVCache(config(tmp_path, pool_pages=4, disk_pages=96, offload_wait=WAIT_S), LAYOUT, kv)
    await cache.start()
    try:
        await cache.pool.wait_ready()
        manager = cache._manager
        mx, my = await cache.match(x), await cache.match(y)
        assert (mx.disk_pages, my.disk_pages) == (1, 1)
        gate = CopyThreadGate(cache)
        try:
            offload = asyncio.ensure_future(cache.offload(prompt(314, 4 * T), torch.arange(4 * T)))
            await _turns(lambda: cache.pool.table.statistics().reserved == 4)
            loads = [asyncio.ensure_future(cache.load(m, torch.arange(b, b + T)))
                     for m, b in ((mx, 100), (my, 150))]
            await _turns(lambda: manager._room_waiters == 2 or all(f.done() for f in loads))
            assert not any(f.done() for f in loads), "they gave up beside the offload's reservations"
        finally:
            await gate.open()
        async with asyncio.timeout(WAIT_S * 2):
            stored = await offload
            results = await asyncio.gather(*loads)
        assert stored.stored == 4
        assert [r.tokens for r in results] == [T, T], results
        assert torch.equal(kv[:, 100:100 + T], source[:, 0:T])
        assert torch.equal(kv[:, 150:150 + T], source[:, 0:T])
        await assert_quiescent(cache)
        assert (manager._room_waiters, manager._room_holders, manager.loads_running) == (0, set(), 0)
    finally:
        await cache.aclose()


# -- the seeded drive --------------------------------------------------------------------------

SEEDS = [int(s) for s in os.environ.get("AIOKV_REV163_SEEDS", "0-5").split(",") if s] if "-" not in \
    os.environ.get("AIOKV_REV163_SEEDS", "0-5") else list(range(
        int(os.environ.get("AIOKV_REV163_SEEDS", "0-5").split("-")[0]),
        int(os.environ.get("AIOKV_REV163_SEEDS", "0-5").split("-")[1]) + 1))
"""``AIOKV_REV163_SEEDS``: ``a-b`` or ``a,b,c`` (default 0-5)."""
CALL_S = 5.0
"""No call may take longer (``offload_wait`` is 60 s: a missed wake-up overruns it)."""
SRC = 512
"""The engine buffer's first slots hold the source KV (offloads read them); targets follow."""


def _prompts(rng: random.Random) -> list[tuple[list[int], torch.Tensor]]:
    """Prompts sharing a trunk: (tokens, the source slot of each token)."""
    trunk = prompt(rng.randrange(10**6), 4 * T)
    out = []
    for k in range(6):
        shared = rng.choice([0, 2, 4]) * T
        own = rng.randint(1, 5) * T
        base = 4 * T + k * 5 * T
        out.append((trunk[:shared] + prompt(rng.randrange(10**6), own),
                    torch.cat([torch.arange(shared), torch.arange(base, base + own)])))
    return out


class _Drive:
    def __init__(self, cache: KVCache, kv: torch.Tensor, source: torch.Tensor, rng: random.Random,
                 prompts: list[tuple[list[int], torch.Tensor]]) -> None:
        self.cache, self.kv, self.source, self.rng, self.prompts = cache, kv, source, rng, prompts
        self.took: list[tuple[str, float]] = []

    def _check(self, what: str, src: torch.Tensor, target: torch.Tensor, lo: int, hi: int, start: int) -> None:
        """Tokens ``[lo, hi)`` loaded into ``target`` (whose slot 0 is token ``start``)."""
        if hi > lo:
            assert torch.equal(self.kv[:, target[lo - start : hi - start]], self.source[:, src[lo:hi]]), \
                (what, lo, hi, start)

    async def one(self, i: int) -> None:
        rng = self.rng
        kind = rng.choice(["load", "load", "stream", "stream", "prefetch", "offload"])
        tokens, src = rng.choice(self.prompts)
        target = torch.arange(SRC + i * 48, SRC + i * 48 + 48)
        began = time.perf_counter()
        try:
            await self._run(kind, tokens, src, target)
        except asyncio.CancelledError:
            pass
        finally:
            self.took.append((kind, time.perf_counter() - began))

    async def _run(self, kind: str, tokens: list[int], src: torch.Tensor, target: torch.Tensor) -> None:
        rng, cache = self.rng, self.cache
        for _ in range(rng.randrange(4)):
            await asyncio.sleep(0)
        if kind == "prefetch":
            await cache.prefetch(tokens)
            return
        if kind == "offload":
            await cache.offload(tokens, src)  # the source KV sits in the buffer's first slots
            return
        match = await cache.match(tokens)
        try:
            await self._hit(kind, match, src, target)
        finally:
            if not match.released:
                match.release()  # cancelled before its load or stream took it

    async def _hit(self, kind: str, match: Any, src: torch.Tensor, target: torch.Tensor) -> None:
        rng, cache = self.rng, self.cache
        start = rng.choice([0, 0, T // 2, T + 1]) if match.tokens > T + 1 else 0
        if kind == "load":
            result = await cache.load(match, target[: match.tokens - start], from_token=start)
            self._check("load", src, target, start, result.tokens, start)
            return
        stream = await cache.start_load(match, target[: match.tokens - start], from_token=start,
                                        layered=rng.random() < 0.5)
        async with stream:
            pos = start
            while rng.random() < 0.6 and (end := stream.claim(pos + rng.randint(1, 2 * T))) > pos:
                pos = end
                await asyncio.sleep(0)
            if rng.random() < 0.2:
                await stream.aclose()
                return
            result = await stream.finish()
        self._check("stream", src, target, result.loaded_from, result.tokens, start)

    async def round(self, calls: int) -> None:
        tasks = [asyncio.ensure_future(self.one(i)) for i in range(calls)]
        for task in tasks:
            if self.rng.random() < 0.25:
                for _ in range(self.rng.randrange(12)):
                    await asyncio.sleep(0)
                task.cancel()
        async with asyncio.timeout(CALL_S * 4):
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        # A task cancelled before its first step raises there; any other failure is the test's.
        errors = [o for o in outcomes if o is not None and not isinstance(o, asyncio.CancelledError)]
        if errors:
            raise errors[0]
        slow = [(k, t) for k, t in self.took if t > CALL_S]
        assert not slow, slow


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
async def test_seeded_room_drive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    rng = random.Random(seed)
    slow_host_copies(monkeypatch, seed)
    source = make_kv(400 + seed, slots=SRC)
    prompts = _prompts(rng)
    async with KVCache(config(tmp_path, pool_pages=64, disk_pages=128), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        for tokens, src in prompts:
            if rng.random() < 0.8:
                await writer.offload(tokens, src)
        await writer.flush()
    kv = make_kv(500 + seed, slots=SRC + 48 * 10)
    kv[:, :SRC] = source
    cache = KVCache(config(tmp_path, pool_pages=rng.randint(3, 8), disk_pages=128, offload_wait=60.0,
                           launch_pages=rng.choice([1, 2])), LAYOUT, kv)
    await cache.start()
    try:
        manager = cache._manager
        drive = _Drive(cache, kv, source, rng, prompts)
        for _ in range(3):
            await drive.round(rng.randint(4, 10))
            await assert_quiescent(cache)
            assert (manager._room_waiters, manager._room_holders, manager.loads_running) == (0, set(), 0)
            assert torch.equal(kv[:, :SRC], source), "an offload's source was written"
    finally:
        await cache.aclose()
    assert (manager._room_waiters, manager._room_holders, manager.loads_running) == (0, set(), 0)
