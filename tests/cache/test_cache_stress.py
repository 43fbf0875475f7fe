"""Cancellation at every await, and a 1,000-coroutine stress run with random cancellations."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache

T = LAYOUT.page_tokens


async def _cancel_after(steps: int, make: Callable[[], Awaitable[object]]) -> bool:
    """Run ``make()`` as a task and cancel it after ``steps`` loop iterations; True if it finished first."""
    task = asyncio.ensure_future(make())
    for _ in range(steps):
        if task.done():
            break
        await asyncio.sleep(0)
    if task.done():
        task.result()
        return True
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return False
    return True


@pytest.mark.asyncio
@pytest.mark.parametrize("operation", ["offload", "load_pool", "load_disk", "prefetch"])
async def test_cancellation_at_every_await_leaks_nothing(tmp_path: Path, operation: str) -> None:
    kv = make_kv(30)
    tokens = prompt(30, 6 * T)
    async with KVCache(config(tmp_path, pool_pages=12), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()

        async def setup() -> None:
            if operation == "offload":
                return
            await cache.offload(tokens, torch.arange(6 * T))
            await cache.flush()
            if operation in ("load_disk", "prefetch"):
                for i in range(3):  # push the prompt out of the pool
                    await cache.offload(prompt(300 + i, 4 * T), torch.arange(100, 100 + 4 * T))
                    await cache.flush()

        async def run() -> object:
            if operation == "offload":
                return await cache.offload(tokens, torch.arange(6 * T))
            if operation == "prefetch":
                return await cache.prefetch(tokens)
            match = await cache.match(tokens)
            try:
                return await cache.load(match, torch.arange(50, 50 + match.tokens))
            finally:
                match.release()

        steps = 0
        while True:
            await setup()
            finished = await _cancel_after(steps, run)
            await assert_quiescent(cache)
            # Reset so the next round finds the tiers populated the same way.
            cache.pool.table.evict(cache.pool.num_pages)
            if finished:
                break
            steps += 1
        print(f"{operation}: cancelled at {steps} successive points")
        assert steps > 0, "the operation never awaited: nothing was cancelled"


@pytest.mark.asyncio
async def test_a_thousand_concurrent_callers_with_random_cancellations(tmp_path: Path) -> None:
    rng = random.Random(7)
    families = 6
    family_tokens = 8 * T
    callers = 1000
    # Source KV: family f's token t lives at slot f * family_tokens + t; the same prefix always
    # has the same KV, as in a real engine. Each caller loads into its own slot range.
    source_slots = families * family_tokens
    kv = make_kv(31, slots=source_slots + callers * family_tokens)
    original = kv[:, :source_slots].clone()
    bases = [prompt(400 + f, family_tokens) for f in range(families)]
    errors: list[BaseException] = []
    outcomes = {"finished": 0, "cancelled": 0}

    async with KVCache(config(tmp_path, pool_pages=20, disk_pages=40), LAYOUT, kv) as cache:

        async def caller(index: int) -> None:
            family = rng.randrange(families)
            length = rng.randrange(1, family_tokens + 1)
            tokens = bases[family][:length]
            salt = rng.choice([None, "tenant-a"])
            region = torch.arange(family * family_tokens, family * family_tokens + length)
            target_start = source_slots + index * family_tokens
            op = rng.choice(["offload", "load", "load", "prefetch"])
            if op == "offload":
                await cache.offload(tokens, region, salt=salt)
            elif op == "prefetch":
                await cache.prefetch(tokens, salt=salt)
            else:
                match = await cache.match(tokens, salt=salt)
                try:
                    target = torch.arange(target_start, target_start + match.tokens)
                    result = await cache.load(match, target)
                finally:
                    match.release()
                got = kv[:, target_start : target_start + result.tokens]
                want = original[:, family * family_tokens : family * family_tokens + result.tokens]
                if not torch.equal(got, want):
                    errors.append(AssertionError(f"caller {index}: wrong KV for {result}"))

        async def supervised(index: int) -> None:
            task = asyncio.ensure_future(caller(index))
            if rng.random() < 0.3:
                for _ in range(rng.randrange(0, 6)):
                    await asyncio.sleep(0)
                task.cancel()
            try:
                await task
                outcomes["finished"] += 1
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
            except BaseException as exc:
                errors.append(exc)

        await asyncio.gather(*(supervised(i) for i in range(callers)))
        assert not errors, errors[:3]
        assert outcomes["finished"] > 500 and outcomes["cancelled"] > 50, outcomes
        await assert_quiescent(cache)
        stats = cache.stats()
        assert stats.pages_stored > 0 and stats.loaded_tokens
        assert stats.disk is not None and stats.disk.bytes_stored <= 40 * (LAYOUT.page_bytes + 4096)
