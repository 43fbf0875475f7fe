"""Review 263 (helper-268): a stream dropped without finish()/aclose() is abandoned on its loop by a
task of its own (``LoadStream._abandon_dropped``). A loop-wide cancel (a signal's handler cancelling
every task) at the turn after that task was created ended it before its first step: nothing was
abandoned, and the stream's pool pages (those of its failed copy) stayed referenced until the
cache's close."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt
from loop_probes import until

from aiokv import KVCache
from aiokv.transfers import failed_copy

T = LAYOUT.page_tokens
PAGES = 8
N = PAGES * T


def _cut_all_but(spared: asyncio.Task[object] | None) -> int:
    cut = 0
    for task in asyncio.all_tasks():
        if task is not spared and not task.done():
            task.cancel()
            cut += 1
    return cut


@pytest.mark.asyncio
async def test_a_loop_wide_cancel_never_leaves_a_dropped_streams_pages_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_kv(slots=3 * N)
    async with KVCache(config(None, pool_pages=2 * PAGES), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        tokens = prompt(2680, N)
        assert (await cache.offload(tokens, torch.arange(N))).stored == PAGES
        want = kv[:, :N].clone()
        # Its copies fail at launch: a failed copy's pages stay with the stream until its end (a
        # delivered copy gives its own back as it ends, whatever became of the stream).
        transfers = cache._transfers
        assert transfers is not None
        monkeypatch.setattr(transfers, "load", lambda *_: failed_copy(RuntimeError("copy launch fault (injected)")))
        stream = await cache.start_load(await cache.match(tokens), torch.arange(N, 2 * N))
        async with asyncio.timeout(30):
            await stream.launched()
        loader = stream._loader
        await until(loader.done)  # the loader holds the stream until it ends
        assert cache.stats().pool_referenced > 0
        held = [stream]
        del stream
        with pytest.warns(ResourceWarning, match="LoadStream"):
            _drop(held)  # the engine's step raised before finish()
        abandons = cache.stats().background_jobs
        await asyncio.sleep(0)  # the finalizer's callback creates the abandon's task this turn
        assert cache.stats().background_jobs == abandons + 1
        assert _cut_all_but(asyncio.current_task()) >= 1  # the abandon, before its first step
        async with asyncio.timeout(30):
            await cache.flush()
        assert cache.stats().pool_referenced == 0, "the dropped stream's pages stayed pinned"
        await assert_quiescent(cache)
        monkeypatch.undo()
        async with await cache.match(tokens) as match:  # the pages are whole and served again
            assert match.tokens == N
            await cache.load(match, torch.arange(2 * N, 3 * N))
        assert torch.equal(kv[:, 2 * N : 3 * N], want)


def _drop(held: list[object]) -> None:
    """Drop the last reference (collected at once, or by the collection after)."""
    held.clear()
    gc.collect()
