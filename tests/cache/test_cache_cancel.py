"""Cancellation never leaves a copy running into (or out of) the caller's KV slots.

Contract: when ``load`` or ``offload`` raises ``CancelledError``, no copy touching the caller's
slots is still pending; on CUDA every such copy is already ordered before the engine stream's
later work. These tests hold the copy thread (or a copy itself) on a gate, cancel the call, and
check that nothing writes the slots after ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from cache_helpers import (
    DEVICE,
    LAYOUT,
    assert_quiescent,
    cancel_behind_a_busy_copy_thread,
    config,
    make_kv,
    mover_of,
    prompt,
)
from loop_probes import until_thread

from aiokv import KVCache

T = LAYOUT.page_tokens
cpu_only = pytest.mark.skipif(DEVICE.type != "cpu", reason="the copy thread exists for CPU KV buffers")


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@cpu_only
@pytest.mark.asyncio
async def test_cancelled_load_never_writes_the_slots_after_cancellation() -> None:
    # Regression: copies queued on the copy thread ran after CancelledError, into slots the engine
    # had already reused; the next offload stored the old prompt's KV under the new prompt's keys.
    kv = make_kv(40)
    tokens = prompt(40, 8 * T)
    async with KVCache(config(None, pool_pages=16, launch_pages=1, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(8 * T))
        target = torch.arange(100, 100 + 8 * T)
        kv[:, target] = 0
        match = await cache.match(tokens)
        # Cancelled once it queued some of its copies behind the blocked copy thread (2 turns).
        after_cancel = await cancel_behind_a_busy_copy_thread(cache, kv, target, cache.load(match, target),
                                                              lambda: _turns(2))
        assert torch.equal(kv[:, target], after_cancel), "a copy wrote the slots after CancelledError"
        # The engine reuses the slots for another prompt: its offload stores what it wrote.
        other = prompt(41, 8 * T)
        kv[:, target] = make_kv(41)[:, : 8 * T]
        wanted = kv[:, target].clone()
        await cache.offload(other, target)
        kv[:, target] = 0
        loaded = await cache.load(await cache.match(other), target)
        assert loaded.tokens == 8 * T
        assert torch.equal(kv[:, target], wanted)
        await assert_quiescent(cache)


@cpu_only
@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["load", "offload"])
async def test_cancelled_call_waits_for_its_running_copy(call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A copy already running when the call is cancelled cannot be stopped: the call returns
    # (raising CancelledError) only after it finished, never while it still touches the slots.
    kv = make_kv(42)
    tokens = prompt(42, 4 * T)
    async with KVCache(config(None, pool_pages=16, launch_pages=1, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        if call == "load":
            await cache.offload(tokens, torch.arange(4 * T))
        mover = mover_of(cache)
        gate, entered = threading.Event(), threading.Event()
        finished: list[int] = []
        original: Callable[..., Any] = getattr(mover, call)

        def slow(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            gate.wait()
            result = original(*args, **kwargs)
            finished.append(1)
            return result

        monkeypatch.setattr(mover, call, slow)
        target = torch.arange(50, 50 + 4 * T)
        if call == "load":
            task = asyncio.create_task(cache.load(await cache.match(tokens), target))
        else:
            task = asyncio.create_task(cache.offload(tokens, target))
        try:
            await until_thread(entered.is_set, "the copy thread entered the copy")
            task.cancel()
            await _turns(20)
            assert not task.done(), "the call returned while its copy was still running"
        finally:
            gate.set()  # never leave the copy thread blocked, also when the test fails
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == [1], "the running copy must have finished; later ones never start"
        await cache.flush()
        assert finished == [1]
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_cancelled_offload_stores_nothing_and_is_ordered_before_reuse() -> None:
    # On CUDA the engine stream waits on every launched offload copy before the call raises, so
    # the engine's next writes to the slots cannot race the gather; on the CPU nothing is pending.
    kv = make_kv(43)
    tokens = prompt(43, 6 * T)
    async with KVCache(config(None, pool_pages=16, launch_pages=1, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        task = asyncio.create_task(cache.offload(tokens, torch.arange(6 * T)))
        await _turns(2)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            kv[:, : 6 * T] = 7  # the engine reuses the slots at once
        await cache.flush()
        match = await cache.match(tokens)
        # Pages either committed with the prompt's own KV (the copy finished before the cancel)
        # or not at all: never the bytes the engine wrote after the cancellation.
        target = torch.arange(200, 200 + match.tokens)
        reference = make_kv(43)[:, : match.tokens]
        loaded = await cache.load(match, target)
        assert torch.equal(kv[:, target[: loaded.tokens]], reference[:, : loaded.tokens])
        await assert_quiescent(cache)


def _prefix_oracle(tokens: list[int]) -> torch.Tensor:
    """KV ``[L, n, rows, D]`` where token i's rows derive from ``tokens[: i + 1]`` only.

    Two prompts agree on a token's KV exactly when they share its whole prefix, so a page served
    under the wrong prefix (or bytes from another prompt left by a stray copy) cannot pass.
    """
    rows = []
    state = xxhash.xxh64(b"oracle")
    for token in tokens:
        state.update(token.to_bytes(8, "little"))
        gen = torch.Generator().manual_seed(state.intdigest() & (2**63 - 1))
        rows.append(torch.randn(LAYOUT.num_layers, LAYOUT.rows, LAYOUT.head_dim, generator=gen))
    return torch.stack(rows, dim=1).to(LAYOUT.dtype)


@pytest.mark.asyncio
async def test_soak_random_cancellation_with_reused_slots_never_serves_wrong_kv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's way: slots go back to a free list the moment a call returns or is cancelled,
    # and are at once rewritten for another prompt and offloaded.
    rng = random.Random(11)
    slots_total = 16 * 8 * T  # enough for 16 concurrent calls of the longest prompt
    kv = torch.zeros(LAYOUT.num_layers, slots_total, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    kv = kv.to(DEVICE)
    trunks = [prompt(600 + i, 4 * T) for i in range(3)]
    prompts = [trunk[: rng.randrange(1, 5) * T] + prompt(700 + j, 4 * T) for j, trunk in enumerate(trunks * 16)]
    oracles = [_prefix_oracle(p).to(DEVICE) for p in prompts]
    free = list(range(slots_total))
    wrong: list[str] = []
    counts = {"done": 0, "cancelled": 0, "loaded_tokens": 0}

    cfg = config(tmp_path, pool_pages=10, disk_pages=30, launch_pages=1, launch_turn_s=0)
    async with KVCache(cfg, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        if DEVICE.type == "cpu":
            # A slow copy device: each copy runs several times over (copies are idempotent), so
            # copies queue up behind each other as they do behind a large offload in production.
            mover = mover_of(cache)
            for name in ("load", "offload"):
                original: Callable[..., Any] = getattr(mover, name)

                def slow(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                    for _ in range(30):
                        result = _original(*args, **kwargs)
                    return result

                monkeypatch.setattr(mover, name, slow)

        def take(n: int) -> torch.Tensor:
            # LIFO, as engines reuse the blocks freed last: a cancelled call's slots go out first.
            chosen = [free.pop() for _ in range(n)]
            return torch.tensor(chosen, dtype=torch.long)

        async def op(index: int) -> None:
            which = rng.randrange(len(prompts))
            tokens, oracle = prompts[which], oracles[which]
            length = rng.randrange(T, len(tokens) + 1)
            if rng.random() < 0.4:
                slots = take(length)
                try:
                    kv[:, slots.to(DEVICE)] = oracle[:, :length]
                    await cache.offload(tokens[:length], slots)
                finally:
                    free.extend(slots.tolist())
                return
            match = await cache.match(tokens[:length])
            try:
                slots = take(match.tokens)
                try:
                    result = await cache.load(match, slots)
                    got = kv[:, slots[: result.tokens].to(DEVICE)]
                    if not torch.equal(got, oracle[:, : result.tokens]):
                        wrong.append(f"op {index}: prompt {which}, {result}")
                    counts["loaded_tokens"] += result.tokens
                finally:
                    kv[:, slots.to(DEVICE)] = 0  # the engine reuses them
                    free.extend(slots.tolist())
            finally:
                match.release()

        async def supervised(index: int) -> None:
            task = asyncio.ensure_future(op(index))
            if rng.random() < 0.5:
                await _turns(rng.randrange(0, 12))
                task.cancel()
            try:
                await task
                counts["done"] += 1
            except asyncio.CancelledError:
                counts["cancelled"] += 1

        async def worker(first: int) -> None:
            for step in range(25):  # each worker starts its next call as soon as one ends
                await supervised(first + step)

        await asyncio.gather(*(worker(i * 100) for i in range(16)))
        assert not wrong, wrong[:5]
        assert counts["cancelled"] > 50 and counts["loaded_tokens"] > 0, counts
        await assert_quiescent(cache)
