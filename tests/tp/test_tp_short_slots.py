"""A rank whose KV buffer has fewer token slots than the cache addresses is refused at attach.

It attached: the manager's specs name any slot below ``TPCache(num_slots=...)``, so every copy
touching the slots it lacks failed on that rank (BAD_SPEC) and each such load was a miss, each
offload dropped, quietly, for as long as it ran. Now the WELCOME carries the manager's slot count
(protocol 6) and such a worker refuses the pool before mapping it: it stops with
``WorkerRefusedError`` (reason ``SLOTS``, naming both counts), the manager logs that reason and
counts it in ``attach_failures``, and the other ranks (and a proper replacement) serve as before.
"""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

import pytest
import torch
from child_procs import fork_context
from short_rank import refused_rank_main
from tp_helpers import CONFIG, SLOTS, RankProcesses, full_kv, new_pool, rank_kv

from aiokv import CacheConfig, KVLayout
from aiokv.tp import RankGroup, RankWorker, TPCache, WorkerRefusedError
from aiokv.tp.wire import RefuseReason, Welcome

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
START_S = 120.0
"""Bound on spawning rank processes and their first attach (torch import on a loaded machine)."""
BOUND_S = 30.0


async def _turns_until(condition: object, what: str) -> None:
    """Until ``condition()``: state this loop changes within a few turns (no time-based wait)."""
    assert callable(condition)
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    pytest.fail(f"not within 10000 loop turns: {what}")


def _kv(rank: int, slots: int) -> torch.Tensor:
    return rank_kv(full_kv(LAYOUT, 1, slots), LAYOUT, rank, 2)


@pytest.mark.asyncio
async def test_a_worker_with_fewer_slots_refuses_the_pool_and_others_attach(tmp_path: Path) -> None:
    pool = await new_pool(LAYOUT.for_tp(2), 4)
    try:
        async with RankGroup(LAYOUT, 2, pool.name, pool.num_pages, CONFIG, tmp_path / "m", num_slots=SLOTS) as group:
            short = RankWorker(group.address, 0, 2, LAYOUT, _kv(0, SLOTS - 1), CONFIG)
            with pytest.raises(WorkerRefusedError, match=f"{SLOTS - 1} token slots, fewer than the {SLOTS}") as info:
                async with asyncio.timeout(BOUND_S):
                    await short.run()
            assert info.value.reason is RefuseReason.SLOTS
            assert short.statistics().sessions == 0, "it attached"
            await _turns_until(lambda: group.statistics().attach_failures == 1, "the manager told why")
            assert group.attached == frozenset()
            # Exactly as many slots, or more, attach; the refused rank is free again.
            async with RankWorker(group.address, 0, 2, LAYOUT, _kv(0, SLOTS), CONFIG) as rank0, \
                    RankWorker(group.address, 1, 2, LAYOUT, _kv(1, SLOTS + 8), CONFIG) as rank1:
                async with asyncio.timeout(BOUND_S):
                    await rank0.wait_attached()
                    await rank1.wait_attached()
                    await group.wait_attached()
            stats = group.statistics()
            assert (stats.attach_failures, stats.refused) == (1, 0)
    finally:
        await pool.aclose()


def test_the_refusal_crosses_processes_and_the_welcome_carries_the_slots() -> None:
    error = pickle.loads(pickle.dumps(WorkerRefusedError(RefuseReason.SLOTS, "too few")))
    assert isinstance(error, WorkerRefusedError) and error.reason is RefuseReason.SLOTS and error.text == "too few"
    welcome = Welcome(6, 2, b"f" * 16, 7, 10, 4096, "/aiokv-1-abc", SLOTS)
    assert Welcome.decode(welcome.encode()) == welcome
    with pytest.raises(ValueError, match="num_slots"):
        RankGroup(LAYOUT, 2, "/aiokv-x", 4, num_slots=0)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_rank_process_with_fewer_slots_is_refused_and_the_group_serves_without_it(tmp_path: Path) -> None:
    config = CacheConfig(cpu_bytes=16 * LAYOUT.page_bytes, namespace="tp-short", pool_chunk_bytes=4 * LAYOUT.page_bytes)
    n = 4 * T
    tokens = list(range(7000, 7000 + n))
    source = torch.arange(SLOTS - n, SLOTS)  # the last slots: the ones the short buffer lacks
    target = torch.arange(n)
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        ctx = fork_context()
        parent, child = ctx.Pipe(duplex=False)
        short = ctx.Process(target=refused_rank_main, args=(child, cache.address, 0, 2, LAYOUT, SLOTS // 2, CONFIG),
                            daemon=True)
        short.start()
        child.close()
        ranks = RankProcesses(Path(cache.address), LAYOUT, 2, seed=5, fill=True)
        try:
            ranks.start(1)
            async with asyncio.timeout(START_S):
                kind, error = await asyncio.to_thread(parent.recv)
            assert kind == "refused", error
            assert isinstance(error, WorkerRefusedError) and error.reason is RefuseReason.SLOTS
            assert f"{SLOTS // 2} token slots, fewer than the {SLOTS}" in str(error)
            await asyncio.to_thread(short.join, BOUND_S)
            assert short.exitcode == 0
            stats = cache.group_statistics()
            assert stats.attach_failures == 1 and 0 not in stats.attached
            # The manager and rank 1 are unaffected: a proper rank 0 attaches and the group serves.
            ranks.start(0)
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()
            result = await cache.offload(tokens, source)
            assert (result.stored, result.dropped) == (n // T, 0)
            match = await cache.match(tokens)
            loaded = await cache.load(match, target)
            assert loaded.tokens == n
            full = full_kv(LAYOUT, 5)
            for rank in range(2):
                got = await ranks.dump(rank)
                assert torch.equal(got[:, target], rank_kv(full, LAYOUT, rank, 2)[:, source]), f"rank {rank}"
            await cache.flush()
            await ranks.stop_all()
        finally:
            parent.close()
            if short.is_alive():
                short.kill()
            await asyncio.to_thread(short.join, BOUND_S)
            await ranks.kill_all()
