"""Adversarial (helper-214): a wait for another call's commit that ends exactly at its deadline.

``ManagerBase._wait_written`` waits (``commit_wait``) for the page another call is writing; when
that writer gives the page up and a third call reserves it again, it waits for the third one
within the same deadline. Its loop returned False uncounted when the deadline had passed by then:
the abort's wake-up reached the waiter (two loop hops: the shield's callback, then the task) in
the same loop turn as the timeout's callback became due, and ran first (a long callback of the
engine between them), so the wait ended without its ``TimeoutError``. The call stopped at the page
as an expiry does (a match stopped there and served no disk page past it) but counted no
``commit_wait_expired``: a stopped writer's only trace was missing. Now it is counted, once a
call, as the other expiries are, for a match, a load's promotion, a prefetch and an offload.

The page's writers are reservations of the page table (as a TP rank's copy holds one): the first
given up just before the deadline and the page reserved again at once by a third, then a callback
that holds the loop past the deadline (as an engine step does).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, errors_of, make_kv, prompt
from loop_probes import until, waiting_in

from aiokv import KVCache
from aiokv.pagetable import PageHandle

T = LAYOUT.page_tokens
WAIT_S = 0.3
"""commit_wait."""
EARLY_S = 0.05
"""How long before the deadline the first writer gives the page up."""
BOUND_S = 10.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer")


def _reserve(cache: KVCache, tokens: list[int]) -> PageHandle:
    (res,) = cache.pool.reserve(cache.keys(tokens)[:1])
    assert res.handle is not None, res
    return res.handle


def _call(cache: KVCache, call: str, tokens: list[int], match: Any) -> asyncio.Task[Any]:
    if call == "match":
        return asyncio.create_task(cache.match(tokens))
    if call == "prefetch":
        return asyncio.create_task(cache.prefetch(tokens))
    if call == "load":
        return asyncio.create_task(cache.load(match, torch.arange(4 * T, 4 * T + match.tokens)))
    return asyncio.create_task(cache.offload(tokens, torch.arange(len(tokens))))


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["match", "prefetch", "load", "offload"])
async def test_a_wait_that_ends_at_its_deadline_behind_a_third_writer_counts_its_expiry(
        tmp_path: Path, call: str) -> None:
    tokens = prompt(2147, T)
    kv = make_kv(2148)
    async with KVCache(config(tmp_path / "disk", pool_pages=16, commit_wait=WAIT_S), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        table = cache.pool.table
        (key,) = cache.keys(tokens)
        assert (await cache.offload(tokens, torch.arange(T))).stored == 1
        await cache.flush()
        assert disk.contains(key) and table.discard(key)  # on disk only
        match = await cache.match(tokens) if call == "load" else None
        first = _reserve(cache, tokens)
        third: list[PageHandle] = []
        loop = asyncio.get_running_loop()
        before = loop.time()
        task = _call(cache, call, tokens, match)
        # In its wait (a load's runs in a promotion's task of its own).
        await until(lambda: any(waiting_in(t, "wait_committed") for t in asyncio.all_tasks()))
        after = loop.time()  # the call's deadline lies in [before, after] + WAIT_S

        def hold_the_loop() -> None:
            # A long callback (an engine step): the loop runs on past the deadline.
            end = after + WAIT_S + 0.01
            while loop.time() < end:
                pass

        def give_up_and_reserve_again() -> None:
            table.abort(first)
            third.append(_reserve(cache, tokens))
            loop.call_soon(hold_the_loop)

        loop.call_at(before + WAIT_S - EARLY_S, give_up_and_reserve_again)
        try:
            async with asyncio.timeout(BOUND_S):
                result = await task
        finally:
            for handle in third:
                table.abort(handle)
        assert third, "the first writer was never given up"
        # Stopped at the page, as an expiry stops: nothing served or stored from it.
        if call == "match":
            assert (result.pool_pages, result.disk_pages) == (0, 0), result
        elif call == "prefetch":
            assert (result.pool_pages, result.promoted) == (0, 0), result
        elif call == "load":
            assert result.tokens == 0, result
        else:
            assert (result.stored, result.skipped) == (0, 1), result
        errors = errors_of(cache)
        # Before: no commit_wait_expired (the wait ended at its deadline without a TimeoutError).
        assert errors.get("commit_wait_expired") == 1, errors
        if match is not None:
            match.release()
        await assert_quiescent(cache)
