"""The stream's loop-thread work per hit (issue #10, loop lag while streaming) without a change of meaning.

A stream records one entry per launched copy (a 64-page layer-wise load is one copy, not 64 page
entries), settles per copy, and a ``wait_layer`` on a layer already in place costs no loop turn.
These tests pin what that must not change: which pages a launch takes next to the engine's claims,
the loaded suffix and the counters when a copy in the middle fails, the layer answers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, mover_of, prompt

from aiokv import KVCache
from aiokv.results import Tier

T = LAYOUT.page_tokens


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True], ids=["whole-pages", "layered"])
@pytest.mark.parametrize("launch_pages", [1, 3])
@pytest.mark.parametrize(("from_token", "claim_to"), [(0, 0), (0, 5), (0, 2 * T), (0, 2 * T + 1), (3, 3),
                                                       (3, T - 1), (3, 9 * T + 2)])
async def test_a_launch_takes_every_page_the_engine_did_not_claim_into(
    layered: bool, launch_pages: int, from_token: int, claim_to: int
) -> None:
    # The loader works out how far down a launch reaches from the claimed front (was a walk page by
    # page): the engine claims before the loader's first turn, the load brings exactly the pages
    # whose tokens were not claimed, from their first unclaimed page on, and nothing else.
    pages = 10
    n = pages * T
    kv = make_kv(90)
    original = kv.clone()
    tokens = prompt(90, n)
    async with KVCache(config(None, pool_pages=16, launch_pages=launch_pages, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        target = torch.arange(100, 100 + n - from_token)
        kv[:, target.to(DEVICE)] = 0
        stream = await cache.start_load(await cache.match(tokens), target, from_token=from_token, layered=layered)
        assert stream.claim(claim_to) == max(claim_to, from_token)
        result = await stream.finish()
        first = from_token // T if claim_to <= from_token else -(-claim_to // T)
        expect_from = max(first * T, from_token)
        assert (result.claimed, result.loaded_from, result.pool_pages) == (max(claim_to, from_token),
                                                                           expect_from, pages - first)
        got = kv[:, target.to(DEVICE)]
        assert torch.equal(got[:, expect_from - from_token :], original[:, expect_from:n])
        assert bool((got[:, : expect_from - from_token] == 0).all())  # the engine's part: untouched
        assert cache.stats().loaded_tokens[Tier.POOL] == (pages - first) * T
        await assert_quiescent(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("failing", [1, 2, 3])
async def test_a_failed_copy_in_the_middle_ends_the_loaded_suffix_and_is_counted_once(
    monkeypatch: pytest.MonkeyPatch, failing: int
) -> None:
    # Launches of 2 pages from the back: [4, 5], [2, 3], [0, 1]. Launch ``failing`` raises in the
    # copy engine (injected): the suffix loaded is what the launches before it brought, the fault
    # is counted once (not once per page of the copy), and every page reference is given back.
    n = 6 * T
    kv = make_kv(91)
    original = kv.clone()
    tokens = prompt(91, n)
    async with KVCache(config(None, pool_pages=16, launch_pages=2, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        mover = mover_of(cache)
        real = mover.load
        calls = [0]

        def fails_once(page_ids: list[int], slots: torch.Tensor, skip: int = 0, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == failing:
                raise RuntimeError("copy engine fault (injected)")
            return real(page_ids, slots, skip, **kwargs)

        monkeypatch.setattr(mover, "load", fails_once)
        target = torch.arange(60, 60 + n)
        kv[:, target.to(DEVICE)] = 0
        async with await cache.start_load(await cache.match(tokens), target) as stream:
            result = await stream.finish()
        loaded = 2 * (failing - 1)  # pages of the launches before the failed one
        assert (result.loaded_from, result.pool_pages, result.disk_pages) == (n - loaded * T, loaded, 0)
        got = kv[:, target.to(DEVICE)]
        assert torch.equal(got[:, n - loaded * T :], original[:, n - loaded * T : n])
        stats = cache.stats()
        assert (stats.errors["copy_failed"], stats.errors["load_shortened"]) == (1, 1)
        assert (stats.loaded_tokens[Tier.POOL], stats.pages_withdrawn) == (loaded * T, 0)
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_waiting_on_layers_already_in_place_takes_no_loop_turn() -> None:
    # An engine waits on every layer in turn; once they landed, each wait gave up a loop turn (a
    # gather of done futures still yields): 32 layers, 32 turns of the engine's step.
    n = 5 * T
    kv = make_kv(92)
    original = kv.clone()
    tokens = prompt(92, n)
    async with KVCache(config(None, pool_pages=16), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        target = torch.arange(40, 40 + n)
        async with await cache.start_load(await cache.match(tokens), target, layered=True) as stream:
            await stream.launched()
            for layer in range(LAYOUT.num_layers):
                assert await stream.wait_layer(layer)  # until every layer landed
            turns: list[int] = []
            asyncio.get_running_loop().call_soon(turns.append, 1)
            for layer in range(LAYOUT.num_layers):
                assert await stream.wait_layer(layer)
            assert turns == []  # the loop did not run a callback in between
            await asyncio.sleep(0)
            assert turns == [1]
            result = await stream.finish()
        assert result.loaded_from == 0
        assert torch.equal(kv[:, target.to(DEVICE)], original[:, :n])
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_layer_given_up_still_answers_false_without_a_loop_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    # The layer-wise copy fails in the copy engine (injected): every layer answers False (the
    # engine computes what it lacks), also on the path that takes no loop turn, and finish counts it.
    n = 3 * T
    kv = make_kv(93)
    tokens = prompt(93, n)
    async with KVCache(config(None, pool_pages=16), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))

        def broken(*_: object, **__: object) -> None:
            raise RuntimeError("copy engine fault (injected)")

        if DEVICE.type != "cpu":
            pytest.skip("the CPU layer-wise copy is the one patched here")
        monkeypatch.setattr(mover_of(cache), "load_layers", broken)
        async with await cache.start_load(await cache.match(tokens), torch.arange(n), layered=True) as stream:
            await stream.launched()
            assert not await stream.wait_layer(0)  # the copy's failure is awaited here
            for layer in range(LAYOUT.num_layers):
                assert not await stream.wait_layer(layer)
            result = await stream.finish()
        assert (result.loaded_from, result.pool_pages) == (n, 0)
        assert cache.stats().errors["copy_failed"] == 1
        await assert_quiescent(cache)
