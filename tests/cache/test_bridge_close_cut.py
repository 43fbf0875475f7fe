"""A loop-wide cancel (an application's SIGTERM handler, review 205) cutting ``KVCache.aclose`` while
it joins the completion bridge's threads.

The join is the close's last fence before the pool is freed: a copy still on the bridge's copy thread
(one whose load was cancelled: the copy cannot be stopped) reads or writes pool pages until it ends.
The cut close's task ended; the next ``aclose()`` ran the close anew, whose ``bridge.close()``
returned at once (closed already) while the first join still waited for that copy, and the pool was
unmapped under it.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from cache_helpers import LAYOUT, config, make_kv
from loop_probes import cancel_every_task_but_nowait, until_thread, waiting_in

from aiokv import KVCache

BOUND_S = 30.0


def _threads_named(name: str) -> bool:
    return any(t.name == name for t in threading.enumerate())


@pytest.mark.asyncio
async def test_a_cut_close_frees_the_pool_after_the_copy_thread_ended() -> None:
    cache = KVCache(config(None), LAYOUT, make_kv(240))
    await cache.start()
    pool = cache.pool
    segment = f"/dev/shm/{pool.name.lstrip('/')}"
    gate = threading.Event()
    # A copy the close cannot stop, as a cancelled load's (it would read or write pool pages).
    copying = cache._bridge.run_cpu(lambda: gate.wait(BOUND_S))
    try:
        closing = asyncio.ensure_future(cache.aclose())
        await until_thread(lambda: _threads_named("aiokv-bridge-close"), "the close joining the bridge", BOUND_S)
        first = cache._close_task
        cancel_every_task_but_nowait(asyncio.current_task())  # the application's SIGTERM handler
        await asyncio.wait({closing})
        again = asyncio.ensure_future(cache.aclose())
        # Either the close ran anew up to freeing the pool (the defect), or it waits for the same join.
        await until_thread(lambda: pool._closed or again.done() or (
            cache._close_task is not first and waiting_in(cache._close_task, "_close_bridge")),
            "the close run anew", BOUND_S)
        assert not pool._closed, "the pool was freed while a copy still ran on the bridge's copy thread"
        assert not again.done()
        assert await asyncio.to_thread(os.path.exists, segment)
        gate.set()
        async with asyncio.timeout(BOUND_S):
            await again
            assert await copying
        assert pool._closed
        assert not await asyncio.to_thread(os.path.exists, segment), "the pool's segment is left in /dev/shm"
    finally:
        gate.set()
        async with asyncio.timeout(BOUND_S):
            await asyncio.wait({copying})
            await cache.aclose()
