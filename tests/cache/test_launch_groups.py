"""Launch groups of a real cache: small pages go in fewer, larger groups where the loop launches them
fast; groups whose launches hold the loop stay at ``launch_pages``; ``launch_bytes`` caps them.

Regression (nineteenth session): groups were ``launch_pages`` pages whatever the page size, so a
hit of small pages was one loop turn and, on the CPU, one copy-thread round trip per two pages (a
39-page CPU pool hit of 64 KiB pages: 34.6-39.0 ms in groups of 2, 5.7-7.6 ms in one group).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from cache_helpers import (
    DEVICE,
    LAYOUT,
    SLOTS,
    assert_quiescent,
    cancel_behind_a_busy_copy_thread,
    config,
    make_kv,
    prompt,
)

from aiokv import KVCache
from aiokv.launches import PROBE_EVERY
from aiokv.transfers import Copy

T = LAYOUT.page_tokens
PAGES = 32
GROWTH: dict[str, float] = {} if DEVICE.type == "cpu" else {"launch_turn_s": 5e-3}
"""The turn budget of the tests that ask for grown groups: the default on the CPU (launches hand
pages over in microseconds); 5 ms on CUDA, where a load group costs ~0.2 ms and ~20-30 us a page
on a quiet H200 (12 pages fit the default), but under 8-16 test processes the same loop time more
than doubles and the default's answer drifts to the floor: the sizer did right, the test could not
tell."""


def _counting(cache: KVCache, name: str, stall_s: float = 0.0, launched: asyncio.Event | None = None) -> list[int]:
    """Pages per ``transfers.<name>`` call from now on; each call holds the loop ``stall_s`` a page
    and sets ``launched``."""
    transfers = cache._transfers
    assert transfers is not None
    original: Callable[..., Copy] = getattr(transfers, name)
    sizes: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Copy:
        ids = args[1] if name == "offload" else args[0]
        sizes.append(len(ids))
        if stall_s:
            end = time.perf_counter() + stall_s * len(ids)
            while time.perf_counter() < end:  # the loop thread's own work, as a slow launch wrapper
                pass
        copy = original(*args, **kwargs)
        if launched is not None:
            launched.set()
        return copy

    setattr(transfers, name, counted)
    return sizes


async def _offload_and_hit(cache: KVCache, kv: torch.Tensor, seed: int) -> tuple[list[int], list[int]]:
    """Offload a prompt, then load it back into fresh slots: the pages per offload and per load group."""
    n = PAGES * T
    tokens = prompt(seed, n)
    offloads = _counting(cache, "offload")
    stored = await cache.offload(tokens, torch.arange(n))
    assert stored.stored == PAGES
    loads = _counting(cache, "load")
    match = await cache.match(tokens)
    target = torch.arange(SLOTS - n, SLOTS)
    loaded = await cache.load(match, target)
    assert loaded.tokens == n
    assert torch.equal(kv[:, target.to(kv.device)], kv[:, :n])  # bit-exact, whatever the grouping
    return offloads, loads


async def _learned(cache: KVCache, kv: torch.Tensor, seed: int) -> None:
    """The pool ready and warm, and a first offload and hit for the sizers to learn the loop's time
    per page (a first launch may be slow)."""
    await cache.pool.wait_ready()
    await cache.wait_warm()
    await _offload_and_hit(cache, kv, seed)
    kv[:, : PAGES * T] = make_kv(seed + 1)[:, : PAGES * T]  # another prompt's KV in the same slots


async def _after_learning(cache: KVCache, kv: torch.Tensor, seed: int) -> tuple[list[int], list[int]]:
    """The pages per offload and per load group of a second offload and hit, once learned."""
    await _learned(cache, kv, seed)
    return await _offload_and_hit(cache, kv, seed + 1)


@pytest.mark.asyncio
async def test_fast_launches_go_in_fewer_groups_than_launch_pages_would_give() -> None:
    kv = make_kv(91)
    async with KVCache(config(None, pool_pages=2 * PAGES, **GROWTH), LAYOUT, kv) as cache:
        offloads, loads = await _after_learning(cache, kv, 91)
        assert sum(offloads) == sum(loads) == PAGES
        assert min(offloads[:-1] + loads[:-1], default=2) >= 2  # never below the floor
        # Groups of 2 were 16 calls each way; a CPU launch hands pages over in microseconds, an
        # H200 load group costs ~0.2 ms whatever its size and ~20 us a page.
        assert len(loads) < PAGES // 2, (offloads, loads)
        if DEVICE.type == "cpu":
            # CUDA offloads are paced: a group past the pacer's bytes is queued (tens of us) and
            # launched later from a completion callback, so the sizer sees queuings and launches
            # mixed (the H200 kept 22-32 groups of 64 for 64 KiB and 2 MiB pages).
            assert len(offloads) < PAGES // 2, (offloads, loads)
        await assert_quiescent(cache)


# timing: the sizer learns from wall-clock spins; beside other test workers a preempted group looks
# dear and the probe cheap, and the groups grow (to 4 under -n 3 on 2 CPUs, 7ee93af).
@pytest.mark.timing
@pytest.mark.asyncio
async def test_launches_that_hold_the_loop_stay_at_launch_pages() -> None:
    kv = make_kv(93)
    async with KVCache(config(None, pool_pages=2 * PAGES, launch_pages=2), LAYOUT, kv) as cache:
        # 0.4 ms of loop time per page launched: above the 250 us turn budget even for one page.
        _counting(cache, "offload", stall_s=400e-6)
        _counting(cache, "load", stall_s=400e-6)
        offloads, loads = await _after_learning(cache, kv, 93)
        for sizes in (offloads, loads):
            # At the floor but the sizer's probe (one page more, one group in PROBE_EVERY). Where the
            # probe falls depends on how many groups the learning run took, which the host's
            # preemptions move (a group of 3 in it before the line is known): exact lists of 2 failed
            # on a loaded host whenever the probe left the run's last group.
            assert sum(sizes) == PAGES, (offloads, loads)
            past = [s for s in sizes if s > 2]
            assert len(past) <= -(-len(sizes) // PROBE_EVERY) and set(past) <= {3}, (offloads, loads)
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_launch_bytes_cap_a_group() -> None:
    kv = make_kv(95)
    cap = 5
    # A turn budget no launch reaches (1 s): the bytes alone bound the groups, on any device (the
    # H200's offload groups cost ~70 us a page, so 250 us would keep them at 3).
    cfg = config(None, pool_pages=2 * PAGES, launch_pages=2, launch_bytes=cap * LAYOUT.page_bytes, launch_turn_s=1.0)
    async with KVCache(cfg, LAYOUT, kv) as cache:
        offloads, loads = await _after_learning(cache, kv, 95)
        assert max(offloads) <= cap and max(loads) <= cap
        assert max(offloads) == cap and max(loads) == cap  # they did grow past the floor
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_no_turn_budget_keeps_groups_at_launch_pages() -> None:
    kv = make_kv(97)
    async with KVCache(config(None, pool_pages=2 * PAGES, launch_pages=3, launch_turn_s=0), LAYOUT, kv) as cache:
        offloads, loads = await _after_learning(cache, kv, 97)
        assert offloads == loads == [3] * (PAGES // 3) + [PAGES % 3]
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_split_launches_pool_pages_from_the_back_in_grown_groups() -> None:
    kv = make_kv(99)
    async with KVCache(config(None, pool_pages=2 * PAGES, **GROWTH), LAYOUT, kv) as cache:
        await _learned(cache, kv, 99)
        n = PAGES * T
        tokens = prompt(100, n)
        await cache.offload(tokens, torch.arange(n))
        loads = _counting(cache, "load")
        target = torch.arange(SLOTS - n, SLOTS)
        async with await cache.start_load(await cache.match(tokens), target) as stream:
            result = await stream.finish()  # the engine claims nothing: the loader takes it all
        assert (result.loaded_from, result.pool_pages) == (0, PAGES)
        assert sum(loads) == PAGES and len(loads) < PAGES // 2, loads
        assert torch.equal(kv[:, target.to(kv.device)], kv[:, :n])
        await assert_quiescent(cache)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")
@pytest.mark.asyncio
async def test_a_load_cancelled_with_grown_groups_writes_no_slot_after_its_cancellation() -> None:
    # The invariant under grown groups: once a cancelled load raised, none of its copies (several
    # pages each now) still writes the caller's slots.
    kv = make_kv(101)
    async with KVCache(config(None, pool_pages=2 * PAGES), LAYOUT, kv) as cache:
        await _learned(cache, kv, 101)
        n = PAGES * T
        tokens = prompt(102, n)
        await cache.offload(tokens, torch.arange(n))
        launched = asyncio.Event()
        loads = _counting(cache, "load", launched=launched)
        target = torch.arange(SLOTS - n, SLOTS)
        kv[:, target] = 0
        # Cancelled once it launched a group (queued behind the blocked copy thread).
        after_cancel = await cancel_behind_a_busy_copy_thread(
            cache, kv, target, cache.load(await cache.match(tokens), target), launched.wait)
        assert max(loads) > 2, loads  # grown past launch_pages
        assert torch.equal(kv[:, target], after_cancel), "a copy wrote the slots after CancelledError"
        await assert_quiescent(cache)


# timing: the sizer learns from wall-clock spins; beside other test workers a preempted group looks
# dear and the probe cheap, and the groups grow (to 4 under -n 3 on 2 CPUs, 7ee93af).
@pytest.mark.timing
@pytest.mark.asyncio
async def test_offload_groups_a_pacer_only_queued_are_not_learned_from() -> None:
    # CUDA offloads are paced: a group past the pacer's bytes is only queued (tens of us) and
    # launched later, the same host work, from a completion callback. Here every other group is
    # "queued" (fast, its Copy's launch not launched) and the launched ones hold the loop 400 us a
    # page: learned from, the queued ones grew the groups (whose deferred launches then held the
    # loop); now only launched groups count, and they keep the floor.
    from aiokv.transfers import PacedLaunch

    kv = make_kv(103)
    async with KVCache(config(None, pool_pages=2 * PAGES, launch_pages=2), LAYOUT, kv) as cache:
        transfers = cache._transfers
        assert transfers is not None
        original: Callable[..., Copy] = transfers.offload
        sizes: list[int] = []

        def paced(slots: torch.Tensor, page_ids: list[int]) -> Copy:
            sizes.append(len(page_ids))
            copy = original(slots, page_ids)
            if len(sizes) % 2:
                return dataclasses.replace(copy, launch=PacedLaunch(lambda: (copy.future, None), 0, copy.future))
            end = time.perf_counter() + 400e-6 * len(page_ids)
            while time.perf_counter() < end:
                pass
            return copy

        transfers.offload = paced  # type: ignore[method-assign]
        await _after_learning(cache, kv, 103)
        # One probe a page past the floor tells 400 us a page from a fixed cost (test_launches),
        # and every PROBE_EVERY-th group sized is one (the offload's last group takes what is left).
        assert max(sizes) <= 3 and sizes[-16:].count(3) <= 16 // PROBE_EVERY + 1, sizes
        assert sum(size == 2 for size in sizes[-16:]) >= 13, sizes
        await assert_quiescent(cache)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")
@pytest.mark.asyncio
async def test_an_offload_cancelled_with_grown_groups_stores_nothing_read_after_its_cancellation() -> None:
    # The invariant for the other direction: once a cancelled offload raised, none of its copies
    # (several pages each) still reads the caller's slots. The engine overwrites them at once; no
    # page of the prompt may then hold what it wrote.
    kv = make_kv(105)
    async with KVCache(config(None, pool_pages=2 * PAGES), LAYOUT, kv) as cache:
        await _learned(cache, kv, 105)
        n = PAGES * T
        tokens = prompt(106, n)
        source = torch.arange(n)
        original = kv[:, source].clone()
        launched = asyncio.Event()
        offloads = _counting(cache, "offload", launched=launched)
        transfers = cache._transfers
        assert transfers is not None
        counted: Callable[..., Copy] = transfers.offload
        copies: list[Copy] = []

        def kept(*args: Any) -> Copy:
            copies.append(counted(*args))
            return copies[-1]

        transfers.offload = kept  # type: ignore[method-assign]
        gate = threading.Event()
        blocker = cache._bridge.run_cpu(gate.wait)  # the copy thread busy with someone else's copy
        task = asyncio.create_task(cache.offload(tokens, source))
        try:
            await launched.wait()  # a group launched (queued behind the blocker)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # None of its copies is still to run: each was withdrawn or had ended.
            assert copies and all(c.future.done() for c in copies), "a copy out of the slots is still pending"
            kv[:, source] = 7.0  # the engine reuses the slots the moment the call raised
        finally:
            gate.set()  # never leave the copy thread blocked, also when the test fails
        await blocker
        await cache.flush()
        assert max(offloads) > 2, offloads  # grown past launch_pages
        target = torch.arange(SLOTS - n, SLOTS)
        match = await cache.match(tokens)
        if match.tokens:  # pages whose copies ended before the CancelledError may stay stored
            loaded = await cache.load(match, target[: match.tokens])
            got = kv[:, target[: loaded.tokens].to(kv.device)]
            assert torch.equal(got, original[:, : loaded.tokens]), "a page holds bytes written after CancelledError"
        # Nothing of the cancelled call is left held: the prompt offloads and loads back whole.
        kv[:, source] = original
        again = await cache.offload(tokens, source)
        assert again.stored + again.skipped == PAGES, again
        loaded = await cache.load(await cache.match(tokens), target)
        assert loaded.tokens == n and torch.equal(kv[:, target.to(kv.device)], original)
        await assert_quiescent(cache)
