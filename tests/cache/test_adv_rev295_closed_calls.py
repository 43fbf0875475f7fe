"""Review 295: a closed ``KVCache`` refuses ``keys``, ``estimate`` and ``note_prefill`` as it refuses
``match``/``offload``/``prefetch``/``flush``: ``RuntimeError("the cache is closed")``, from the
close's first step on, and nothing changes (statistics, the cost model's prefill meter, the match).

Before the fix all three answered as if the cache served: keys were computed, an estimate built
from the rates, and a prefill report folded into a meter whose rates the close had already saved.

``wait_warm`` is left as it was, on purpose (its docstring says why): it returns what the warm-up
did whatever the state, as it returns None before ``start``; checked here so that a later change
to it is a decision, not an accident.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, config, make_kv, prompt
from loop_probes import until

from aiokv import KVCache, Match
from aiokv.kernels.warmup import WarmUp

T = LAYOUT.page_tokens
CLOSED = "^the cache is closed$"


def _snapshot(cache: KVCache, match: Match) -> tuple[Any, ...]:
    return cache.stats(), dict(vars(cache.manager.costs.prefill)), match.released


def _refused(cache: KVCache, tokens: list[int], match: Match) -> None:
    before = _snapshot(cache, match)
    with pytest.raises(RuntimeError, match=CLOSED):
        cache.keys(tokens)
    with pytest.raises(RuntimeError, match=CLOSED):
        cache.keys(tokens, salt="tenant")
    with pytest.raises(RuntimeError, match=CLOSED):
        cache.estimate(match)
    with pytest.raises(RuntimeError, match=CLOSED):
        cache.note_prefill(8 * T, 0.01, prefix=T)
    assert _snapshot(cache, match) == before


@pytest.mark.asyncio
async def test_keys_estimate_and_note_prefill_after_aclose_raise_and_change_nothing() -> None:
    tokens = prompt(2951, 3 * T)
    cache = KVCache(config(None), LAYOUT, make_kv(2951))
    await cache.start()
    await cache.offload(tokens, torch.arange(3 * T))
    match = await cache.match(tokens)
    keys = cache.keys(tokens)  # while it serves: answered
    assert len(keys) == 3 and cache.estimate(match).disk_seconds == 0.0
    cache.note_prefill(8 * T, 0.01)
    await cache.aclose()
    _refused(cache, tokens, match)
    # As the calls that always refused a closed cache do (same exception, same words).
    with pytest.raises(RuntimeError, match=CLOSED):
        await cache.match(tokens)
    match.release()


@pytest.mark.asyncio
async def test_they_refuse_from_the_close_s_first_step_while_it_waits() -> None:
    # A close held by a background job (a copy a cancelled caller left): from its first step on,
    # the cache serves nothing, these calls included.
    tokens = prompt(2952, 2 * T)
    cache = KVCache(config(None), LAYOUT, make_kv(2952))
    await cache.start()
    await cache.offload(tokens, torch.arange(2 * T))
    match = await cache.match(tokens)
    job: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    cache.manager.track(job, lambda: None)
    closing = asyncio.ensure_future(cache.aclose())
    try:
        await until(lambda: cache.manager.closing)
        assert not closing.done()
        _refused(cache, tokens, match)
        with pytest.raises(RuntimeError, match=CLOSED):
            await cache.match(tokens)
    finally:
        job.set_result(None)
        await closing
        match.release()


@pytest.mark.asyncio
async def test_a_cache_closed_without_a_start_refuses_them_too() -> None:
    tokens = prompt(2953, 2 * T)
    cache = KVCache(config(None), LAYOUT, make_kv(2953))
    assert len(cache.keys(tokens)) == 2  # before start: keys need no pool (unchanged)
    await cache.aclose()
    before = dict(vars(cache.manager.costs.prefill))
    with pytest.raises(RuntimeError, match=CLOSED):
        cache.keys(tokens)
    with pytest.raises(RuntimeError, match=CLOSED):
        cache.note_prefill(8 * T, 0.01)
    assert dict(vars(cache.manager.costs.prefill)) == before


@pytest.mark.asyncio
async def test_wait_warm_after_aclose_returns_as_documented() -> None:
    # Kept (see KVCache.wait_warm): None before start; while serving, what the warm-up did (None for
    # a CPU KV buffer, which warms nothing; under AIOKV_TEST_DEVICE=cuda the warm-up runs); after the
    # close the same answer. The case of a warm-up the close stopped is
    # tests/core/test_warmup_cache.py (it returns what the warm-up did, stopped).
    kv = make_kv(2954)
    cache = KVCache(config(None), LAYOUT, kv)
    assert await cache.wait_warm() is None
    async with cache:
        serving = await cache.wait_warm()
        if kv.device.type == "cpu":
            assert serving is None
        else:
            assert isinstance(serving, WarmUp) and not serving.stopped, serving
    assert await cache.wait_warm() == serving
