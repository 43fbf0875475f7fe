"""Review 117: a TP load whose disk pages a stopped rank's offload reserved after the match.

A prompt's pages are on disk only (written, then pushed out of the pool). A match finds them on
disk; then the same prompt is offloaded again while rank 1 is stopped (SIGSTOP): its pages are
RESERVED in the pool for as long as the rank is stopped. The load of the match promotes them, finds
the reservation and waits for that commit: at most ``commit_wait`` (4feb8de), then it ends short
(never wrong KV); once the rank goes on, the offload commits and the prompt loads bit-exact on
both ranks, nothing left referenced or reserved. Also checked: a match of the prompt taken while
the rank is stopped answers within the bound and serves nothing from the held pages on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from adv_helpers import AdvRanks, attach_ranks, idx, rank_prefix_kv, stop_process
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout
from aiokv.pagetable import PageState
from aiokv.storage import DiskConfig
from aiokv.tp import TPCache

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
NUM_SLOTS = 96
PAGES = 3
OTHER = 8
POOL = 8
WAIT_S = 0.5
BOUND_S = 4.0
"""A load or match must answer within this whatever the stopped rank does (commit_wait is WAIT_S)."""


def _config(disk: Path) -> CacheConfig:
    return CacheConfig(cpu_bytes=POOL * LAYOUT.page_bytes, namespace="tp-adv-117-load",
                       pool_chunk_bytes=POOL * LAYOUT.page_bytes, offload_wait=WAIT_S, commit_wait=WAIT_S,
                       disk=DiskConfig(directory=disk, capacity_bytes=64 * (LAYOUT.page_bytes + 4096)))


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_load_behind_a_stopped_ranks_offload_is_bounded_and_never_wrong(
        tmp_path: Path, ranks_left: list[AdvRanks]) -> None:
    async with TPCache(_config(tmp_path / "disk"), LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        ranks = await attach_ranks(cache, ranks_left, LAYOUT, NUM_SLOTS)
        await cache.pool.wait_ready()
        tokens = list(range(5000, 5000 + PAGES * T))
        source = list(range(PAGES * T))
        other = list(range(7000, 7000 + OTHER * T))
        other_slots = list(range(PAGES * T, (PAGES + OTHER) * T))
        for rank in range(2):
            await ranks.write(rank, source, rank_prefix_kv(LAYOUT, tokens, 0, rank, 2))
            await ranks.write(rank, other_slots, rank_prefix_kv(LAYOUT, other, 0, rank, 2))
        assert (await cache.offload(tokens, idx(source))).stored == PAGES
        await cache.flush()
        assert (await cache.offload(other, idx(other_slots))).stored == OTHER  # pushes tokens' pages out
        await cache.flush()
        keys = cache.keys(tokens)
        assert all(cache.pool.table.state_of(k) is PageState.FREE for k in keys), "still in the pool"
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES

        pid = ranks.ranks[1].proc.pid
        assert pid is not None
        await stop_process(pid)
        try:
            offload = asyncio.create_task(cache.offload(tokens, idx(source)))
            for _ in range(300):  # its pages reserved, their copies sent to the ranks
                if all(cache.pool.table.state_of(k) is PageState.RESERVED for k in keys):
                    break
                await asyncio.sleep(0.01)
            assert all(cache.pool.table.state_of(k) is PageState.RESERVED for k in keys), cache.stats()
            target = list(range(NUM_SLOTS - PAGES * T, NUM_SLOTS))
            started = time.monotonic()
            async with asyncio.timeout(BOUND_S):  # waited for the stopped rank without bound before 4feb8de
                loaded = await cache.load(match, idx(target))
            assert time.monotonic() - started < WAIT_S * (PAGES - 0.5)  # in all, not once per page
            assert loaded.tokens < PAGES * T
            async with asyncio.timeout(BOUND_S):
                again = await cache.match(tokens)
            assert (again.pool_pages, again.disk_pages) == (0, 0)  # nothing from the held pages on
            again.release()
            assert not offload.done(), "the offload returned while a rank could still read its slots"
        finally:
            os.kill(pid, signal.SIGCONT)
        assert (await offload).stored == PAGES
        match = await cache.match(tokens)
        assert match.pool_pages == PAGES
        loaded = await cache.load(match, idx(target))
        assert loaded.tokens == PAGES * T
        for rank in range(2):
            assert torch.equal(await ranks.read(rank, target), rank_prefix_kv(LAYOUT, tokens, 0, rank, 2))
        await cache.flush()
        stats = cache.stats()
        assert stats.pool_reserved == 0 and stats.pool_referenced == 0, stats
        await ranks.stop_all()
