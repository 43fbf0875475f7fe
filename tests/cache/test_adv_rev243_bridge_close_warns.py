"""Review 243: ``KVCache.aclose`` waiting for a copy still running on the completion bridge's copy
thread (one a cancelled load leaves there; a stopped GPU holds the event waiters the same way).

The join of the bridge's threads is the close's last fence before the pool is freed, and must not be
bounded (the copy reads or writes pool pages until it ends). It waited without a word while
``aclose`` said it waits "up to ``close_timeout``": a close held for good, silently. It now warns
every ``close_timeout`` (at least every second) naming what it waits for; the pool is still freed
only after the copy ended.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from cache_helpers import LAYOUT, config, make_kv
from loop_probes import until_thread

from aiokv import KVCache

BOUND_S = 30.0


@pytest.mark.asyncio
async def test_a_close_held_by_a_running_copy_warns_and_frees_the_pool_after_it(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiokv")
    cache = KVCache(config(None, close_timeout=0.1), LAYOUT, make_kv(240))
    await cache.start()
    pool = cache.pool
    gate = threading.Event()
    # A copy the close cannot stop, as a cancelled load's (it would read or write pool pages).
    copying = cache._bridge.run_cpu(lambda: gate.wait(BOUND_S))
    closing = asyncio.ensure_future(cache.aclose())
    try:
        def warned() -> int:
            return sum("completion bridge" in r.getMessage() and "waited" in r.getMessage() for r in caplog.records)

        # Before: no word while it waited, for good.
        await until_thread(lambda: warned() >= 2, "two warnings of the close waiting on the copy", BOUND_S)
        assert not closing.done()
        assert not pool._closed, "the pool was freed while a copy still ran on the bridge's copy thread"
        gate.set()
        async with asyncio.timeout(BOUND_S):
            await closing
            assert await copying
        assert pool._closed
    finally:
        gate.set()
        async with asyncio.timeout(BOUND_S):
            await asyncio.wait({copying, closing})
            await cache.aclose()
