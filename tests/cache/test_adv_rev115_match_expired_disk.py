"""Review 115: ``match`` bounds its wait for pages another call is still writing (f37ede4), but a
page it stopped at may also be on disk (written before, evicted from the pool since, offloaded again
by a writer that is now stopped). The match then counted it, and what follows it, as disk pages,
and the ``load`` of that match promotes the page: the pool answers PENDING (the stopped writer's
reservation) and ``_already_in`` waits for its commit without bound. The bound of the match was
lost one call later: the load hung for as long as the writer did (here: the copy thread held, as a
SIGSTOPped TP rank holds it). Now a match whose wait expired serves nothing from that page on.

Second finding (``_already_in``): a match taken *before* the writer reserved the page has its disk
pages, and its load waited for that writer without bound; now the promotion waits ``commit_wait``
at most too (a shorter load, counted ``commit_wait_expired``).

CPU only: the offload's copy is held on the copy thread (on CUDA the mover runs on the loop).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, mover_of, prompt
from held_call import Hold

from aiokv import KVCache, OffloadResult
from aiokv.pagetable import PageState

T = LAYOUT.page_tokens
PAGES = 3
OTHER = 8  # pages of the prompt that pushes PAGES out of the pool
POOL = 8
WAIT_S = 0.3  # commit_wait: the match's (and a promotion's) bound
LOAD_BOUND_S = 3.0  # a load that waits for the held writer runs past this
BOUND_S = 10.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")


async def _on_disk_only(cache: KVCache, kv: torch.Tensor, tokens: list[int]) -> None:
    """``tokens``' pages written to disk, then pushed out of the pool by another prompt's."""
    assert (await cache.offload(tokens, torch.arange(PAGES * T))).stored == PAGES
    await cache.flush()
    other = prompt(1150, OTHER * T)
    assert (await cache.offload(other, torch.arange(SLOTS_OTHER, SLOTS_OTHER + OTHER * T))).stored == OTHER
    await cache.flush()
    disk = cache.disk
    assert disk is not None
    keys = cache.keys(tokens)
    assert all(disk.contains(k) for k in keys)
    assert all(cache.pool.table.state_of(k) is PageState.FREE for k in keys), "still in the pool"


SLOTS_OTHER = 64


async def _held_offload(
    cache: KVCache, monkeypatch: pytest.MonkeyPatch, tokens: list[int]
) -> tuple[Hold, asyncio.Task[OffloadResult]]:
    """An offload of ``tokens`` whose copy is held: its pages stay RESERVED until released."""
    hold = Hold()
    mover = mover_of(cache)
    monkeypatch.setattr(mover, "offload", hold.wrap(mover.offload))
    task = asyncio.create_task(cache.offload(tokens, torch.arange(PAGES * T)))
    assert await asyncio.to_thread(hold.entered.wait, BOUND_S)
    assert all(cache.pool.table.state_of(k) is PageState.RESERVED for k in cache.keys(tokens))
    return hold, task


async def _finish(cache: KVCache, kv: torch.Tensor, tokens: list[int], hold: Hold,
                  offload: asyncio.Task[OffloadResult]) -> None:
    """Release the writer; the prompt then loads whole and bit-exact, nothing is left behind."""
    hold.release()
    async with asyncio.timeout(BOUND_S):
        await offload
        match = await cache.match(tokens)
        assert match.tokens == PAGES * T
        target = torch.arange(120, 120 + PAGES * T)
        assert (await cache.load(match, target)).tokens == PAGES * T
    assert torch.equal(kv[:, target], kv[:, : PAGES * T])
    await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_load_of_a_match_that_stopped_at_a_held_page_does_not_wait_for_its_writer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompt(1151, PAGES * T)
    kv = make_kv(1152)
    async with KVCache(config(tmp_path, pool_pages=POOL, commit_wait=WAIT_S), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await _on_disk_only(cache, kv, tokens)
        hold, offload = await _held_offload(cache, monkeypatch, tokens)
        try:
            async with asyncio.timeout(BOUND_S):
                match = await cache.match(tokens)
            assert cache.stats().errors["commit_wait_expired"] == 1
            # Before: disk_pages == PAGES, and the load below hung until the writer was released.
            assert (match.pool_pages, match.disk_pages) == (0, 0)
            target = torch.arange(120, 120 + match.tokens)
            async with asyncio.timeout(LOAD_BOUND_S):
                result = await cache.load(match, target)
            assert result.tokens == 0
        finally:
            await _finish(cache, kv, tokens, hold, offload)


@pytest.mark.asyncio
async def test_a_stream_of_a_match_that_stopped_at_a_held_page_finishes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The split's loader promoted the page the same way: finish() waited for the writer (the engine
    # had not claimed into the page: the load must bring it).
    tokens = prompt(1153, PAGES * T)
    kv = make_kv(1154)
    async with KVCache(config(tmp_path, pool_pages=POOL, commit_wait=WAIT_S), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await _on_disk_only(cache, kv, tokens)
        hold, offload = await _held_offload(cache, monkeypatch, tokens)
        try:
            async with asyncio.timeout(BOUND_S):
                match = await cache.match(tokens)
            target = torch.arange(120, 120 + match.tokens)
            async with asyncio.timeout(LOAD_BOUND_S):
                stream = await cache.start_load(match, target)
                result = await stream.finish()
            assert result.loaded_tokens == 0
        finally:
            await _finish(cache, kv, tokens, hold, offload)


@pytest.mark.asyncio
async def test_a_load_whose_disk_page_a_held_writer_reserved_after_the_match_is_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompt(1155, PAGES * T)
    kv = make_kv(1156)
    async with KVCache(config(tmp_path, pool_pages=POOL, commit_wait=WAIT_S), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await _on_disk_only(cache, kv, tokens)
        match = await cache.match(tokens)  # nothing reserved yet: all of it from disk
        assert match.disk_pages == PAGES
        hold, offload = await _held_offload(cache, monkeypatch, tokens)
        try:
            target = torch.arange(120, 120 + PAGES * T)
            # Bounded like the match: at most commit_wait for the writer, then a shorter load.
            async with asyncio.timeout(LOAD_BOUND_S):
                result = await cache.load(match, target)
            assert result.tokens < PAGES * T
        finally:
            await _finish(cache, kv, tokens, hold, offload)
