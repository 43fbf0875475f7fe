"""Adversarial (helper-202): a prefetch of pages another call is still writing into the pool.

``prefetch`` counted a page being written (RESERVED: an offload's copy, a promotion's read) as
in the pool and went on past it. When that writer then gave the page up (cancelled, its copy or
read failed), the prefetch had reported pages that were not there and read nothing: a load right
after it found the page on disk only (a disk read the prefetch was meant to save), or nowhere.
Now a prefetch waits for such a page as a match does (``commit_wait`` at most, in all): a page
committed counts in the pool; one given up is read from disk when the tier holds it, and the
prefix ends there otherwise. So what a prefetch reports is what the next match finds in the pool.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, CopyThreadGate, assert_quiescent, config, errors_of
from loop_probes import until, waiting_in
from test_adv_rev195_cancel_sweep import GARBAGE, oracle, prompt
from test_adv_rev195_scenarios import BOUND_S, PAGES, N, T, _kv, _region

from aiokv import KVCache

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")


async def _offload(cache: KVCache, kv: torch.Tensor, tokens: list[int], region: int = 7) -> None:
    slots = _region(region, len(tokens))
    kv[:, slots] = oracle(tokens, None)
    await cache.offload(tokens, slots)
    kv[:, slots] = GARBAGE


async def _on_disk_only(cache: KVCache, kv: torch.Tensor, tokens: list[int]) -> None:
    await _offload(cache, kv, tokens)
    await cache.flush()
    for key in cache.keys(tokens):
        assert cache.pool.table.discard(key)
    assert cache.disk is not None and all(cache.disk.contains(k) for k in cache.keys(tokens))


@pytest.mark.asyncio
@pytest.mark.parametrize("on_disk", [True, False])
@pytest.mark.parametrize("writer", ["cancelled", "delivers"])
async def test_a_prefetch_reports_what_the_next_match_finds_in_the_pool(
    tmp_path: Path, on_disk: bool, writer: str
) -> None:
    """An engine offloads the prompt again (its copy held) while a prefetch of it runs; the
    offload is then cancelled (its pages aborted) or delivers. The prefetch's result must say
    what a match finds in the pool afterwards, and a load must serve the oracle's bytes from
    there. Before: the prefetch returned at once with pool_pages=6, promoted=0; after the cancel
    the match found 0 pages in the pool (6 on disk, or none without them)."""
    kv = _kv()
    tokens = prompt(31 + on_disk)[:N]
    async with KVCache(config(tmp_path / "disk", pool_pages=16, commit_wait=5.0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        if on_disk:
            await _on_disk_only(cache, kv, tokens)
        source = _region(1)
        kv[:, source] = oracle(tokens, None)
        gate = CopyThreadGate(cache)
        try:
            offload = asyncio.ensure_future(cache.offload(tokens, source))
            await until(lambda: cache.stats().pool_reserved == PAGES)
            prefetch = asyncio.ensure_future(cache.prefetch(tokens))
            await until(lambda: waiting_in(prefetch, "wait_committed") or prefetch.done())
            early = prefetch.done()  # returned without waiting for the page being written: checked below
            if writer == "cancelled":
                offload.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await offload
                kv[:, source] = GARBAGE
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            result = await prefetch
            if writer == "delivers":
                await offload
                kv[:, source] = GARBAGE
        expected = PAGES if on_disk or writer == "delivers" else 0
        assert result.pool_pages + result.promoted == expected, result
        if writer == "cancelled":
            assert result.pool_pages == 0, result  # none of them was there: read (or missing)
        match = await cache.match(tokens)
        assert match.pool_pages == result.pool_pages + result.promoted, (match, result)
        assert match.disk_pages == 0 or match.pool_pages == PAGES, match
        target = _region(2)
        load = await cache.load(match, target[: match.tokens])
        assert load.tokens == expected * T and load.disk_pages == 0, load
        assert torch.equal(kv[:, target[: load.tokens]], oracle(tokens, None)[:, : load.tokens])
        assert not early, result  # it waited for the pages being written
        assert errors_of(cache) == {}, errors_of(cache)
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_prefetch_waits_for_a_stopped_writer_only_commit_wait(tmp_path: Path) -> None:
    """The writer stays stopped (its copy held past ``commit_wait``): the prefetch returns after
    the bound with the pages before it, counted ``commit_wait_expired`` once, and reads nothing
    past it (a load there would wait for the same writer)."""
    kv = _kv()
    tokens = prompt(33)[:N]
    wait = 0.3
    async with KVCache(config(tmp_path / "disk", pool_pages=16, commit_wait=wait), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await _on_disk_only(cache, kv, tokens)
        source = _region(1)
        kv[:, source] = oracle(tokens, None)
        gate = CopyThreadGate(cache)
        try:
            offload = asyncio.ensure_future(cache.offload(tokens, source))
            await until(lambda: cache.stats().pool_reserved == PAGES)
            loop = asyncio.get_running_loop()
            began = loop.time()
            async with asyncio.timeout(wait + BOUND_S):
                result = await cache.prefetch(tokens)
            assert loop.time() - began >= wait * 0.9
            assert not offload.done()
        finally:
            await gate.open()
        assert (result.pool_pages, result.promoted) == (0, 0), result
        assert errors_of(cache) == {"commit_wait_expired": 1}, errors_of(cache)
        async with asyncio.timeout(BOUND_S):
            await offload
        kv[:, source] = GARBAGE
        await assert_quiescent(cache)
