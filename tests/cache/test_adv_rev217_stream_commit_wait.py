"""Adversarial (helper-217): ``commit_wait`` bounds a stream end to end, as it bounds a load.

Review 214 (bc94f34) gave a load and a prefetch one ``commit_wait`` deadline for all their waits
on pages other calls are writing; a stream's promotions (``LoadPath.promote``, one a page) still
took a fresh bound each: a stream whose first wait ended late (its writer gave the page up just
before the bound) then met a page whose writer was stopped and waited a whole bound again, about
twice the configured bound in all (1.6 s for a 1 s bound). Now the stream passes one
``CommitWaits`` to all its promotions.

The writers are page-table reservations (as a TP rank's copy holds one): page 1's (read first: a
stream reads back to front, one read at a time here) given up at ``GIVE_UP_S``, page 0's stopped
for good. Pages 0-1 are on disk only.

A timing test: the bound is what it is about.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, errors_of, make_kv, on_disk_only, prompt, reserve_each

from aiokv import KVCache
from aiokv.pagetable import PageHandle

T = LAYOUT.page_tokens
PAGES = 2
WAIT_S = 1.0
"""commit_wait."""
GIVE_UP_S = 0.6
"""When page 1's writer gives it up (within the bound): a timed event, it is what the bound is about."""
SLACK_S = 0.3
BOUND_S = 10.0

pytestmark = pytest.mark.timing


@pytest.mark.asyncio
async def test_a_stream_waits_commit_wait_in_all_across_its_promotions(tmp_path: Path) -> None:
    tokens = prompt(2174, PAGES * T)
    kv = make_kv(2175)
    cfg = config(tmp_path / "disk", pool_pages=16, commit_wait=WAIT_S)
    assert cfg.disk is not None
    cfg = dataclasses.replace(cfg, disk=dataclasses.replace(cfg.disk, queue_depth=1))  # one read ahead
    async with KVCache(cfg, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        table = cache.pool.table
        keys = await on_disk_only(cache, tokens, torch.arange(PAGES * T))
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, PAGES), match
        writers: list[PageHandle] = reserve_each(cache, keys)
        loop = asyncio.get_running_loop()
        target = torch.arange(100, 100 + PAGES * T)

        def give_up_page_1() -> None:
            table.abort(writers[1])

        try:
            started = time.monotonic()
            loop.call_later(GIVE_UP_S, give_up_page_1)
            async with asyncio.timeout(BOUND_S):
                stream = await cache.start_load(match, target)
                result = await stream.finish()
            elapsed = time.monotonic() - started
        finally:
            for handle in writers:
                if not handle.released:
                    table.abort(handle)
        # Page 1 read after its writer gave it up, page 0's writer still at it: a miss there.
        assert result.loaded_tokens == T, (result, errors_of(cache))
        assert torch.equal(kv[:, target[T:]], kv[:, T : PAGES * T])
        # Before: GIVE_UP_S + WAIT_S (page 0's promotion took a fresh bound).
        assert WAIT_S * 0.9 < elapsed < WAIT_S + SLACK_S, elapsed
        assert errors_of(cache).get("commit_wait_expired") == 1, errors_of(cache)
        await assert_quiescent(cache)
