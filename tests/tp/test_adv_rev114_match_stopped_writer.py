"""Review 114: ``match`` waits without bound for a page whose writer rank is stopped.

``match`` waits for pages another call is writing into the pool (``PageTable.wait_committed``)
rather than stopping at them. In a TP group the writer is a rank process: one that is stopped
(SIGSTOP, a cgroup freeze, a rank stuck in a driver call) keeps its offload's pages RESERVED for
as long as it is stopped, and every ``match`` of a prompt sharing them waits as long: the
scheduler's lookups of those prompts hang. The offload itself must wait (the rank may still read
the engine's slots), but a match touches no caller memory: stopping at the page (a shorter hit,
never wrong KV) after a bound would cost only speed. Now a match waits at most ``commit_wait``
in all, then stops there (counted ``commit_wait_expired``); it failed (TimeoutError) before.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch
from adv_helpers import AdvRanks, attach_ranks, idx, rank_prefix_kv, stop_process
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout
from aiokv.tp import TPCache

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
NUM_SLOTS = 64
PAGES = 4
OFFLOAD_WAIT_S = 0.5
BOUND_S = 3.0
"""A match must answer within this (a generous multiple of commit_wait, the cache's own bound on
waiting for pages), whatever a rank does."""


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_match_answers_while_the_rank_writing_its_pages_is_stopped(
        tmp_path: Path, ranks_left: list[AdvRanks]) -> None:
    config = CacheConfig(cpu_bytes=16 * LAYOUT.page_bytes, disk=None, namespace="tp-adv-114-match",
                         pool_chunk_bytes=8 * LAYOUT.page_bytes, offload_wait=OFFLOAD_WAIT_S,
                         commit_wait=OFFLOAD_WAIT_S)
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        ranks = await attach_ranks(cache, ranks_left, LAYOUT, NUM_SLOTS)
        tokens = list(range(3000, 3000 + PAGES * T))
        source = list(range(PAGES * T))
        for rank in range(2):
            await ranks.write(rank, source, rank_prefix_kv(LAYOUT, tokens, 0, rank, 2))
        pid = ranks.ranks[1].proc.pid
        assert pid is not None
        await stop_process(pid)
        try:
            offload = asyncio.create_task(cache.offload(tokens, idx(source)))
            for _ in range(200):  # its pages reserved, their copies sent to the ranks
                if cache.stats().pool_reserved == PAGES:
                    break
                await asyncio.sleep(0.01)
            assert cache.stats().pool_reserved == PAGES, cache.stats()
            try:
                async with asyncio.timeout(BOUND_S):
                    match = await cache.match(tokens)
            finally:
                assert not offload.done(), "the offload returned while a rank could still read its slots"
            assert match.tokens < PAGES * T  # stopped at the pages not committed: never wrong KV
            assert cache.stats().errors["commit_wait_expired"] == 1
            match.release()
        finally:
            os.kill(pid, signal.SIGCONT)
        result = await offload
        assert result.stored == PAGES, result
        match = await cache.match(tokens)
        assert match.tokens == PAGES * T
        target = list(range(NUM_SLOTS - PAGES * T, NUM_SLOTS))
        loaded = await cache.load(match, idx(target))
        assert loaded.tokens == PAGES * T
        for rank in range(2):
            assert torch.equal(await ranks.read(rank, target), rank_prefix_kv(LAYOUT, tokens, 0, rank, 2))
        stats = cache.stats()
        assert stats.pool_reserved == 0 and stats.pool_referenced == 0, stats
        await ranks.stop_all()
