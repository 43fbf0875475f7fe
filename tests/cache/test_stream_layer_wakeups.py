"""A layer-wise load wakes the loop only for the layers the engine waits on (issue #10: a wake-up
per landed layer, each the self-pipe, a hand-over and the GIL taken from the loop thread), and a
layer waited on is still handed over as soon as it lands, with its bytes in place."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, assert_quiescent, config, make_kv, mover_of, prompt

from aiokv import KVCache, KVLayout
from aiokv.cuda import CompletionBridge

LAYERS = 12
LAYOUT = KVLayout.mha(LAYERS, 2, 8, torch.float16, page_tokens=4)
PAGES = 8

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU layer futures (CUDA layers are events)")


def _slowed(monkeypatch: pytest.MonkeyPatch, cache: KVCache,
            on_landed: Callable[[int], None]) -> None:
    """The copy thread calls ``on_landed(layer)`` after each layer lands, before it reports it."""
    mover = mover_of(cache)
    real = mover.load_layers

    def load_layers(page_ids: Any, slots: Any, skip: int = 0, on_layer: Any = None, **kwargs: Any) -> Any:
        def landed(layer: int) -> None:
            on_landed(layer)
            on_layer(layer)

        return real(page_ids, slots, skip, landed, **kwargs)

    monkeypatch.setattr(mover, "load_layers", load_layers)


def _counted_posts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many futures the bridge was asked to resolve from a thread (each batch is a wake-up)."""
    posts = [0]
    real = CompletionBridge.resolve_threadsafe

    def counting(self: CompletionBridge, future: asyncio.Future[Any], value: Any) -> None:
        posts[0] += 1
        real(self, future, value)

    monkeypatch.setattr(CompletionBridge, "resolve_threadsafe", counting)
    return posts


@pytest.mark.asyncio
@pytest.mark.parametrize("waits_on_last", [True, False], ids=["waits-on-the-last", "waits-on-none"])
async def test_layers_nobody_waits_on_wake_nothing(monkeypatch: pytest.MonkeyPatch, waits_on_last: bool) -> None:
    # Layers land 5 ms apart while the loop is idle: each used to be posted to the loop on its own
    # (12 wake-ups). Now one future is posted, once the last layer landed (the engine waits on that
    # one, or on none until finish); then a wait on every layer costs no post and no loop turn.
    kv = make_kv(6, LAYOUT)
    original = kv.clone()
    tokens = prompt(6, PAGES * LAYOUT.page_tokens)
    n = len(tokens)
    async with KVCache(config(None, layout=LAYOUT), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, torch.arange(n))).stored == PAGES
        target = torch.arange(100, 100 + n)
        kv[:, target] = 0
        posts = _counted_posts(monkeypatch)
        seen: list[int] = []  # posts so far as each layer lands (before it is reported)

        def landed(layer: int) -> None:
            seen.append(posts[0])
            time.sleep(0.005)  # the loop goes idle between layers: separate posts are separate wake-ups

        _slowed(monkeypatch, cache, landed)
        stream = await cache.start_load(await cache.match(tokens), target, layered=True)
        assert await stream.launched() == 0
        if waits_on_last:
            assert await stream.wait_layer(LAYERS - 1)
        else:
            assert (await asyncio.shield(stream._copies.outcomes())) == [None]
        assert seen == [0] * LAYERS, seen  # before: [0, 1, 2, ...], a post per landed layer
        assert posts[0] == 1  # the last layer's future only: the others resolve on the loop when asked
        assert [await stream.wait_layer(layer) for layer in range(LAYERS)] == [True] * LAYERS
        assert posts[0] == 1
        assert torch.equal(kv[:, target], original[:, :n])
        assert (await stream.finish()).loaded_from == 0
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_layer_waited_on_is_handed_over_as_it_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine waits on layer 3 before it landed: the copy thread posts it when it is reported,
    # while later layers are still held (not at the copy's end), with its bytes in place.
    kv = make_kv(8, LAYOUT)
    original = kv.clone()
    tokens = prompt(8, PAGES * LAYOUT.page_tokens)
    n = len(tokens)
    at_3, go_3, go_5 = threading.Event(), threading.Event(), threading.Event()
    async with KVCache(config(None, layout=LAYOUT), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, torch.arange(n))).stored == PAGES
        target = torch.arange(100, 100 + n)
        kv[:, target] = 0

        def hold(layer: int) -> None:
            if layer == 3:
                at_3.set()
                assert go_3.wait(30), "never released"
            elif layer == 5:
                assert go_5.wait(30), "never released"

        _slowed(monkeypatch, cache, hold)
        stream = await cache.start_load(await cache.match(tokens), target, layered=True)
        try:
            await stream.launched()
            assert await asyncio.to_thread(at_3.wait, 30)  # layer 3 landed, not reported yet
            waiter = asyncio.ensure_future(stream.wait_layer(3))
            for _ in range(5):
                await asyncio.sleep(0)
            assert not waiter.done()
            go_3.set()
            async with asyncio.timeout(20):
                assert await waiter  # while layer 5 is held on the copy thread
            for layer in range(4):
                assert torch.equal(kv[layer, target], original[layer, :n]), layer
            assert not kv[6:, target].any()
        finally:
            go_3.set()
            go_5.set()
        assert [await stream.wait_layer(layer) for layer in range(LAYERS)] == [True] * LAYERS
        assert (await stream.finish()).loaded_from == 0
        assert torch.equal(kv[:, target], original[:, :n])
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_copy_failing_midway_answers_each_layer_by_what_landed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Layers 0 and 1 land (reported, never posted: nobody waited), then the copy fails: those two
    # answer True and the rest False, though the copy ended before anyone asked.
    kv = make_kv(9, LAYOUT)
    original = kv.clone()
    tokens = prompt(9, PAGES * LAYOUT.page_tokens)
    n = len(tokens)
    async with KVCache(config(None, layout=LAYOUT), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, torch.arange(n))).stored == PAGES
        target = torch.arange(100, 100 + n)
        kv[:, target] = 0
        mover = mover_of(cache)
        real = mover.load_layers

        def fails_after_layer_1(page_ids: Any, slots: Any, skip: int = 0, on_layer: Any = None, **kwargs: Any) -> Any:
            def landed(layer: int) -> None:
                on_layer(layer)
                if layer == 1:
                    raise OSError("injected: the copy stops after layer 1")

            return real(page_ids, slots, skip, landed, **kwargs)

        monkeypatch.setattr(mover, "load_layers", fails_after_layer_1)
        stream = await cache.start_load(await cache.match(tokens), target, layered=True)
        await stream.launched()
        async with asyncio.timeout(20):
            assert not await stream.wait_layer(LAYERS - 1)  # resolves once the copy is over
        assert [await stream.wait_layer(layer) for layer in range(LAYERS)] == [True, True] + [False] * (LAYERS - 2)
        assert torch.equal(kv[:2, target], original[:2, :n])
        result = await stream.finish()
        assert result.loaded_from == n  # a fault: nothing counts as loaded, the engine computes it
        assert cache.stats().errors.get("copy_failed") == 1
        await assert_quiescent(cache)
