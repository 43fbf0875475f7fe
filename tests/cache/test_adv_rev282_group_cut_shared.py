"""Helper-282: review of ``aiokv.loadpath.GroupStop`` (f4224ed, 5c3679f, 98a85a8) from outside.

A failed read in one read group cuts the call's later groups: their batch reads are cancelled and
the pages aborted. Attacks: the cut pages are ones another load and a prefetch of the same prompt
wait for (do they miss, or get a page marked loaded that is not?); the caller's cancel, or a
loop-wide cancel, lands in the very step of the cut. Real EIO on the io_uring ring (``_eio``),
groups of 2 pages, 4 groups, ``queue_depth`` 2. Slots start poisoned: any byte past a served prefix,
or any write after a call returned or was cancelled, shows.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt
from loop_probes import cancel_every_task_but_nowait, until_thread
from test_failed_copy_stops_work import _eio

from aiokv import KVCache
from aiokv.loadpath import GroupStop

T = LAYOUT.page_tokens
GROUP = 2
"""Pages in one read group (``read_group_bytes``)."""
PAGES = 4 * GROUP
N = PAGES * T
POISON = 100.0


def _config(tmp_path: Path, pool_pages: int = 24) -> Any:
    cfg = config(tmp_path, pool_pages=pool_pages, read_group_bytes=GROUP * LAYOUT.page_bytes)
    assert cfg.disk is not None
    return dataclasses.replace(cfg, disk=dataclasses.replace(cfg.disk, queue_depth=GROUP))


async def _written(tmp_path: Path, seed: int) -> tuple[list[int], torch.Tensor]:
    tokens = prompt(seed, N)
    source = make_kv(seed)
    async with KVCache(_config(tmp_path), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        assert (await writer.offload(tokens, torch.arange(N))).stored == PAGES
        await writer.flush()
    return tokens, source


@pytest.mark.asyncio
@pytest.mark.parametrize("failed", [0, 1, 2])
async def test_pages_a_cut_load_gave_up_are_served_to_the_load_and_prefetch_waiting_for_them(
    tmp_path: Path, failed: int,
) -> None:
    """Load A reserves every page first; load B and a prefetch of the same prompt wait for A's
    pages. Page ``failed`` fails once (EIO): A serves ``[0, failed)`` and cuts its later groups
    (their pages aborted). B reads the pages A gave up itself: it serves the whole prompt,
    bit-exact; nothing past A's prefix is written into A's slots; one fault; all pages back."""
    tokens, source = await _written(tmp_path, 282)
    kv = torch.full_like(source, POISON)
    async with KVCache(_config(tmp_path), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        _eio(cache, cache._manager.keys(tokens)[failed], every=False)
        ma, mb = await cache.match(tokens), await cache.match(tokens)
        assert ma.disk_pages == mb.disk_pages == PAGES
        free = cache.stats().pool_free
        a = asyncio.ensure_future(cache.load(ma, torch.arange(N)))
        # B and the prefetch only once A's groups hold every page (or A ended: a cut at page 0):
        # on CUDA a load may yield before it reserves (its stream's ordering), and B or the
        # prefetch then read the failing page first (the GPU run failed so: A served all 32).
        await until_thread(lambda: cache.stats().pool_free <= free - PAGES or a.done(), "A holds every page")
        b = asyncio.ensure_future(cache.load(mb, torch.arange(N, 2 * N)))
        f = asyncio.ensure_future(cache.prefetch(tokens))
        ra, rb, _ = await asyncio.gather(a, b, f)
        assert ra.tokens == failed * T
        assert rb.tokens == N, rb
        assert torch.equal(kv[:, : failed * T], source[:, : failed * T])
        assert bool((kv[:, failed * T : N] == POISON).all())
        assert torch.equal(kv[:, N : 2 * N], source[:, :N])
        await assert_quiescent(cache)
        errors = cache.stats().errors
        assert errors.get("disk_read_failed") == 1, errors
        assert bool((kv[:, 2 * N :] == POISON).all())


@pytest.mark.asyncio
@pytest.mark.parametrize(("who", "when"), [("caller", "before"), ("caller", "after"), ("loop", "after")])
async def test_a_cancel_in_the_step_of_the_cut_leaves_the_slots_alone_and_the_cache_quiescent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, who: str, when: str,
) -> None:
    """Page 1 fails (EIO every read); in the step its group cuts the later ones, the load is
    cancelled by its caller (just before or just after the cuts run), or every task but the test's
    is (a signal handler's cancel, in the next callback: before the cut groups resume).
    The load raises ``CancelledError``; nothing writes into its slots after that; every pool page
    and reservation comes back; no exception is left unretrieved; the cache then serves a load of
    the prompt's readable prefix."""
    tokens, source = await _written(tmp_path, 2820)
    kv = torch.full_like(source, POISON)
    async with KVCache(_config(tmp_path), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        _eio(cache, cache._manager.keys(tokens)[1], every=True)
        match = await cache.match(tokens)
        me = asyncio.current_task()
        load: list[asyncio.Task[Any]] = []
        real_failed = GroupStop.failed
        cuts: list[int] = []

        def cancel() -> None:
            if who == "caller":
                load[0].cancel()
            else:
                # As a signal handler's: in a callback of its own, before the cut groups resume
                # (a cancel of the failing group inside its own step, as it returns, is no signal's).
                asyncio.get_running_loop().call_soon(cancel_every_task_but_nowait, me)

        def failed(self: GroupStop, page: int) -> None:
            first = not cuts
            cuts.append(page)
            if first and when == "before":
                cancel()
            real_failed(self, page)
            if first and when == "after":
                cancel()

        monkeypatch.setattr(GroupStop, "failed", failed)
        load.append(asyncio.ensure_future(cache.load(match, torch.arange(N))))
        try:
            await load[0]
        except asyncio.CancelledError:
            pass
        assert cuts, "the cut never ran"
        seen = kv.clone()
        await assert_quiescent(cache)
        assert torch.equal(kv, seen), "a copy wrote into the slots after the load was cancelled"
        assert bool((kv[:, T:] == POISON).all())
        monkeypatch.setattr(GroupStop, "failed", real_failed)
        again = await cache.match(tokens)
        result = await cache.load(again, torch.arange(N, 2 * N))
        assert result.tokens == T
        assert torch.equal(kv[:, N : N + T], source[:, :T])
        await assert_quiescent(cache)

