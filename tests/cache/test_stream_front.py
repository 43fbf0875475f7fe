"""`LoadStream.wait_front`: an engine (or a test) awaits the load's front instead of polling it.

Disk reads are held on a gate (the real read runs once it opens), so each test is driven by events:
the front cannot move while the reads are held, and moves once they land. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache

T = LAYOUT.page_tokens
PAGES = 6
N = PAGES * T
BOUND_S = 30.0


async def _fill_disk(path: Path, tokens: list[int]) -> torch.Tensor:
    kv = make_kv(80)
    async with KVCache(config(path, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(len(tokens)))
        await cache.flush()
    return kv


def _gate_reads(monkeypatch: pytest.MonkeyPatch, cache: KVCache, gate: asyncio.Event, asked: asyncio.Event) -> None:
    """Hold every disk read of ``cache`` until ``gate`` opens; ``asked`` is set by the first one."""
    disk = cache.disk
    assert disk is not None
    real: Callable[..., Awaitable[bool]] = disk.read

    async def held(*args: Any) -> bool:
        asked.set()
        await gate.wait()
        return await real(*args)

    monkeypatch.setattr(disk, "read", held)


@pytest.mark.asyncio
async def test_wait_front_returns_once_the_front_moved_past_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(81, N)
    source = await _fill_disk(tmp_path, tokens)
    kv = make_kv(82)
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        gate, asked = asyncio.Event(), asyncio.Event()
        _gate_reads(monkeypatch, cache, gate, asked)
        target = torch.arange(10, 10 + N)
        try:
            async with await cache.start_load(await cache.match(tokens), target) as stream:
                waiter = asyncio.ensure_future(stream.wait_front(N - 2 * T))
                async with asyncio.timeout(BOUND_S):
                    await asked.wait()  # the loader waits on a held read: the front cannot move
                for _ in range(20):
                    await asyncio.sleep(0)
                assert not waiter.done() and stream.front == N
                assert await stream.wait_front(N) == N  # already there: at once
                gate.set()
                async with asyncio.timeout(BOUND_S):
                    front = await waiter
                    assert front <= N - 2 * T and front % T == 0
                    assert await stream.wait_front(0) == 0  # an idle engine: everything is loaded
                    result = await stream.finish()
        finally:
            gate.set()
        assert (result.loaded_from, result.disk_pages) == (0, PAGES)
        assert torch.equal(kv[:, target.to(DEVICE)], source[:, :N])
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_wait_front_on_pool_pages_and_when_the_engine_meets_the_load(tmp_path: Path) -> None:
    tokens = prompt(83, N)
    kv = make_kv(84)
    async with KVCache(config(None, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(N))
        target = torch.arange(50, 50 + N)
        async with await cache.start_load(await cache.match(tokens), target) as stream:
            async with asyncio.timeout(BOUND_S):
                assert await stream.wait_front(0) == 0
                assert (await stream.finish()).loaded_from == 0
        assert torch.equal(kv[:, target.to(DEVICE)], kv[:, :N])
        # The engine claims everything first: the front never reaches 0, and wait_front says where
        # it stopped once the loader is done instead of waiting forever.
        async with await cache.start_load(await cache.match(tokens), target) as stream:
            assert stream.claim(N) == N
            async with asyncio.timeout(BOUND_S):
                assert await stream.wait_front(0) == N
                assert (await stream.finish()).loaded_from == N
        await assert_quiescent(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("stop", ["cancel", "stream_close", "claim"])
async def test_wait_front_never_outlives_a_cancel_a_close_or_the_fronts_meeting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    # The reads stay held throughout: only the stop ends the wait (the cache's close while a
    # promotion waits is tests/cache/test_manager_close_promote.py's stream case).
    tokens = prompt(85, N)
    await _fill_disk(tmp_path, tokens)
    kv = make_kv(86)
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        gate, asked = asyncio.Event(), asyncio.Event()
        _gate_reads(monkeypatch, cache, gate, asked)
        target = torch.arange(0, N)
        before = kv[:, target.to(DEVICE)].clone()
        stream = await cache.start_load(await cache.match(tokens), target)
        try:
            waiter = asyncio.ensure_future(stream.wait_front(0))
            async with asyncio.timeout(BOUND_S):
                await asked.wait()
            for _ in range(20):
                await asyncio.sleep(0)
            assert not waiter.done()
            async with asyncio.timeout(BOUND_S):
                if stop == "cancel":
                    waiter.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await waiter
                    gate.set()  # the stream went on, untouched: it loads everything
                    assert await stream.wait_front(0) == 0
                    assert (await stream.finish()).loaded_from == 0
                elif stop == "stream_close":
                    closing = asyncio.ensure_future(stream.aclose())
                    assert await waiter == N  # nothing was launched
                    await closing
                else:
                    assert stream.claim(N) == N  # the engine computes it all: the fronts met at N
                    assert await waiter == N
                    assert (await stream.finish()).loaded_from == N
        finally:
            gate.set()
            await stream.aclose()
        if stop != "cancel":
            assert torch.equal(kv[:, target.to(DEVICE)], before)  # nothing reached the slots
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_wait_front_refuses_a_bad_token(tmp_path: Path) -> None:
    tokens = prompt(87, N)
    async with KVCache(config(None, pool_pages=32), LAYOUT, make_kv(88)) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(N))
        match = await cache.match(tokens)
        async with await cache.start_load(match, torch.arange(T, N), from_token=T) as stream:
            for bad in ("8", 8.0, True, None):
                with pytest.raises(TypeError, match="token must be an int"):
                    await stream.wait_front(bad)  # type: ignore[arg-type]
            for bad in (T - 1, N + 1, -1):
                with pytest.raises(ValueError, match="outside"):
                    await stream.wait_front(bad)
            async with asyncio.timeout(BOUND_S):
                assert await stream.wait_front(T) == T  # from_token itself is a valid target
                assert (await stream.finish()).loaded_from == T
        await assert_quiescent(cache)
