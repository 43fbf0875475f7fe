"""Adversarial soak: streaming loads (plain and layered, the engine claiming and "computing" from
the front), plain loads, prefetches and offloads run concurrently over a small pool and disk tier,
on a slow copy device, with random cancellation of any call (``finish``, ``aclose``, the whole
operation) and the engine's slot reuse (LIFO: a cancelled call's slots go out first and are
rewritten and offloaded at once). Each token's KV is a function of its whole prefix, so a late
copy into reused slots, a page served for the wrong prefix or a half-copied page shows up.
``test_cache_cancel.py`` soaks load/offload; this one adds streams, prefetch and aclose.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, mover_of, prompt
from test_adv_crash_restart import prefix_oracle

from aiokv import KVCache

T = LAYOUT.page_tokens
WORKERS = 12
STEPS = 40


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.skipif(DEVICE.type != "cpu", reason="slows the CPU copy thread")
async def test_soak_streams_prefetch_and_cancellation_never_serve_wrong_kv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(int(os.environ.get("ADV_SEED", "2024")))
    slots_total = WORKERS * 10 * T
    kv = torch.zeros(LAYOUT.num_layers, slots_total, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    trunks = [prompt(800 + i, 5 * T) for i in range(3)]
    prompts = [trunk[: rng.randrange(1, 6) * T] + prompt(900 + j, rng.randrange(1, 5) * T)
               for j, trunk in enumerate(trunks * 10)]
    oracles = [prefix_oracle(p) for p in prompts]
    free = list(range(slots_total))
    wrong: list[str] = []
    counts = {"done": 0, "cancelled": 0, "streamed": 0, "loaded": 0, "prefetched": 0}

    cfg = config(tmp_path, pool_pages=24, disk_pages=64, launch_pages=1, launch_turn_s=0)
    async with KVCache(cfg, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        mover = mover_of(cache)
        for name in ("load", "offload"):
            original: Callable[..., Any] = getattr(mover, name)

            def slow(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                for _ in range(20):  # copies are idempotent: a slow device
                    result = _original(*args, **kwargs)
                return result

            monkeypatch.setattr(mover, name, slow)

        def take(n: int) -> torch.Tensor:
            return torch.tensor([free.pop() for _ in range(n)], dtype=torch.long)

        def check(index: int, which: int, slots: torch.Tensor, low: int, high: int, what: str) -> None:
            if not torch.equal(kv[:, slots[low:high]], oracles[which][:, low:high]):
                wrong.append(f"op {index}: {what} of prompt {which} [{low}, {high})")

        async def stream_op(index: int, which: int, tokens: list[int], layered: bool) -> None:
            match = await cache.match(tokens)
            # The engine's own prefix cache may hold the first tokens (mid-page too).
            start = rng.choice([0, 0, rng.randrange(0, match.tokens + 1)])
            slots = take(match.tokens)
            try:
                kv[:, slots[:start]] = oracles[which][:, :start]
                stream = await cache.start_load(match, slots[start:], from_token=start)
                async with stream:
                    pos, chunk = start, rng.choice([T, 2 * T, 3])
                    while (end := stream.claim(pos + chunk)) > pos:
                        kv[:, slots[pos:end]] = oracles[which][:, pos:end]  # the engine computes
                        pos = end
                        await asyncio.sleep(rng.choice([0, 0.0005, 0.002]))  # prefill time
                    if layered:
                        await stream.launched()
                        for layer in range(LAYOUT.num_layers):
                            await stream.wait_layer(layer)
                    if rng.random() < 0.15:
                        await stream.aclose()  # the engine gives up early
                        return
                    result = await stream.finish()
                    assert result.from_token == start
                    kv[:, slots[pos : result.loaded_from]] = oracles[which][:, pos : result.loaded_from]
                    check(index, which, slots, 0, result.tokens, "stream")
                    counts["streamed"] += result.loaded_tokens
            finally:
                kv[:, slots] = 0
                free.extend(slots.tolist())

        async def op(index: int) -> None:
            which = rng.randrange(len(prompts))
            tokens = prompts[which]
            kind = rng.random()
            if kind < 0.3:
                length = rng.randrange(T, len(tokens) + 1)
                slots = take(length)
                try:
                    kv[:, slots] = oracles[which][:, :length]
                    await cache.offload(tokens[:length], slots)
                finally:
                    free.extend(slots.tolist())
            elif kind < 0.4:
                counts["prefetched"] += (await cache.prefetch(tokens)).promoted
            elif kind < 0.75:
                await stream_op(index, which, tokens, layered=rng.random() < 0.4)
            else:
                match = await cache.match(tokens)
                start = rng.choice([0, 0, rng.randrange(0, match.tokens + 1)])
                slots = take(match.tokens)
                try:
                    kv[:, slots[:start]] = oracles[which][:, :start]
                    result = await cache.load(match, slots[start:], from_token=start)
                    check(index, which, slots, 0, result.tokens, "load")
                    counts["loaded"] += result.tokens
                finally:
                    kv[:, slots] = 0
                    free.extend(slots.tolist())

        async def supervised(index: int) -> None:
            task = asyncio.ensure_future(op(index))
            if rng.random() < 0.45:
                await _turns(rng.randrange(0, 15))
                task.cancel()
            try:
                await task
                counts["done"] += 1
            except asyncio.CancelledError:
                counts["cancelled"] += 1

        async def worker(first: int) -> None:
            for step in range(STEPS):
                await supervised(first + step)

        await asyncio.wait_for(asyncio.gather(*(worker(i * 100) for i in range(WORKERS))), 50)
        assert not wrong, wrong[:5]
        assert counts["cancelled"] > 40 and counts["streamed"] > 0 and counts["loaded"] > 0, counts
        await assert_quiescent(cache)
        assert sorted(free) == list(range(slots_total))
