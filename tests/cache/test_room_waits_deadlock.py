"""Callers that wait for pool room only on each other give up at once, not after ``offload_wait``.

Review 159 (seed 2 of ``test_adv_rev159_fault_stop.py``): a stream's pool pages (pinned by its
match, below its disk pages, so not launched yet) filled a small pool while it waited for room to
read a disk page above them, and a second stream waited for room too. Each waited the whole
``offload_wait`` (5 s by default), then stopped (``pool_exhausted``): every pool page was held by a
caller that was itself waiting for room, and nothing in flight (no copy, read, write-behind or
chunk being prepared) would ever free one. In production: a 5 s time-to-first-token hit whenever
concurrent long hits pin most of a pool. A stream and a plain load did the same (the load holding
nothing, the stream's own pages filling the pool), and so did two loads while the engine's match
held the pool (a lone load gave up at once there).

Now such a wait ends in a few loop turns: when every load and stream waits for room and nothing in
flight frees a page, a waiter holding pool pages (a stream's pages not launched yet) gives up
(counted, as before: its engine computes what it did not load), its pages go back as its loader
ends, and the others look again: one holding nothing then gets them and loads whole. With none
holding any (the engine's match holds the pool), the waiters give up.

Each order of a stream and a load is forced (either may be the one that finds the other waiting).
A waiter also looks again when the last thing that could free a page ends without freeing one
(another load ends, the background work ends): it was woken only by a page given back. Each case
records how long every wait for room took (``offload_wait`` is ``WAIT_S`` here: before,
each wait took all of it), and checks the results bit-exact (what a result reports loaded holds
exactly its KV; nothing is written elsewhere) and a quiescent cache after.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache

T = LAYOUT.page_tokens
POOL = 4
WAIT_S = 3.0
"""``offload_wait``: each of these waits took all of it before the fix."""
SHORT_S = 0.5
"""A wait for room that nothing can end must end well within this (a few loop turns)."""
BOUND_S = 30.0
POISON = 100.0

WHO: contextvars.ContextVar[str] = contextvars.ContextVar("WHO", default="")
"""The kind of caller ("stream", "load") a task works for (a stream's loader inherits it)."""

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")


MIXED = ("stream then load", "load then stream", "stream waits first, then the load",
         "load waits first, then the stream")


@dataclass
class Hit:
    """A caller's prompt, where its KV sits in the source buffer, and its target slots."""

    tokens: list[int]
    source: torch.Tensor  # source slot of each token
    target: torch.Tensor  # the engine's slots it loads into
    how: str  # "stream" or "load"
    pooled: int = 0  # its first pages brought into the pool (prefetched) before the match


def _hits(case: str) -> tuple[list[Hit], list[Hit]]:
    """(callers, prompts only held by the engine's match). Every prompt is stored whole on disk
    first; a caller's first ``pooled`` pages are then brought into the pool."""
    a_src = torch.arange(0, 8 * T)
    b_src = torch.arange(8 * T, 16 * T)
    if case == "two streams":  # 2 pool + 3 disk pages each: their pool pages fill the pool
        a, b = prompt(201, 5 * T), prompt(202, 5 * T)
        return [Hit(a, a_src[: 5 * T], torch.arange(100, 100 + 5 * T), "stream", 2),
                Hit(b, b_src[: 5 * T], torch.arange(150, 150 + 5 * T), "stream", 2)], []
    if case in MIXED:  # the stream's 4 pool pages fill the pool
        s, load = prompt(203, 6 * T), prompt(204, 3 * T)
        hits = [Hit(s, a_src[: 6 * T], torch.arange(100, 100 + 6 * T), "stream", 4),
                Hit(load, b_src[: 3 * T], torch.arange(150, 150 + 3 * T), "load")]
        return (hits if case.startswith("stream") else hits[::-1]), []
    if case == "two streams, shared pool pages":  # one 4-page trunk in the pool, 2 disk pages each
        trunk = prompt(205, 4 * T)
        a, b = trunk + prompt(206, 2 * T), trunk + prompt(207, 2 * T)
        b_src = torch.cat([a_src[: 4 * T], b_src[: 2 * T]])  # the trunk's KV is a's
        return [Hit(a, a_src[: 6 * T], torch.arange(100, 100 + 6 * T), "stream", 4),
                Hit(b, b_src, torch.arange(150, 150 + 6 * T), "stream", 4)], []
    if case == "two loads, the engine's match holds the pool":
        held = prompt(208, 4 * T)
        a, b = prompt(209, 3 * T), prompt(210, 3 * T)
        return [Hit(a, a_src[: 3 * T], torch.arange(100, 100 + 3 * T), "load"),
                Hit(b, b_src[: 3 * T], torch.arange(150, 150 + 3 * T), "load")], \
            [Hit(held, torch.arange(16 * T, 20 * T), torch.arange(0), "held", 4)]
    assert case == "two loads, their pool pages fill the pool"  # loads give theirs back first: no wait
    a, b = prompt(211, 5 * T), prompt(212, 5 * T)
    return [Hit(a, a_src[: 5 * T], torch.arange(100, 100 + 5 * T), "load", 2),
            Hit(b, b_src[: 5 * T], torch.arange(150, 150 + 5 * T), "load", 2)], []


async def _run(cache: KVCache, hit: Hit, match: Any) -> int:
    """Load ``hit`` (a plain load, or a stream the engine never claims from): the first token of
    what was loaded (the loaded part of a load is its prefix, of a stream its suffix)."""
    WHO.set(hit.how)
    if hit.how == "load":
        result = await cache.load(match, hit.target)
        assert result.tokens == 0 or result.tokens == match.tokens, result  # all of it or nothing here
        return 0 if result.tokens else len(hit.tokens)
    async with await cache.start_load(match, hit.target) as stream:
        return (await stream.finish()).loaded_from


def _timed_room_waits(cache: KVCache, late: str = "") -> list[float]:
    """The seconds each wait for room (a load's or a stream's, holding or not) took, as they end.
    ``late``: that kind of caller begins its wait only once another caller waits (so it is the
    one that finds every caller waiting)."""
    manager = cache._manager
    real = manager._wait_for_load_room
    took: list[float] = []
    other_waits = asyncio.Event()

    async def wait() -> bool:
        if WHO.get() == late:
            await other_waits.wait()
        else:
            other_waits.set()  # its wait is in place before the late one runs (the same step)
        began = time.perf_counter()
        try:
            return await real()
        finally:
            took.append(time.perf_counter() - began)

    manager._wait_for_load_room = wait  # type: ignore[method-assign]
    return took


CASES = ["two streams", "stream then load", "load then stream", "stream waits first, then the load",
         "load waits first, then the stream", "two streams, shared pool pages",
         "two loads, the engine's match holds the pool", "two loads, their pool pages fill the pool"]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES)
async def test_callers_waiting_for_room_only_on_each_other_give_up_at_once(tmp_path: Path, case: str) -> None:
    callers, held_hits = _hits(case)
    source = make_kv(201)
    async with KVCache(config(tmp_path, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        for hit in callers + held_hits:
            await writer.offload(hit.tokens, hit.source)
        await writer.flush()
    kv = make_kv(202)
    cache = KVCache(config(tmp_path, pool_pages=POOL, disk_pages=96, offload_wait=WAIT_S, launch_pages=1),
                    LAYOUT, kv)
    await cache.start()
    try:
        await cache.pool.wait_ready()
        for hit in held_hits + callers:
            if hit.pooled:
                await cache.prefetch(hit.tokens[: hit.pooled * T])
        held = [await cache.match(hit.tokens) for hit in held_hits]
        matches = [await cache.match(hit.tokens) for hit in callers]
        for hit, match in zip(held_hits + callers, held + matches, strict=True):
            assert (match.tokens, match.pool_pages) == (len(hit.tokens), hit.pooled), (case, match)
        assert not cache.pool.table.has_room(), "the set-up must fill the pool"
        for hit in callers:
            kv[:, hit.target] = POISON
        # Which of a stream and a load finds the other waiting: each order (else as it comes).
        took = _timed_room_waits(cache, {"stream waits first, then the load": "load",
                                         "load waits first, then the stream": "stream"}.get(case, ""))
        began = time.perf_counter()
        async with asyncio.timeout(BOUND_S):
            starts = await asyncio.gather(*(_run(cache, hit, m) for hit, m in zip(callers, matches, strict=True)))
        elapsed = time.perf_counter() - began
        for hit, start in zip(callers, starts, strict=True):
            n = len(hit.tokens)
            loaded = slice(start, n) if hit.how == "stream" else slice(0, n - start)
            rest = slice(0, start) if hit.how == "stream" else slice(n - start, n)
            assert torch.equal(kv[:, hit.target[loaded]], source[:, hit.source[loaded]]), (case, hit.how, start)
            assert bool((kv[:, hit.target[rest]] == POISON).all()), (case, hit.how, start)
        gave_up = sum(start == len(hit.tokens) for hit, start in zip(callers, starts, strict=True))
        expected = {"two streams": 1, **dict.fromkeys(MIXED, 1),
                    "two streams, shared pool pages": 2, "two loads, the engine's match holds the pool": 2,
                    "two loads, their pool pages fill the pool": 0}[case]
        assert gave_up == expected, (case, starts, took, cache.stats().errors)
        if case in MIXED:
            stream_start, load_start = (starts if case.startswith("stream") else starts[::-1])
            assert (stream_start, load_start) == (6 * T, 0), "the stream whose own pages fill the pool gives up"
        errors = {k: v for k, v in cache.stats().errors.items() if v}
        assert errors.get("pool_exhausted", 0) == gave_up, errors
        assert errors.get("load_shortened", 0) == gave_up, errors
        # The point: no wait for room outlasted a few loop turns (each took offload_wait before).
        assert all(t < SHORT_S for t in took), (case, took)
        assert elapsed < SHORT_S * 2, (case, elapsed, took)
        for match in held:
            match.release()
        await assert_quiescent(cache)
        assert cache._manager.loads_running == 0
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("other", ["a load", "background work"])
async def test_a_waiter_looks_again_when_the_last_thing_that_could_free_a_page_ends(
    tmp_path: Path, other: str,
) -> None:
    """The engine's match holds the pool; a load that holds nothing waits for room while ``other``
    (another load running, or background work) could still give a page back. That ends without
    giving one back: the waiter must see at once that nothing can free a page any more (it was
    woken only by a page given back, and waited ``offload_wait``)."""
    source = make_kv(213)
    held_tokens = prompt(213, POOL * T)
    async with KVCache(config(tmp_path, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(held_tokens, torch.arange(POOL * T))
        await writer.flush()
    cache = KVCache(config(tmp_path, pool_pages=POOL, disk_pages=96, offload_wait=WAIT_S), LAYOUT, make_kv(214))
    await cache.start()
    try:
        await cache.pool.wait_ready()
        assert (await cache.prefetch(held_tokens)).promoted == POOL
        held = await cache.match(held_tokens)
        manager = cache._manager
        ending: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        manager.load_began()  # the waiter (a load counts itself)
        if other == "a load":
            manager.load_began()
        else:
            manager.track(ending, lambda: None)
        waiter = asyncio.ensure_future(manager._wait_for_load_room())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiter.done(), "it waits while something could still free a page"
        began = time.perf_counter()
        if other == "a load":
            manager.load_ended()
        else:
            ending.set_result(None)
        async with asyncio.timeout(BOUND_S):
            assert await waiter is False
        assert time.perf_counter() - began < SHORT_S
        manager.load_ended()
        assert manager.loads_running == 0
        held.release()
        await assert_quiescent(cache)
    finally:
        await cache.aclose()
