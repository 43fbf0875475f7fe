"""A stream given up while the cache's close is under way (stream.aclose(), a cancelled finish())
returns only once no copy writes the engine's slots, and a cancelled finish() raises
CancelledError. Before, both raised RuntimeError("the cache is closed") at once, with the copy
still running into the slots (review: the manager's closed flag is set at the close's first step)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, config, make_kv, mover_of, prompt
from loop_probes import until

from aiokv import KVCache


@pytest.mark.asyncio
@pytest.mark.skipif(DEVICE.type != "cpu", reason="a CPU copy held on the copy thread")
@pytest.mark.parametrize("how", ["aclose", "cancelled-finish"])
async def test_stream_given_up_during_the_close_waits_for_its_copy(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = make_kv(0)
    cache = KVCache(config(None, pool_pages=16, launch_pages=8, launch_turn_s=0), LAYOUT, kv)
    await cache.start()
    closing: asyncio.Future[None] | None = None
    try:
        await cache.pool.wait_ready()
        tokens = prompt(1, 4 * LAYOUT.page_tokens)
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == 4
        mover = mover_of(cache)
        real = mover.load
        started, release = threading.Event(), threading.Event()
        ended: list[float] = []

        def held(*args: Any, **kwargs: Any) -> Any:
            started.set()
            assert release.wait(30)
            out = real(*args, **kwargs)
            ended.append(time.perf_counter())
            return out

        monkeypatch.setattr(mover, "load", held)
        stream = await cache.start_load(await cache.match(tokens), torch.arange(100, 100 + len(tokens)))
        await stream.launched()
        assert await asyncio.to_thread(started.wait, 30)
        finishing = asyncio.ensure_future(stream.finish()) if how == "cancelled-finish" else None
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(cache.aclose())
        await until(lambda: cache._manager.closing)
        assert not ended
        threading.Timer(0.2, release.set).start()  # the copy ends 0.2 s from now
        if finishing is None:
            await stream.aclose()
        else:
            finishing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await finishing
        returned = time.perf_counter()
        assert ended and ended[0] <= returned, "the stream call returned while its copy still ran into the slots"
    finally:
        release.set()
        await (closing if closing is not None else cache.aclose())
    assert not any(cache.stats().errors.values()), cache.stats().errors
