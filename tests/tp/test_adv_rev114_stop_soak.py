"""Review 114: the TP soak's engine requests (match, plain/from/streamed/layered loads, prefill,
offload, prefetch; a third cancelled at a random moment; slots reused LIFO) while a stopper
SIGSTOPs a random rank process with transfers in flight, holds it 50-400 ms, then SIGCONTs it.

A stopped rank is alive: its copies may still land, so every call, cancelled or bounded, must
wait for it, and none may ever be served another prompt's bytes (each token's KV is a hash of its
whole prefix and salt: adv_helpers). Checked: no wrong byte on any rank, the manager's loop keeps
answering while a rank is stopped, no rank is dropped for being slow, and afterwards nothing is
referenced, reserved or in flight and every document loads bit-exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from adv_helpers import CALL_S, START_S, AdvRanks, Soak, stop_process
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout
from aiokv.tp import TPCache

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
NUM_SLOTS = 512
STOPS = 5
SEED = int(os.environ.get("AIOKV_ADV_SEED", "114"))


class StopSoak(Soak):
    """The soak's clients against a stopper instead of a killer."""

    async def stop_run(self, clients: int, stops: int) -> int:
        """Returns how many stops met a transfer in flight."""
        tasks = [asyncio.create_task(self._client(self.seed * 1000 + i)) for i in range(clients)]
        rng, cache, busy = random.Random(self.seed), self.cache, 0
        try:
            for _ in range(stops):
                await asyncio.sleep(rng.uniform(0.05, 0.3))
                for _ in range(400):  # a moment with transfers in flight (bounded: 2 s)
                    if cache.group_statistics().jobs.in_flight:
                        busy += 1
                        break
                    await asyncio.sleep(0.005)
                pid = self.ranks.ranks[rng.randrange(self.ranks.tp_size)].proc.pid
                assert pid is not None
                await stop_process(pid)
                try:
                    await asyncio.sleep(rng.uniform(0.05, 0.4))
                    async with asyncio.timeout(2):  # the manager's loop still serves (a prompt
                        # nobody stores: a match waits for pages a stopped rank is storing)
                        match = await cache.match(list(range(90_000, 90_000 + 8 * self.t)))
                    assert match.tokens == 0
                    match.release()
                finally:
                    os.kill(pid, signal.SIGCONT)
        finally:
            self.stop.set()
            async with asyncio.timeout(CALL_S):  # every request ends: no hang
                await asyncio.gather(*tasks)
        return busy


@pytest.mark.slow
@pytest.mark.asyncio
async def test_stopped_ranks_never_let_a_call_return_under_their_copies(tmp_path: Path,
                                                                        ranks_left: list[AdvRanks]) -> None:
    config = CacheConfig(cpu_bytes=40 * LAYOUT.page_bytes, namespace="tp-adv-114-stop",
                         pool_chunk_bytes=8 * LAYOUT.page_bytes, launch_pages=1, launch_turn_s=0,
                         offload_wait=0.5, disk=None)
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        # Copies of up to 20 ms on the ranks' copy threads: a stop lands inside one often.
        ranks = AdvRanks(cache.address, LAYOUT, 2, NUM_SLOTS, dataclasses.replace(CONFIG, inline_copy_bytes=0),
                         slow_s=0.02)
        ranks_left.append(ranks)
        ranks.start_all()
        async with asyncio.timeout(START_S):
            await cache.wait_ranks()
        run = StopSoak(cache, ranks, SEED)
        busy = await run.stop_run(8, STOPS)
        await run.verify_docs()
        tally = run.tally
        assert not tally.wrong, "\n".join(tally.wrong[:20])
        group = cache.group_statistics()
        assert group.disconnects == 0 and group.fenced == 0, group  # slow is not dead
        assert busy >= 1 and tally.verified_tokens > 60 and tally.cancelled > 3, (busy, tally)
        stats = cache.stats()
        assert stats.pool_reserved == 0 and stats.pool_referenced == 0, stats
        assert group.jobs.in_flight == 0 and group.waiting == 0, group
        cache.pool.table.check_invariants()
        await ranks.stop_all()
