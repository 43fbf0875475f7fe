"""What a close does to loads and offloads still in flight, and how it is counted.

Work the close withdraws (a paced offload still waiting for its turn, a launch group not reached)
never ran: it is counted in ``stats().pages_withdrawn``, never as a fault in ``errors``; its pool
pages are aborted (an offload) or released (a load) and nothing is served from them. Copies on a
CPU buffer: offloads are paced on CUDA only, so :class:`PacedOnCPU` routes them through the real
:class:`LaunchPacer` with real copies on the bridge's copy thread, as ``test_launch_pacer`` drives
the pacer without a GPU.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, config, make_kv, prompt

from aiokv import KVCache
from aiokv.pagetable import PageState
from aiokv.transfers import Copy, CopyWithdrawn, LaunchPacer, LocalTransfers, Mark

T = LAYOUT.page_tokens
cpu_only = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread on a gate")


class PacedOnCPU(LocalTransfers):
    """The CUDA offload path's pacing (``LocalTransfers.offload``) with CPU copies: each launch runs
    a real gather on the copy thread, in the pacer's order and budget."""

    def offload(self, slots: torch.Tensor, page_ids: list[int]) -> Copy:
        mover, bridge = self.mover, self._bridge

        def start() -> tuple[asyncio.Future[None], None]:
            return bridge.run_cpu(lambda: mover.offload(slots, page_ids, checked=True)), None

        entry = self.offloads.run(len(page_ids) * mover.pages[0].nbytes, start)
        return Copy(entry.future, entry.event, launch=entry)


def paced(cache: KVCache, pages: int) -> PacedOnCPU:
    """Offloads of ``cache`` paced at ``pages`` pages in flight."""
    current = cache._transfers
    assert current is not None
    budget = pages * current.mover.pages[0].nbytes
    transfers = PacedOnCPU(current.mover, cache._bridge, DEVICE, pace_bytes=budget)
    cache._transfers = transfers
    cache._manager.attach(transfers)
    return transfers


async def _until(predicate: Callable[[], bool], limit: int = 10_000) -> None:
    for _ in range(limit):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


@pytest.mark.asyncio
async def test_a_closed_pacer_withdraws_what_waits_as_withdrawn_not_failed() -> None:
    pacer = LaunchPacer(10)
    inner: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    running = pacer.run(10, lambda: (inner, None))
    waiting = pacer.run(10, lambda: (asyncio.get_running_loop().create_future(), None))
    pacer.close()
    assert isinstance(waiting.future.exception(), CopyWithdrawn) and not waiting.launched
    late = pacer.run(1, lambda: (asyncio.get_running_loop().create_future(), None))
    assert isinstance(late.future.exception(), CopyWithdrawn) and not late.launched
    inner.set_result(None)
    await pacer.drain()
    assert running.future.result() is None


@cpu_only
@pytest.mark.asyncio
async def test_close_counts_waiting_paced_offloads_as_withdrawn_and_frees_their_pages() -> None:
    # Regression: aclose() with paced offloads still waiting for their turn counted them as
    # copy_failed (LaunchPacer.close failed them with a RuntimeError), though nothing failed.
    kv = make_kv(70)
    n = 6
    tokens = prompt(70, n * T)
    cache = KVCache(config(None, pool_pages=16, launch_pages=1, launch_turn_s=0), LAYOUT, kv)
    await cache.start()
    gate = threading.Event()
    try:
        await cache.pool.wait_ready()
        pacer = paced(cache, 1).offloads
        blocker = cache._bridge.run_cpu(gate.wait)  # the first launch's copy waits behind it
        offload = asyncio.create_task(cache.offload(tokens, torch.arange(n * T)))
        await _until(lambda: len(pacer.queue) == n - 1)  # one launched, five waiting for its turn
        keys = cache.keys(tokens)
        closing = asyncio.create_task(cache.aclose())
        await _until(lambda: pacer.closed)
    finally:
        gate.set()  # never leave the copy thread blocked, also when the test fails
    await blocker
    result = await offload
    await closing
    assert (result.stored, result.skipped, result.dropped) == (1, 0, n - 1)
    stats = cache.stats()
    assert stats.pages_withdrawn == n - 1 and stats.pages_dropped == n - 1
    assert "copy_failed" not in stats.errors and "load_shortened" not in stats.errors, stats.errors
    table = cache.pool.table
    table.check_invariants()
    assert table.state_of(keys[0]) is PageState.READY
    assert all(table.state_of(k) is PageState.FREE for k in keys[1:]), "a withdrawn page was kept"
    assert table.acquire(keys[1]) is None  # nothing is served from a withdrawn page
    assert stats.pool_reserved == 0 and stats.pool_referenced == 0 and stats.background_jobs == 0


@cpu_only
@pytest.mark.asyncio
async def test_an_offload_in_flight_launches_nothing_once_the_close_began() -> None:
    # Regression: an offload in flight kept launching its groups on the copy thread while the cache
    # closed, and raised RuntimeError("completion bridge is closed") once the bridge was gone.
    kv = make_kv(71)
    n = 8
    tokens = prompt(71, n * T)
    cache = KVCache(config(None, pool_pages=16, launch_pages=1, launch_turn_s=0), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    transfers = cache._transfers
    assert transfers is not None
    launched: list[bool] = []  # per launch: had the close begun?
    closing: list[asyncio.Future[None]] = []
    original = transfers.offload

    def offload(slots: torch.Tensor, page_ids: list[int]) -> Copy:
        launched.append(cache._manager._closed)
        if len(launched) == 2:  # aclose() is called right after the second group's launch
            closing.append(asyncio.ensure_future(cache.aclose()))
        return original(slots, page_ids)

    transfers.offload = offload  # type: ignore[method-assign]
    keys = cache.keys(tokens)
    result = await cache.offload(tokens, torch.arange(n * T))
    await closing[0]
    assert not any(launched), "a group was launched after the close began"
    done = len(launched)  # the close task starts a turn or two after aclose() is called
    assert 2 <= done < n
    assert (result.stored, result.dropped) == (done, n - done)
    stats = cache.stats()
    assert stats.pages_withdrawn == n - done and not stats.errors, stats.errors
    table = cache.pool.table
    table.check_invariants()
    assert [table.state_of(k) for k in keys] == [PageState.READY] * done + [PageState.FREE] * (n - done)
    assert stats.pool_reserved == 0 and stats.pool_referenced == 0


@cpu_only
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["load", "stream"])
async def test_a_load_in_flight_launches_nothing_once_the_close_began(how: str) -> None:
    # Regression: a load (or a LoadStream's loader) in flight kept launching copies out of a pool
    # the close was about to free (on CUDA one launched after the bridge closed had no waiter), and
    # a load cut by the close was not told apart from a fault (copy_failed, load_shortened).
    kv = make_kv(72)
    n = 8
    tokens = prompt(72, n * T)
    cache = KVCache(config(None, pool_pages=16, launch_pages=1, launch_turn_s=0), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    await cache.offload(tokens, torch.arange(n * T))
    transfers = cache._transfers
    assert transfers is not None
    launched: list[bool] = []  # per launch: had the close begun?
    closing: list[asyncio.Future[None]] = []
    original = transfers.load

    def load(page_ids: list[int], slots: torch.Tensor, skip: int, after: Mark = None) -> Copy:
        launched.append(cache._manager._closed)
        if len(launched) == 3:
            closing.append(asyncio.ensure_future(cache.aclose()))
        return original(page_ids, slots, skip, after)

    transfers.load = load  # type: ignore[method-assign]
    target = torch.arange(100, 100 + n * T)
    match = await cache.match(tokens)
    if how == "load":
        result = await cache.load(match, target)
        first, loaded = 0, result.pool_pages  # from the front
    else:
        streamed = await (await cache.start_load(match, target)).finish()
        loaded = streamed.pool_pages
        first = n - loaded  # from the back, contiguous up to the match's end
        assert (streamed.loaded_from, streamed.tokens) == (first * T, n * T)
    await closing[0]
    assert not any(launched), "a copy was launched after the close began"
    done = len(launched)
    assert 3 <= done < n and loaded == done
    if how == "load":
        assert (result.tokens, result.requested) == (done * T, n * T)
    span = slice(first * T, (first + done) * T)
    assert torch.equal(kv[:, target[span]], kv[:, span])
    stats = cache.stats()
    assert stats.pages_withdrawn == n - done and not stats.errors, stats.errors
    cache.pool.table.check_invariants()
    assert stats.pool_referenced == 0 and stats.pool_reserved == 0


@cpu_only
@pytest.mark.asyncio
async def test_an_offload_landing_after_the_disk_tier_closed_is_not_a_full_queue(tmp_path: Path) -> None:
    # Regression: an offload whose copy landed after the close had shut the disk tier counted
    # write_behind_full ("write-behind queue full") for each page, a fault that never happened.
    kv = make_kv(73)
    tokens = prompt(73, 2 * T)
    cache = KVCache(config(tmp_path, pool_pages=16, launch_pages=2, launch_turn_s=0), LAYOUT, kv)
    await cache.start()
    gate = threading.Event()
    try:
        await cache.pool.wait_ready()
        disk = cache._manager.disk
        assert disk is not None
        blocker = cache._bridge.run_cpu(gate.wait)
        offload = asyncio.create_task(cache.offload(tokens, torch.arange(2 * T)))
        await _until(lambda: len(cache._bridge._cpu_jobs) == 2)  # the blocker, then the offload's copy
        closing = asyncio.create_task(cache.aclose())
        await _until(lambda: (task := disk._close_task) is not None and task.done())
        assert not offload.done()  # its copy lands only now, after the tier closed
    finally:
        gate.set()
    await blocker
    result = await offload
    await closing
    assert result.stored == 2
    stats = cache.stats()
    assert "write_behind_full" not in stats.errors, stats.errors
    assert stats.pool_reserved == 0 and stats.pool_referenced == 0


@cpu_only
@pytest.mark.asyncio
async def test_the_worker_launches_no_copy_once_the_close_began() -> None:
    # Regression: only paced offloads were refused once a close began; a load launched then (a
    # LoadStream's loader does not ask the manager) reached the mover, on CUDA possibly after the
    # bridge had closed: a copy with no waiter out of a pool about to be freed.
    kv = make_kv(74)
    tokens = prompt(74, 2 * T)
    cache = KVCache(config(None, pool_pages=16), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    await cache.offload(tokens, torch.arange(2 * T))
    transfers = cache._transfers
    assert transfers is not None
    mover = transfers.mover
    calls: list[str] = []
    for name in ("load", "load_layers", "offload"):
        original = getattr(mover, name)

        def spy(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(mover, name, spy)
    match = await cache.match(tokens)
    pages = [cache.pool.table.check(h) for h in match._handles]
    closing = asyncio.create_task(cache.aclose())
    await _until(lambda: transfers.offloads.closed)  # the close closes the pacer first
    slots = torch.arange(100, 100 + 2 * T)
    copies = [transfers.load(pages, slots, 0), transfers.load_layers(pages, slots, 0),
              transfers.offload(slots, pages)]
    for copy in copies:
        with pytest.raises(CopyWithdrawn):
            await copy.future
    match.release()
    await closing
    assert calls == [], f"launched after the close began: {calls}"
