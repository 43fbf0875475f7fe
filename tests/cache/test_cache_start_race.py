"""`KVCache.start` racing `aclose`: nothing the start made outlives the cache.

Regression: an ``aclose`` while ``start`` awaited one of its steps (the bridge's prestart thread, the
manager's start, the import thread) saw no copy engine and no warm-up, closed the manager and freed
the pool; ``start`` then built a PageMover over the freed pool, attached a LaunchPacer nobody
closed, started the warm-up thread and returned normally. Now the close waits for the start in
flight, which makes nothing more and raises RuntimeError.

Each step is held on an Event (a ``threading.Event`` inside the real thread, an ``asyncio.Event``
after the manager's real start), so the close begins at a known point; the pool and the bridge
are real, and the transfer path launches kernels (a warm-up would start).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, config, make_kv

import aiokv.cache as cache_module
from aiokv import CacheConfig, KVCache, KVLayout, TransferPath
from aiokv.pool import PagePool

STEPS = ["prestart", "manager", "imports"]


def _cache() -> KVCache:
    return KVCache(config(None, transfer_path=TransferPath.DIRECT), LAYOUT, make_kv())


class Held:
    """Holds one step of ``cache.start`` until :meth:`open`; ``entered`` is set (on the loop) once there."""

    def __init__(self, cache: KVCache, step: str, monkeypatch: pytest.MonkeyPatch) -> None:
        loop = asyncio.get_running_loop()
        self.entered = asyncio.Event()
        self._gate = threading.Event()
        self._agate = asyncio.Event()

        def hold_thread() -> None:  # on the step's own thread
            loop.call_soon_threadsafe(self.entered.set)
            assert self._gate.wait(60), "the test never opened the gate"

        if step == "prestart":
            real_prestart = cache._bridge.prestart

            def prestart(cuda: bool) -> None:
                hold_thread()
                real_prestart(cuda)

            monkeypatch.setattr(cache._bridge, "prestart", prestart)
        elif step == "manager":
            real_start = cache._manager.start

            async def start() -> PagePool:
                pool = await real_start()  # the pool (and a disk tier, were one configured) is open
                self.entered.set()
                await self._agate.wait()
                return pool

            monkeypatch.setattr(cache._manager, "start", start)
        else:
            # A module not loaded yet: start imports it on the aiokv-import thread, held there.
            monkeypatch.setattr(cache_module, "_start_modules", lambda path: ("aiokv_test_not_loaded",))

            def import_all(names: Sequence[str]) -> None:
                assert list(names) == ["aiokv_test_not_loaded"]
                hold_thread()

            monkeypatch.setattr(cache_module, "_import_all", import_all)

    def open(self) -> None:
        self._gate.set()
        self._agate.set()


@pytest.mark.asyncio
@pytest.mark.parametrize("step", STEPS)
async def test_a_close_during_start_waits_for_it_and_the_start_makes_nothing_more(
    monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    cache = _cache()
    held = Held(cache, step, monkeypatch)
    starting = asyncio.ensure_future(cache.start())
    closing: asyncio.Future[None] | None = None
    try:
        await asyncio.wait_for(held.entered.wait(), 30)
        closing = asyncio.ensure_future(cache.aclose())
        for _ in range(50):  # loop turns: the close gets as far as it can while the start is held
            await asyncio.sleep(0)
        assert not closing.done(), "aclose did not wait for the start in flight"
        pool = cache._manager._pool
        assert (pool is None) == (step == "prestart")
        assert pool is None or not pool.closed, "the pool was freed under the start"
    finally:
        held.open()  # never leave the start held when the test fails
    with pytest.raises(RuntimeError, match="closed while it was starting"):
        await starting
    assert closing is not None
    await closing
    # Nothing the old start went on to make: no copy engine, no pacer, no warm-up thread.
    assert cache._transfers is None
    assert cache._warm is None and cache._warm_ready is None
    assert cache._manager._transfers is None
    pool = cache._manager._pool
    assert pool is None or pool.closed
    with pytest.raises(RuntimeError):
        await cache.offload(list(range(2 * LAYOUT.page_tokens)), torch.arange(2 * LAYOUT.page_tokens))
    with pytest.raises(RuntimeError, match="cannot be started again"):
        await cache.start()
    await cache.aclose()  # idempotent


@pytest.mark.asyncio
async def test_a_second_start_while_one_runs_raises_and_the_first_starts_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = _cache()
    held = Held(cache, "manager", monkeypatch)
    starting = asyncio.ensure_future(cache.start())
    try:
        await asyncio.wait_for(held.entered.wait(), 30)
        with pytest.raises(RuntimeError, match="already running"):
            await cache.start()
    finally:
        held.open()
    await starting
    try:
        assert cache._transfers is not None and cache._warm is not None
        await cache.start()  # started: a no-op
        tokens = list(range(2 * LAYOUT.page_tokens))
        cache._warm_stop.set()  # interpreted kernels: stop the warm-up early, copies compile their own
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == 2
    finally:
        await cache.aclose()
    assert cache._manager.pool.closed


@pytest.mark.asyncio
async def test_a_close_during_the_movers_construction_keeps_no_mover_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    # Review: the start raised on the close after building its mover, and the error's traceback kept
    # _start's frame with the mover (on CUDA its GPU staging and streams) for as long as it was held.
    from aiokv.kernels import PageMover

    entered, proceed = threading.Event(), threading.Event()
    real = cache_module._build_mover

    def held_build(*args: Any, **kwargs: Any) -> PageMover:
        entered.set()
        proceed.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache_module, "_build_mover", held_build)
    layout = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
    kv = torch.zeros(layout.num_layers, 64, layout.rows, layout.head_dim, dtype=layout.dtype)
    cache = KVCache(CacheConfig(cpu_bytes=1 << 20, disk=None, namespace="start-close-mover"), layout, kv)
    start = asyncio.ensure_future(cache.start())
    assert await asyncio.to_thread(entered.wait, 30)
    close = asyncio.ensure_future(cache.aclose())
    await asyncio.sleep(0)  # the close begins (it waits for the start)
    proceed.set()
    with pytest.raises(RuntimeError, match="closed while it was starting") as raised:
        await start
    await close
    movers = []
    tb = raised.value.__traceback__
    while tb is not None:
        movers += [v for v in tb.tb_frame.f_locals.values() if isinstance(v, PageMover)]
        tb = tb.tb_next
    assert not movers
