"""Adversarial review 111: a load's and a prefetch's read groups (one ``DiskTier.read_many`` per
~16 MiB, a task per group) under cancellation at every loop turn, mixed with what makes a group
leave its batch path: pages already in the pool inside a group (PRESENT), pages another call is
bringing in (PENDING, a concurrent prefetch), and a pool with too little room (EXHAUSTED).

After every cancel every pool page the pool hands out is taken and overwritten at once; once the
abandoned reads ended none of them changed, the cache is quiescent (no reference, reservation or
background job left) and a full load of the prompt is bit-exact against the source (so no page a
group committed to the pool holds wrong KV). Real page files, both the threads and io_uring backends.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import assert_quiescent
from cancel_points import most_attempts, pause
from group_helpers import (
    GROUP,
    LAYOUT,
    T,
    group_config,
    pages_unchanged,
    put_on_disk,
    random_kv,
    random_tokens,
    take_free_pages,
)

from aiokv import CacheConfig, DiskBackend, KVCache
from aiokv.pagetable import PageHandle

PAGES = GROUP + 7  # two read groups, the second short
N = PAGES * T
POOL_PAGES = PAGES + 12
BACKENDS = [DiskBackend.URING_FIXED, DiskBackend.THREADS]
BOUND_S = 30.0
DENSE = 48
"""Attempts counted in loop turns (cancel_points.pause); then growing sleeps: a load takes one to
a few thousand turns of an idle loop here, depending on the machine's load."""


def _config(root: Path, backend: DiskBackend) -> CacheConfig:
    return group_config(root, PAGES, POOL_PAGES, backend, offload_wait=0.01)


def _kv(seed: int) -> torch.Tensor:
    return random_kv(seed, 4 * N)


def _tokens(seed: int) -> list[int]:
    return random_tokens(seed, N)


async def _on_disk(root: Path, backend: DiskBackend, tokens: list[int], kv: torch.Tensor) -> None:
    await put_on_disk(_config(root, backend), tokens, kv)


async def _exact_from_scratch(cache: KVCache, tokens: list[int], source: torch.Tensor, kv: torch.Tensor) -> None:
    """A full load of ``tokens`` (pool pages and disk pages alike) is bit-exact."""
    match = await cache.match(tokens)
    target = torch.arange(2 * N, 3 * N)
    result = await cache.load(match, target)
    assert result.tokens == N, (result, cache.stats().errors)
    assert torch.equal(kv[:, target], source[:, :N])


def _scene(cache: KVCache, tokens: list[int], scene: int) -> list[PageHandle]:
    """Set the pool up for one attempt: every page of ``tokens`` out of the pool, then per scene
    some of them back in the middle of the first group (PRESENT), or the pool short of room
    (returns the pages holding it)."""
    pool = cache.pool
    for key in cache.keys(tokens):
        pool.table.discard(key)
    if scene == 1:
        return []  # pages put back by the caller's prefetch (below)
    if scene == 3:
        return take_free_pages(cache, POOL_PAGES - GROUP // 2, 0xA0, 0x5A)  # room for half a group
    return []


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_cancel_a_load_at_every_turn_with_present_pending_and_exhausted_pages(
        tmp_path: Path, backend: DiskBackend) -> None:
    source = _kv(11)
    tokens = _tokens(11)
    await _on_disk(tmp_path, backend, tokens, source)
    kv = _kv(12)
    async with KVCache(_config(tmp_path, backend), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        pool = cache.pool
        completed = [0, 0, 0, 0]
        step = 0
        while min(completed) < 1:
            assert step < 4 * most_attempts(DENSE), f"a load never completed: {completed}"
            scene = step % 4
            holding = _scene(cache, tokens, scene)
            if scene == 1:  # pages 3..6 of the first group in the pool, unreferenced
                partial = tokens[: 7 * T]
                await cache.prefetch(partial)
                for key in cache.keys(partial)[:3]:
                    assert pool.table.discard(key)
            match = await cache.match(tokens)
            assert match.pool_pages == 0 and match.disk_pages == PAGES
            other = asyncio.create_task(cache.prefetch(tokens)) if scene == 2 else None
            task = asyncio.create_task(cache.load(match, torch.arange(N, 2 * N - 1), from_token=1))
            await pause(step // 4, DENSE)
            task.cancel()
            try:
                result = await task
            except asyncio.CancelledError:
                fill = 1 + step % 250
                taken = take_free_pages(cache, POOL_PAGES, step % 256, fill)
                async with asyncio.timeout(BOUND_S):
                    if other is not None:
                        await other
                    await cache.flush()  # every abandoned read and copy ended
                pages_unchanged(cache, taken, fill)
            else:
                completed[scene] += 1
                loaded = result.tokens - 1
                assert result.tokens >= 1 + (GROUP // 2 - 1) * T if scene == 3 else result.tokens == N, result
                assert torch.equal(kv[:, N : N + loaded], source[:, 1 : result.tokens])
                if other is not None:
                    async with asyncio.timeout(BOUND_S):
                        await other
            pages_unchanged(cache, holding, 0x5A)
            await assert_quiescent(cache)
            if step % 32 < 4:
                await _exact_from_scratch(cache, tokens, source, kv)
                await assert_quiescent(cache)
            step += 1
        errors = {name for name, count in cache.stats().errors.items() if count}
        assert errors <= {"pool_exhausted", "load_shortened"}, errors


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_cancel_a_prefetch_at_every_turn(tmp_path: Path, backend: DiskBackend) -> None:
    source = _kv(13)
    tokens = _tokens(13)
    await _on_disk(tmp_path, backend, tokens, source)
    kv = _kv(14)
    async with KVCache(_config(tmp_path, backend), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        step = 0
        while True:
            assert step < most_attempts(DENSE), "the prefetch never completed"
            _scene(cache, tokens, 0)
            task = asyncio.create_task(cache.prefetch(tokens))
            await pause(step, DENSE)
            task.cancel()
            try:
                fetched = await task
            except asyncio.CancelledError:
                fill = 1 + step % 250
                taken = take_free_pages(cache, POOL_PAGES, step % 256, fill)
                async with asyncio.timeout(BOUND_S):
                    await cache.flush()
                pages_unchanged(cache, taken, fill)
                await assert_quiescent(cache)
                if step % 8 == 0:
                    await _exact_from_scratch(cache, tokens, source, kv)
                    await assert_quiescent(cache)
                step += 1
                continue
            assert (fetched.pool_pages, fetched.promoted) == (0, PAGES)
            break
        await _exact_from_scratch(cache, tokens, source, kv)
        await assert_quiescent(cache)
        assert not any(cache.stats().errors.values()), cache.stats().errors


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_cancel_a_load_and_a_stream_of_the_same_prompt_at_every_turn(
        tmp_path: Path, backend: DiskBackend) -> None:
    """A load's read groups and a load stream's single promotions (from the back) race for the
    same pages; both are cancelled after the same number of loop turns (the stream by its
    ``finish``, then closed)."""
    source = _kv(15)
    tokens = _tokens(15)
    await _on_disk(tmp_path, backend, tokens, source)
    kv = _kv(16)
    async with KVCache(_config(tmp_path, backend), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        step = 0
        while True:
            assert step < most_attempts(DENSE), "the load never completed"
            _scene(cache, tokens, 0)
            first, second = await cache.match(tokens), await cache.match(tokens)
            stream = await cache.start_load(second, torch.arange(2 * N, 3 * N))
            assert stream.claim(N // 2) >= 0
            load = asyncio.create_task(cache.load(first, torch.arange(N, 2 * N)))
            finish = asyncio.create_task(stream.finish())
            await pause(step, DENSE)
            load.cancel()
            finish.cancel()
            outcomes = await asyncio.gather(load, finish, return_exceptions=True)
            async with asyncio.timeout(BOUND_S):
                await stream.aclose()
            fill = 1 + step % 250
            taken = take_free_pages(cache, POOL_PAGES, step % 256, fill)
            async with asyncio.timeout(BOUND_S):
                await cache.flush()
            pages_unchanged(cache, taken, fill)
            await assert_quiescent(cache)
            loaded, streamed = outcomes
            if not isinstance(streamed, BaseException):  # the stream's loaded suffix is exact
                start = streamed.loaded_from  # type: ignore[union-attr]
                assert torch.equal(kv[:, 2 * N + start : 3 * N], source[:, start:N])
            if not isinstance(loaded, BaseException):
                assert loaded.tokens == N, loaded  # type: ignore[union-attr]
                assert torch.equal(kv[:, N : 2 * N], source[:, :N])
                break
            assert isinstance(loaded, asyncio.CancelledError), loaded
            if step % 8 == 0:
                await _exact_from_scratch(cache, tokens, source, kv)
                await assert_quiescent(cache)
            step += 1
        # pool_exhausted: the test itself takes every free page right after each cancel, while the
        # adopted groups may still need one (a page another call committed and the take evicted).
        errors = {name for name, count in cache.stats().errors.items() if count}
        assert errors <= {"pool_exhausted"}, cache.stats().errors
