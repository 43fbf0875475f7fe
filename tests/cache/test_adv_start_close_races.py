"""Adversarial: ``aclose`` at random loop turns of ``start``, ``start`` cancelled at random turns, and
``aclose`` while an offload, a load, a prefetch and a streaming load are in flight.

Each ends in bounded time with a defined outcome (``start`` completes or raises ``RuntimeError``;
the calls in flight return or raise ``CancelledError``/``RuntimeError``, never something else),
every match ends released, later calls raise ``RuntimeError``, a second ``start`` is refused, and
nothing outlives the cache: no thread, no ``/dev/shm`` segment of this process.
"""

from __future__ import annotations

import asyncio
import glob
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, config, make_kv, prompt

from aiokv import KVCache

T = LAYOUT.page_tokens
TRIALS = 45
JOIN_S = 2.0


def _segments() -> list[str]:
    return glob.glob(f"/dev/shm/aiokv-{os.getpid()}-*")


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _close_during_start(cache: KVCache, turns: int) -> None:
    start = asyncio.ensure_future(cache.start())
    await _turns(turns)
    close = asyncio.ensure_future(cache.aclose())
    started, closed = await asyncio.wait_for(asyncio.gather(start, close, return_exceptions=True), 30)
    assert started is None or isinstance(started, RuntimeError), repr(started)
    assert closed is None, repr(closed)


async def _cancel_start(cache: KVCache, turns: int) -> None:
    start = asyncio.ensure_future(cache.start())
    await _turns(turns)
    start.cancel()
    (outcome,) = await asyncio.gather(start, return_exceptions=True)
    assert outcome is None or isinstance(outcome, asyncio.CancelledError), repr(outcome)
    await asyncio.wait_for(cache.aclose(), 30)


async def _close_during_calls(cache: KVCache, turns: int, seed: int) -> None:
    await cache.start()
    tokens = prompt(seed, 6 * T)
    await cache.offload(tokens, torch.arange(6 * T))
    await cache.flush()
    streamed, loaded = await cache.match(tokens), await cache.match(tokens)

    async def stream() -> object:
        s = await cache.start_load(streamed, torch.arange(150, 150 + streamed.tokens))
        return await s.finish()

    calls = [
        asyncio.ensure_future(cache.offload(prompt(seed + 1, 8 * T), torch.arange(40, 40 + 8 * T))),
        asyncio.ensure_future(cache.load(loaded, torch.arange(200, 200 + loaded.tokens))),
        asyncio.ensure_future(cache.prefetch(prompt(seed + 2, 4 * T))),
        asyncio.ensure_future(stream()),
    ]
    await _turns(turns)
    close = asyncio.ensure_future(cache.aclose())
    *outcomes, closed = await asyncio.wait_for(asyncio.gather(*calls, close, return_exceptions=True), 30)
    assert closed is None, repr(closed)
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException) or isinstance(
            outcome, (asyncio.CancelledError, RuntimeError)), repr(outcome)
    assert streamed.released and loaded.released
    with pytest.raises(RuntimeError):
        await cache.match(tokens)
    with pytest.raises(RuntimeError):
        await cache.offload(tokens, torch.arange(6 * T))


@pytest.mark.asyncio
async def test_start_and_close_at_random_turns_leave_nothing_behind(tmp_path: Path) -> None:
    rng = random.Random(5)
    threads_before = {t.ident for t in threading.enumerate()}
    for trial in range(TRIALS):
        cache = KVCache(config(tmp_path, pool_pages=16), LAYOUT, make_kv(trial))
        turns = rng.randrange(0, 12)
        kind = trial % 3
        if kind == 0:
            await _close_during_start(cache, turns)
        elif kind == 1:
            await _cancel_start(cache, turns)
        else:
            await _close_during_calls(cache, turns, trial * 10)
        with pytest.raises(RuntimeError):
            await cache.start()  # closed is final
        assert _segments() == [], f"trial {trial}: a closed cache left its shared memory"
    # Threads end a moment after the close that stopped them returns: joined, within one bound
    # (a blocking join of the known threads; asyncio.to_thread would start the thread it checks for).
    deadline = time.monotonic() + JOIN_S
    new = [t for t in threading.enumerate() if t.ident not in threads_before]
    for thread in new:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [t.name for t in new if t.is_alive()]
    assert not left, left
