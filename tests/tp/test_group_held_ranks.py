"""``GroupStatistics.held_ranks``: ranks held now for a process that may still run copies.

A live rank's connection cut by a third party while it copies is held (its jobs in flight, its
number taken) until its process says hello again or exits (review 177); the statistic counts such
ranks, and a rank that ended its session itself (a CLOSED frame) is never one of them.

Real rank processes with real workers; rank 1's copy is held inside its mover (``held_rank``) and
its socket is shut down for real (``pidfd_getfd`` + ``shutdown``), as in
``test_adv_rev177_severed_socket.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from adv_helpers import sever_socket
from held_rank import HeldRanks
from tp_helpers import CONFIG, SLOTS

from aiokv import CacheConfig, KVLayout
from aiokv.tp import TPCache

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
BOUND_S = 60.0
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)


@pytest.mark.asyncio
async def test_a_severed_live_rank_counts_as_held_until_its_copy_is_over(tmp_path: Path) -> None:
    config = CacheConfig(cpu_bytes=16 * MHA.page_bytes, disk=None, namespace="tp-held-ranks",
                         pool_chunk_bytes=4 * MHA.page_bytes)
    cache = TPCache(config, MHA, tp_size=2, num_slots=SLOTS, tp_config=CONFIG, directory=tmp_path / "sock")
    await cache.start()
    ranks = HeldRanks(Path(cache.address), MHA, 2, seed=7, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    call: asyncio.Task[Any] | None = None
    try:
        ranks.start_all()
        async with asyncio.timeout(BOUND_S):
            await cache.wait_ranks()
        assert cache.group.statistics().held_ranks == 0
        call = asyncio.create_task(cache.offload(list(range(3000, 3000 + T)), torch.arange(T)))
        assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "rank 1's copy never began"
        pid = ranks.procs[1].pid
        assert pid is not None
        try:
            shut = sever_socket(pid, os.fspath(cache.address))
        except PermissionError as exc:
            pytest.skip(f"cannot take the rank's socket: {exc}")
        assert shut == 1
        async with asyncio.timeout(BOUND_S):
            while 1 in cache.group.attached:
                await cache.group.wait_change()
        stats = cache.group.statistics()
        assert stats.held_ranks == 1 and stats.jobs.in_flight == 1, stats  # its copy may still run
        held.release()  # the copy ends; the worker drains and says hello again from the same process
        async with asyncio.timeout(BOUND_S):
            assert (await call).stored == 0  # rank 1 never reported over the cut connection
            await cache.wait_ranks()
        stats = cache.group.statistics()
        assert stats.held_ranks == 0 and stats.jobs.in_flight == 0 and stats.attached == {0, 1}, stats
    finally:
        held.release(8)  # never leave a rank held when the test fails
        await ranks.kill_all()
        if call is not None:
            await asyncio.wait({call}, timeout=BOUND_S)
        async with asyncio.timeout(BOUND_S):
            await cache.aclose()
