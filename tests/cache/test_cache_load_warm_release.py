"""A `load` or `start_load` that never reaches the manager gives its `Match` back.

Regression: ``KVCache.load`` awaited the kernel warm-up between checking the match and handing it
to the manager. Cancelled there, the match stayed held with its pool pages referenced (until a
ResourceWarning at GC); a load waiting there when ``aclose`` began raised RuntimeError and kept
the match too. Now the match is released (consumed, as by a cancelled load).

The warm-up thread is held inside its first launch by a :func:`record_launches` hook (kernels under
the Triton interpreter on CPU), so the load waits for it at a known point. The pool pages are
real: written to disk by a first cache and prefetched (no kernel) by the second.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, config, make_kv, prompt

from aiokv import KVCache, TransferPath
from aiokv.kernels.launch import LaunchKey, record_launches
from aiokv.kernels.paths import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU test: kernels under the Triton interpreter")

WARM = "aiokv-warmup"
PAGES = 3
TOKENS = prompt(7, PAGES * LAYOUT.page_tokens)


class Gate:
    """Holds the warm-up thread in its first launch until :meth:`open`; ``held`` is set on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.held = asyncio.Event()
        self.other = threading.Event()  # a launch from another thread (a copy)
        self._open = threading.Event()
        self.context = record_launches(hook=self)

    def __call__(self, key: LaunchKey) -> None:
        if threading.current_thread().name != WARM:
            self.other.set()
            return
        if not self.held.is_set():
            self.loop.call_soon_threadsafe(self.held.set)
            assert self._open.wait(60), "the test never opened the gate"

    def open(self) -> None:
        self._open.set()


@pytest.fixture
def gated() -> Iterator[list[Gate]]:
    """Gates the test made (appended by :func:`_cache_with_pages`): opened and removed at the end."""
    made: list[Gate] = []
    yield made
    for gate in made:
        gate.open()
        gate.context.__exit__(None, None, None)


async def _cache_with_pages(tmp_path: Path, made: list[Gate]) -> tuple[KVCache, Gate]:
    """A started cache whose warm-up is held, with the pages of TOKENS in its pool (none referenced)."""
    async with KVCache(config(tmp_path, transfer_path=TransferPath.REFERENCE), LAYOUT, make_kv()) as first:
        assert (await first.offload(TOKENS, torch.arange(len(TOKENS)))).stored == PAGES
        await first.flush()
    gate = Gate(asyncio.get_running_loop())
    made.append(gate)
    gate.context.__enter__()
    cache = KVCache(config(tmp_path, transfer_path=TransferPath.DIRECT), LAYOUT, make_kv(1))
    await cache.start()
    await asyncio.wait_for(gate.held.wait(), 30)
    assert (await cache.prefetch(TOKENS)).promoted == PAGES  # disk -> pool: no kernel
    assert cache.stats().pool_referenced == 0
    return cache, gate


async def _until_waiting_for_warm_up(task: asyncio.Future[object]) -> None:
    for _ in range(10_000):
        coro = task.get_coro() if isinstance(task, asyncio.Task) else None
        while coro is not None:
            if getattr(coro, "cr_code", None) is not None and coro.cr_code.co_name == "_kernels_ready":
                return
            coro = getattr(coro, "cr_await", None)
        await asyncio.sleep(0)
    raise AssertionError("the load never waited for the warm-up")


def _call(cache: KVCache, how: str, match: object) -> asyncio.Future[object]:
    slots = torch.arange(len(TOKENS)) + 32
    if how == "load":
        return asyncio.ensure_future(cache.load(match, slots))  # type: ignore[arg-type]
    return asyncio.ensure_future(cache.start_load(match, slots))  # type: ignore[arg-type]


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["load", "start_load"])
async def test_a_load_cancelled_while_waiting_for_the_warm_up_releases_its_match(
    tmp_path: Path, gated: list[Gate], how: str
) -> None:
    cache, held = await _cache_with_pages(tmp_path, gated)
    try:
        match = await cache.match(TOKENS)
        assert match.pool_pages == PAGES and cache.stats().pool_referenced == PAGES
        task = _call(cache, how, match)
        await _until_waiting_for_warm_up(task)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert match.released
        assert cache.stats().pool_referenced == 0
        assert not held.other.is_set()  # nothing was copied
        cache.pool.table.check_invariants()
    finally:
        held.open()
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["load", "start_load"])
async def test_a_load_waiting_for_the_warm_up_when_the_close_begins_releases_its_match(
    tmp_path: Path, gated: list[Gate], how: str
) -> None:
    cache, held = await _cache_with_pages(tmp_path, gated)
    try:
        match = await cache.match(TOKENS)
        task = _call(cache, how, match)
        await _until_waiting_for_warm_up(task)
        closing = asyncio.ensure_future(cache.aclose())
        for _ in range(20):
            await asyncio.sleep(0)
        assert cache._warm_stop.is_set() and not closing.done()  # the close waits for the warm-up
        held.open()  # the warm-up stops after this launch; the load wakes to a closing cache
        with pytest.raises(RuntimeError, match="closed"):
            await task
        assert match.released
        assert cache.pool.table.statistics().referenced == 0
        await closing
        assert not held.other.is_set()
    finally:
        held.open()
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["load", "start_load"])
async def test_another_caches_match_is_refused_before_the_wait_and_left_alone(
    tmp_path: Path, gated: list[Gate], how: str
) -> None:
    # Regression: the owner of a Match was checked only when the manager took it, after the
    # warm-up wait: a load given another cache's match waited there, and cancelled (here by the
    # bound) released the other cache's match (bad input must change nothing).
    cache, held = await _cache_with_pages(tmp_path, gated)
    other = KVCache(config(None, transfer_path=TransferPath.REFERENCE), LAYOUT, make_kv(2))
    try:
        await other.start()
        assert (await other.offload(TOKENS, torch.arange(len(TOKENS)))).stored == PAGES
        foreign = await other.match(TOKENS)
        assert foreign.pool_pages == PAGES
        with pytest.raises(ValueError, match="another KVCache"):
            await asyncio.wait_for(_call(cache, how, foreign), 5)
        assert not foreign.released and other.stats().pool_referenced == PAGES
        assert cache.stats().pool_referenced == 0
        result = await other.load(foreign, torch.arange(len(TOKENS)) + 32)  # still the other's to load
        assert result.tokens == len(TOKENS)
    finally:
        held.open()
        await other.aclose()
        await cache.aclose()
