"""A disk hit larger than the pool loads whole: its pages pass through the pool in windows.

A load promoted every disk page of its hit at once and kept each until its copies ended, so a hit
of 8 disk pages through a 4-page pool loaded 4 (``pool_exhausted``, ``load_shortened``), a 1-page
pool loaded 1 page of 2, and two such loads at once starved each other. Now a load that finds the
pool full waits for its own copies, gives their pages back and promotes the rest; a stream does the
same with its copies. Real page files on disk, bit-exact checks; the engine's KV buffer on the CPU,
or on a GPU with ``AIOKV_TEST_DEVICE=cuda`` (the tests read it through torch on the current
stream, which a load orders after its copies).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt, slow_host_copies

from aiokv import KVCache

T = LAYOUT.page_tokens
POISON = 100.0
BOUND_S = 60.0

async def _write(root: Path, kv: torch.Tensor, prompts: list[list[int]]) -> None:
    """Store each prompt's pages (its KV at slots 0.. of ``kv``) on disk, through a roomy pool."""
    async with KVCache(config(root, pool_pages=64, disk_pages=96), LAYOUT, kv) as writer:
        await writer.pool.wait_ready()
        for tokens in prompts:
            await writer.offload(tokens, torch.arange(len(tokens)))
        await writer.flush()


async def _small(root: Path, kv: torch.Tensor, pool_pages: int, **extra: object) -> KVCache:
    cache = KVCache(config(root, pool_pages=pool_pages, disk_pages=96, **extra), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    return cache


def _errors(cache: KVCache) -> dict[str, int]:
    return {k: v for k, v in cache.stats().errors.items() if k in ("pool_exhausted", "load_shortened")}


@pytest.mark.asyncio
@pytest.mark.parametrize(("pool_pages", "pages", "from_token", "launch_pages"),
                         [(4, 8, 0, 1), (4, 8, 0, 4), (1, 2, 0, 1), (3, 10, 5, 2), (2, 7, 2 * T, 1)])
async def test_a_disk_hit_larger_than_the_pool_loads_whole(
    tmp_path: Path, pool_pages: int, pages: int, from_token: int, launch_pages: int,
) -> None:
    source = make_kv(81)
    tokens = prompt(81, pages * T)
    await _write(tmp_path, source, [tokens])
    kv = make_kv(82)
    cache = await _small(tmp_path, kv, pool_pages, launch_pages=launch_pages)
    try:
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, pages), match
        target = torch.arange(100, 100 + pages * T - from_token)
        async with asyncio.timeout(BOUND_S):
            result = await cache.load(match, target, from_token=from_token)
        assert result.tokens == pages * T, (result, cache.stats().errors)
        assert result.disk_pages == pages - from_token // T, result
        assert torch.equal(kv[:, target], source[:, from_token : pages * T])
        assert _errors(cache) == {}, cache.stats().errors
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
async def test_a_hit_part_in_the_pool_part_on_disk_loads_whole(tmp_path: Path) -> None:
    source = make_kv(83)
    tokens = prompt(83, 9 * T)
    await _write(tmp_path, source, [tokens])
    kv = make_kv(84)
    cache = await _small(tmp_path, kv, 4)
    try:
        assert (await cache.prefetch(tokens[: 3 * T])).promoted == 3  # the first 3 pages in the pool
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (3, 6), match
        target = torch.arange(40, 40 + 9 * T)
        async with asyncio.timeout(BOUND_S):
            result = await cache.load(match, target)
        assert (result.tokens, result.pool_pages, result.disk_pages) == (9 * T, 3, 6), result
        assert torch.equal(kv[:, target], source[:, : 9 * T])
        assert _errors(cache) == {}, cache.stats().errors
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


async def _load_whole(cache: KVCache, match: Any, target: torch.Tensor, streamed: bool) -> int:
    """Tokens loaded into ``target`` from its start: a plain load, or a stream the engine never claims."""
    if not streamed:
        return (await cache.load(match, target)).tokens
    stream = await cache.start_load(match, target)
    result = await stream.finish()
    return result.tokens - result.loaded_from


@pytest.mark.asyncio
@pytest.mark.parametrize("kinds", [(False, False), (True, False), (True, True)], ids=["loads", "mixed", "streams"])
async def test_two_hits_that_together_overfill_the_pool_both_load_whole(
    tmp_path: Path, kinds: tuple[bool, bool],
) -> None:
    """Each takes half the pool for its first window and needs more: neither may wait on the other
    for ever, and neither is cut short."""
    source = make_kv(85)
    a, b = prompt(85, 6 * T), prompt(86, 6 * T)
    # b's KV sits at slots 6T.. of the source: store it from there.
    async with KVCache(config(tmp_path, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(a, torch.arange(6 * T))
        await writer.offload(b, torch.arange(6 * T, 12 * T))
        await writer.flush()
    kv = make_kv(86)
    cache = await _small(tmp_path, kv, 4, launch_pages=1)
    try:
        for _ in range(3):
            ma, mb = await cache.match(a), await cache.match(b)
            assert (ma.disk_pages, mb.disk_pages) == (6, 6)
            ta, tb = torch.arange(100, 100 + 6 * T), torch.arange(150, 150 + 6 * T)
            kv[:, ta] = POISON
            kv[:, tb] = POISON
            async with asyncio.timeout(BOUND_S):
                ra, rb = await asyncio.gather(_load_whole(cache, ma, ta, kinds[0]),
                                              _load_whole(cache, mb, tb, kinds[1]))
            assert (ra, rb) == (6 * T, 6 * T), (ra, rb, cache.stats().errors)
            assert torch.equal(kv[:, ta], source[:, : 6 * T])
            assert torch.equal(kv[:, tb], source[:, 6 * T : 12 * T])
            assert _errors(cache) == {}, cache.stats().errors
            await assert_quiescent(cache)
            cache.pool.table.evict(cache.pool.num_pages)  # both on disk only again
    finally:
        await cache.aclose()


@pytest.mark.asyncio
async def test_a_pool_held_by_others_still_ends_the_load_after_a_bounded_wait(tmp_path: Path) -> None:
    """A load that holds nothing and finds no room waits offload_wait at most, then is shortened
    (counted): the engine's own match pins every pool page."""
    source = make_kv(87)
    held_tokens, tokens = prompt(87, 4 * T), prompt(88, 3 * T)
    async with KVCache(config(tmp_path, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(held_tokens, torch.arange(4 * T))
        await writer.offload(tokens, torch.arange(4 * T, 7 * T))
        await writer.flush()
    kv = make_kv(88)
    cache = await _small(tmp_path, kv, 4, offload_wait=0.05)
    try:
        assert (await cache.prefetch(held_tokens)).promoted == 4
        held = await cache.match(held_tokens)
        assert held.pool_pages == 4
        match = await cache.match(tokens)
        assert match.disk_pages == 3
        target = torch.arange(100, 100 + 3 * T)
        kv[:, target] = POISON
        async with asyncio.timeout(BOUND_S):
            result = await cache.load(match, target)
        assert result.tokens == 0, result
        assert bool((kv[:, target] == POISON).all())
        errors = _errors(cache)
        assert errors.get("pool_exhausted", 0) >= 1 and errors.get("load_shortened", 0) == 1, errors
        held.release()
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _cancelled_or_whole(cache: KVCache, kv: torch.Tensor, source: torch.Tensor, tokens: list[int],
                              target: torch.Tensor, run: Callable[..., Any], turns: int) -> bool:
    """``run(match, target)`` as a task cancelled after ``turns`` loop turns (never when negative).
    Cancelled: nothing writes ``target`` after the CancelledError (poisoned then, checked after the
    cache is quiescent). Else the whole hit is in ``target``. True when it was cancelled."""
    match = await cache.match(tokens)
    kv[:, target] = POISON
    task = asyncio.ensure_future(run(match, target))
    if turns >= 0:
        await _turns(turns)
        task.cancel()
    try:
        async with asyncio.timeout(BOUND_S):
            await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
        kv[:, target] = POISON
        await assert_quiescent(cache)
        assert bool((kv[:, target] == POISON).all()), "a copy wrote the slots after the load was cancelled"
        return True
    assert torch.equal(kv[:, target], source[:, : len(tokens)]), "not the whole hit, or wrong KV"
    await assert_quiescent(cache)
    return False


async def _plain(cache: KVCache) -> Callable[..., Any]:
    async def run(match: Any, target: torch.Tensor) -> None:
        result = await cache.load(match, target)
        assert result.tokens == match.tokens, (result, cache.stats().errors)

    return run


async def _streamed(cache: KVCache, layered: bool) -> Callable[..., Any]:
    async def run(match: Any, target: torch.Tensor) -> None:
        async with await cache.start_load(match, target, layered=layered) as stream:
            assert await stream.launched() == 0
            for layer in range(LAYOUT.num_layers):
                assert await stream.wait_layer(layer)
            result = await stream.finish()
        assert (result.loaded_from, result.disk_pages) == (0, match.disk_pages), (result, cache.stats().errors)

    return run


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["load", "stream", "layered"])
async def test_a_hit_through_a_small_pool_loads_whole_or_cancels_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str,
) -> None:
    source = make_kv(89)
    tokens = prompt(89, 8 * T)
    await _write(tmp_path, source, [tokens])
    slow_host_copies(monkeypatch, 89)
    kv = make_kv(90)
    rng = random.Random(89)
    cache = await _small(tmp_path, kv, 3, launch_pages=1)
    try:
        run = await (_plain(cache) if how == "load" else _streamed(cache, how == "layered"))
        target = torch.arange(60, 60 + 8 * T)
        outcomes = []
        for i in range(24):
            cache.pool.table.evict(cache.pool.num_pages)  # the whole hit on disk only
            turns = -1 if i % 4 == 0 else rng.randrange(0, 80)
            outcomes.append(await _cancelled_or_whole(cache, kv, source, tokens, target, run, turns))
        assert not all(outcomes), "every run was cancelled: nothing checked the whole hit"
        assert any(outcomes), "no run was cancelled"
        assert _errors(cache) == {}, cache.stats().errors
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize(("pool_pages", "pages"), [(4, 8), (1, 2), (2, 5)])
async def test_a_stream_over_a_disk_hit_larger_than_the_pool_loads_whole(
    tmp_path: Path, pool_pages: int, pages: int,
) -> None:
    source = make_kv(91)
    tokens = prompt(91, pages * T)
    await _write(tmp_path, source, [tokens])
    kv = make_kv(92)
    cache = await _small(tmp_path, kv, pool_pages)
    try:
        for layered in (False, True):
            cache.pool.table.evict(cache.pool.num_pages)
            match = await cache.match(tokens)
            assert match.disk_pages == pages
            target = torch.arange(100, 100 + pages * T)
            kv[:, target] = POISON
            async with asyncio.timeout(BOUND_S):
                stream = await cache.start_load(match, target, layered=layered)
                result = await stream.finish()
            assert (result.loaded_from, result.disk_pages) == (0, pages), (result, cache.stats().errors)
            assert torch.equal(kv[:, target], source[:, : pages * T])
            assert _errors(cache) == {}, cache.stats().errors
            await assert_quiescent(cache)
    finally:
        await cache.aclose()
