"""Adversarial (helper-214): ``commit_wait`` bounds a prefetch end to end, not each of its waits.

A prefetch waits for a page of the pool's prefix another call is writing (``commit_wait`` at most),
and its promotions wait for disk pages another call is bringing in. Each took its own
``commit_wait`` from when it began: a prefetch whose first wait ended late (the writer committed
just before the bound) then met a page whose writer was stopped and waited a fresh
``commit_wait`` for it: about twice the configured bound in all (here 1.6 s for a 1 s bound).
Now one deadline holds for the whole call (set at its first wait), as a match's does; the page
past it is a miss, counted ``commit_wait_expired`` once.

Everything real: page 0's writer is an offload whose copy is held on the copy thread (let go at
``RELEASE_S``: it commits in time), page 2's is another prefetch whose disk read is held in
front of the tier's backend past the bound (as a stopped device holds it); page 1 is on disk only.

CPU only: the copy thread is held (on CUDA the mover runs on the loop).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, errors_of, make_kv, mover_of, prompt
from held_call import Hold
from load_gate import LoadGate
from loop_probes import until_thread

from aiokv import KVCache
from aiokv.pagetable import PageState

T = LAYOUT.page_tokens
PAGES = 3
WAIT_S = 1.0
"""commit_wait."""
RELEASE_S = 0.6
"""When page 0's writer is let go (it commits within the bound): a timed event, it is what the
bound is about."""
SLACK_S = 0.3
BOUND_S = 10.0

pytestmark = [pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread"),
              pytest.mark.timing]


@pytest.mark.asyncio
async def test_a_prefetch_waits_commit_wait_in_all_across_its_waits(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompt(2145, PAGES * T)
    kv = make_kv(2146)
    async with KVCache(config(tmp_path / "disk", pool_pages=16, commit_wait=WAIT_S), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        table = cache.pool.table
        keys = cache.keys(tokens)
        assert (await cache.offload(tokens, torch.arange(PAGES * T))).stored == PAGES
        await cache.flush()
        assert all(disk.contains(k) for k in keys)
        # Page 2's writer: a prefetch whose read of it is held (pages 0 and 1 in the pool).
        assert table.discard(keys[2])
        gate = LoadGate(disk, monkeypatch, limit=1)
        stuck = asyncio.create_task(cache.prefetch(tokens))
        hold = Hold()
        try:
            await until_thread(lambda: bool(gate.held), "the held read's load")
            assert table.state_of(keys[2]) is PageState.RESERVED
            # Page 1 on disk only; page 0's writer: an offload whose copy is held.
            assert table.discard(keys[0]) and table.discard(keys[1])
            mover = mover_of(cache)
            monkeypatch.setattr(mover, "offload", hold.wrap(mover.offload))
            writer = asyncio.create_task(cache.offload(tokens[:T], torch.arange(T)))
            await hold.wait_entered()
            assert table.state_of(keys[0]) is PageState.RESERVED
            loop = asyncio.get_running_loop()
            started = time.monotonic()
            loop.call_later(RELEASE_S, hold.release)
            async with asyncio.timeout(BOUND_S):
                result = await cache.prefetch(tokens)
            elapsed = time.monotonic() - started
            # Page 0 committed in time (in the pool), page 1 read, page 2 still held: a miss.
            assert (result.pool_pages, result.promoted) == (1, 1), result
            # Before: RELEASE_S + WAIT_S (the promotion's wait took a fresh bound).
            assert WAIT_S * 0.9 < elapsed < WAIT_S + SLACK_S, elapsed
            assert errors_of(cache) == {"commit_wait_expired": 1}, errors_of(cache)
            async with asyncio.timeout(BOUND_S):
                assert (await writer).stored == 1
        finally:
            hold.release()
            gate.open()
            async with asyncio.timeout(BOUND_S):
                await stuck
        async with asyncio.timeout(BOUND_S):
            match = await cache.match(tokens)
            assert match.tokens == PAGES * T
            target = torch.arange(120, 120 + PAGES * T)
            assert (await cache.load(match, target)).tokens == PAGES * T
        assert torch.equal(kv[:, target], kv[:, : PAGES * T])
        await assert_quiescent(cache)
