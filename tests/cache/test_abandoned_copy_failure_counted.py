"""A copy that fails after its caller was cancelled is a counted fault (``copy_failed``), as it is
for a caller that waits: the cancelled call waits for it (the engine reuses its slots right
after), then nothing else looks at how it ended. Found by review 107 (a TP rank killed under a
cancelled load); here on the CPU path with the copy failing for real on the copy thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, mover_of, prompt

from aiokv import KVCache

T = LAYOUT.page_tokens


# On CUDA the mover is called on the loop thread: holding it there would hold the loop itself.
@pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread on a gate")
@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["load", "offload"])
async def test_a_copy_failing_after_its_caller_was_cancelled_is_counted(monkeypatch: pytest.MonkeyPatch,
                                                                         call: str) -> None:
    kv = make_kv(71)
    tokens = prompt(71, 4 * T)
    async with KVCache(config(None), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        if call == "load":
            await cache.offload(tokens, torch.arange(4 * T))
        mover = mover_of(cache)
        entered, gate = threading.Event(), threading.Event()

        def held_then_broken(*_: Any, **__: Any) -> None:
            entered.set()
            assert gate.wait(30)
            raise RuntimeError("copy engine fault (injected)")

        monkeypatch.setattr(mover, call, held_then_broken)
        before = cache.stats().errors.get("copy_failed", 0)
        if call == "load":
            match = await cache.match(tokens)
            task = asyncio.ensure_future(cache.load(match, torch.arange(100, 100 + match.tokens)))
        else:
            task = asyncio.ensure_future(cache.offload(prompt(72, 4 * T), torch.arange(4 * T)))
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        asyncio.get_running_loop().call_later(0.05, gate.set)  # the copy fails while the cancel waits
        with pytest.raises(asyncio.CancelledError):
            await task
        await cache.flush()
        assert cache.stats().errors.get("copy_failed", 0) == before + 1
        await assert_quiescent(cache)
