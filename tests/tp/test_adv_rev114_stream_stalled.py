"""Review 114: a rank process stopped (SIGSTOP) under a compute-or-load stream of a TP group.

A stopped rank may write the stream's slots once it runs again, so no way out of the stream may
return while it is stopped: not ``finish`` under the caller's ``asyncio.timeout``, not the
``async with`` exit of an engine that gave up (its exception), not ``wait_layer`` of a layered
stream. Each is watched not returning; then the stopped rank is SIGKILLed (the stream ends within a
bound, nothing referenced, reserved or in flight, the kill counted) or continued (the stream ends,
its slots bit-exact by the prefix oracle). A restarted rank then loads every token bit-exact.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
from adv_helpers import START_S, AdvRanks, attach_ranks, idx, rank_prefix_kv, stop_process
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout
from aiokv.tp import TPCache
from aiokv.tp.stream import TPLoadStream

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
NUM_SLOTS = 128
PAGES = 6
BOUND_S = 20.0
STALLED_S = 0.4


class EngineGaveUp(Exception):
    """Raised inside ``async with stream`` (the engine's step failed)."""


async def _finish_bounded(stream: TPLoadStream) -> object:
    await stream.launched()  # the copies are on their way to the ranks
    async with asyncio.timeout(0.05):
        return await stream.finish()


async def _exit_by_exception(stream: TPLoadStream) -> object:
    try:
        async with stream:
            await stream.launched()
            raise EngineGaveUp
    except EngineGaveUp:
        return "exited"


async def _wait_last_layer(stream: TPLoadStream) -> object:
    await stream.launched()
    landed = await stream.wait_layer(LAYOUT.num_layers - 1)
    result = await stream.finish()
    return landed, result


WAYS: dict[str, tuple[bool, Callable[[TPLoadStream], Awaitable[object]]]] = {
    "finish-timeout": (False, _finish_bounded),
    "layered-finish-timeout": (True, _finish_bounded),
    "exit-by-exception": (False, _exit_by_exception),
    "layered-wait-layer": (True, _wait_last_layer),
}


async def _leave_while_stopped(cache: TPCache, ranks: AdvRanks, way: str, layered: bool,
                               leave: Callable[[TPLoadStream], Awaitable[object]], tokens: list[int],
                               target: list[int], victim: int, ending: signal.Signals, pid: int) -> None:
    """With rank ``victim`` stopped: a stream left ``way`` must not return; then ``ending`` it."""
    match = await cache.match(tokens)
    assert match.tokens == PAGES * T
    stream = cache.start_load(match, idx(target), layered=layered)
    left = asyncio.create_task(leave(stream))
    done, _ = await asyncio.wait({left}, timeout=STALLED_S)
    assert not done, f"{way}: left the stream while rank {victim} was stopped: " \
                     f"{left.exception() or left.result()!r}; {cache.group_statistics()}"
    async with asyncio.timeout(5):
        other = await cache.match(tokens)  # the loop still serves
    other.release()
    if ending is signal.SIGKILL:
        ranks.kill(victim)
    else:
        os.kill(pid, signal.SIGCONT)
    async with asyncio.timeout(BOUND_S):
        await asyncio.wait({left})
    if way.endswith("finish-timeout"):  # the caller's bound expired while the rank was stopped
        assert isinstance(left.exception(), TimeoutError), left
    elif way == "exit-by-exception":
        assert left.result() == "exited"
    else:  # wait_layer: the killed rank never copied a byte of it, a continued one all of them
        landed, result = left.result()
        whole = ending is signal.SIGCONT
        assert landed is whole and result.loaded_tokens == (PAGES * T if whole else 0), (landed, result)

@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("way", list(WAYS))
async def test_no_way_out_of_a_stream_returns_while_a_rank_is_stopped(tmp_path: Path, way: str,
                                                                      ranks_left: list[AdvRanks]) -> None:
    layered, leave = WAYS[way]
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="tp-adv-114",
                         pool_chunk_bytes=8 * LAYOUT.page_bytes)
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        ranks = await attach_ranks(cache, ranks_left, LAYOUT, NUM_SLOTS)
        tokens = list(range(2000, 2000 + PAGES * T))
        source = list(range(PAGES * T))
        for rank in range(2):
            await ranks.write(rank, source, rank_prefix_kv(LAYOUT, tokens, 0, rank, 2))
        stored = await cache.offload(tokens, idx(source))
        assert stored.stored == PAGES, stored
        target = list(range(NUM_SLOTS - PAGES * T, NUM_SLOTS))

        async def check() -> None:
            for rank in range(2):
                got = await ranks.read(rank, target)
                assert torch.equal(got, rank_prefix_kv(LAYOUT, tokens, 0, rank, 2)), f"rank {rank}: wrong KV"

        for victim, ending in ((1, signal.SIGKILL), (0, signal.SIGCONT)):
            for rank in range(2):  # the slots zeroed: a late copy shows
                await ranks.write(rank, target, torch.zeros_like(rank_prefix_kv(LAYOUT, tokens, 0, rank, 2)))
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()
            pid = ranks.ranks[victim].proc.pid
            assert pid is not None
            await stop_process(pid)
            try:
                await _leave_while_stopped(cache, ranks, way, layered, leave, tokens, target, victim, ending, pid)
            except BaseException:
                os.kill(pid, signal.SIGCONT)  # else the close waits for the stopped rank for good (by design)
                raise
            if way == "layered-wait-layer" and ending is signal.SIGCONT:
                await check()
            stats = cache.stats()
            assert stats.pool_reserved == 0 and stats.pool_referenced == 0, stats
            assert cache.group_statistics().jobs.in_flight == 0, cache.group_statistics()
            if ending is signal.SIGKILL:
                await ranks.reap_dead()
                ranks.start(victim)
                async with asyncio.timeout(START_S):
                    await cache.wait_ranks()
        async with asyncio.timeout(BOUND_S):
            match = await cache.match(tokens)
            result = await cache.load(match, idx(target))
        assert result.tokens == PAGES * T
        await check()
        cache.pool.table.check_invariants()
        await ranks.stop_all()
