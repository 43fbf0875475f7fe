"""A CPU layer-wise load's layer futures reach the loop through the bridge's batched hand-over:
layers landing while the loop is busy wake it once, not once per layer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, config, make_kv, prompt

from aiokv import KVCache, KVLayout

LAYERS = 12
LAYOUT = KVLayout.mha(LAYERS, 2, 8, torch.float16, page_tokens=4)


def _hold_the_loop_until(landed: Callable[[], bool]) -> None:
    """Keep the loop thread busy (no turn runs) while the copy thread lands every layer."""
    deadline = time.monotonic() + 30
    while not landed() and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.asyncio
@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU layer futures (CUDA layers are events)")
async def test_layers_landing_while_the_loop_is_busy_cost_one_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_kv(5, LAYOUT)
    original = kv.clone()
    tokens = prompt(5, 8 * LAYOUT.page_tokens)
    n = len(tokens)
    async with KVCache(config(None, layout=LAYOUT), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, torch.arange(n))).stored == 8
        target = torch.arange(100, 100 + n)
        kv[:, target] = 0
        loop = asyncio.get_running_loop()
        wakes = [0]
        real = loop.call_soon_threadsafe

        def counting(*args: Any, **kwargs: Any) -> Any:
            wakes[0] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
        stream = await cache.start_load(await cache.match(tokens), target, layered=True)
        assert await stream.launched() == 0
        _hold_the_loop_until(lambda: torch.equal(kv[LAYERS - 1, target], original[LAYERS - 1, :n]))
        assert [await stream.wait_layer(layer) for layer in range(LAYERS)] == [True] * LAYERS
        # Before: one call_soon_threadsafe per layer (12) plus the copy's own completion.
        assert wakes[0] <= 3, wakes[0]
        result = await stream.finish()
        assert result.loaded_from == 0
        assert torch.equal(kv[:, target], original[:, :n])
