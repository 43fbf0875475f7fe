"""Adversarial (review 107): a rank process that stalls (SIGSTOP) with a load in flight.

A stopped rank may still write the load's slots once it runs again, so the load must not return
while it is stopped, not even when the caller's ``asyncio.timeout`` expires (the cancellation
waits for the rank's part). Checked with real processes: meanwhile the manager's loop serves
other calls (``match``); SIGKILLing the stopped rank ends the load within a bound (the caller's
TimeoutError, the fault counted, no reference or reservation left); SIGCONT of another stopped
rank lets its load finish bit-exact; a restarted rank then loads every token bit-exact. A close
with a stopped rank owing a report keeps the pool until the rank is killed, then ends and frees it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch
from adv_helpers import START_S, AdvRanks, attach_ranks, idx, rank_prefix_kv, stop_process
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout, LoadResult
from aiokv.shm import SHM_DIR
from aiokv.tp import RankStatus, TPCache

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
NUM_SLOTS = 128
PAGES = 4
BOUND_S = 20.0
STALLED_S = 0.5
"""How long a load with a stopped rank is watched not returning."""


async def _store(cache: TPCache, ranks: AdvRanks, tokens: list[int]) -> None:
    source = list(range(PAGES * T))
    for rank in range(2):
        await ranks.write(rank, source, rank_prefix_kv(LAYOUT, tokens, 0, rank, 2))
    result = await cache.offload(tokens, idx(source))
    assert (result.stored, result.dropped) == (PAGES, 0), result


async def _check(ranks: AdvRanks, tokens: list[int], target: list[int]) -> None:
    for rank in range(2):
        got = await ranks.read(rank, target)
        assert torch.equal(got, rank_prefix_kv(LAYOUT, tokens, 0, rank, 2)), f"rank {rank}: wrong KV"


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_stopped_rank_holds_its_load_until_it_dies_or_resumes(tmp_path: Path,
                                                                      ranks_left: list[AdvRanks]) -> None:
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="tp-adv-stall",
                         pool_chunk_bytes=8 * LAYOUT.page_bytes)
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        ranks = await attach_ranks(cache, ranks_left, LAYOUT, NUM_SLOTS)
        tokens = list(range(1000, 1000 + PAGES * T))
        await _store(cache, ranks, tokens)
        target = list(range(NUM_SLOTS - PAGES * T, NUM_SLOTS))

        async def bounded_load(bound: float) -> LoadResult:
            match = await cache.match(tokens)
            assert match.tokens == PAGES * T
            async with asyncio.timeout(bound):
                return await cache.load(match, idx(target))

        def ended(load: asyncio.Task[LoadResult]) -> str:
            """What a load that ended while a rank was stopped returned (for the failure message)."""
            outcome = load.exception() or load.result()
            return f"a load returned while a stopped rank could still write its slots: {outcome!r}; " \
                   f"{cache.group_statistics()}"

        for victim, ending in ((1, signal.SIGKILL), (0, signal.SIGCONT)):
            pid = ranks.ranks[victim].proc.pid
            assert pid is not None
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()  # both attached: a rank not attached makes the load a miss at once
            await stop_process(pid)
            load = asyncio.create_task(bounded_load(0.05))
            done, _ = await asyncio.wait({load}, timeout=STALLED_S)
            assert not done, ended(load)
            async with asyncio.timeout(5):
                other = await cache.match(tokens)  # the loop still serves
            assert other.tokens == PAGES * T
            other.release()
            if ending is signal.SIGKILL:
                ranks.kill(victim)
            else:
                os.kill(pid, signal.SIGCONT)
            async with asyncio.timeout(BOUND_S):
                with pytest.raises(TimeoutError):
                    await load
            stats = cache.stats()
            assert stats.pool_reserved == 0 and stats.pool_referenced == 0, stats
            assert cache.group_statistics().jobs.in_flight == 0
            if ending is signal.SIGKILL:
                # Counted by the group (the cancelled load's own fault is not in stats().errors).
                group = cache.group_statistics()
                assert group.disconnects == 1 and group.jobs.rank_failures.get(RankStatus.RANK_LOST, 0) >= 1, group
                await ranks.reap_dead()
                ranks.start(victim)
                async with asyncio.timeout(START_S):
                    await cache.wait_ranks()
            async with asyncio.timeout(BOUND_S):
                await bounded_load(BOUND_S)
            await _check(ranks, tokens, target)
        # The close with a stopped rank owing a report: a caller's bound ends the caller's wait,
        # not the close, and the pool outlives it (the rank may still copy); once the rank is
        # killed the close ends and the segment is gone.
        pid = ranks.ranks[0].proc.pid
        assert pid is not None
        async with asyncio.timeout(START_S):
            await cache.wait_ranks()
        await stop_process(pid)
        load = asyncio.create_task(bounded_load(BOUND_S))
        done, _ = await asyncio.wait({load}, timeout=STALLED_S)
        assert not done, ended(load)  # it ended once (result not kept then): a link down would explain it
        segment = cache.pool.name.lstrip("/")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(STALLED_S):
                await cache.aclose()
        assert segment in os.listdir(SHM_DIR), "the pool was freed while a stopped rank could still copy"
        assert not load.done()
        ranks.kill(0)
        async with asyncio.timeout(BOUND_S):
            await cache.aclose()
            await asyncio.wait({load})
        assert segment not in os.listdir(SHM_DIR)
        assert load.exception() is None  # the load ended as a (counted) miss, not an error
        await ranks.stop_all()
