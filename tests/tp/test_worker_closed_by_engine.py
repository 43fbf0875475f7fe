"""A rank's engine closes its worker while its process lives on: what it never took fails at once.

Regression (this session): a worker closed by its own engine ended its connection without a word, so
the manager could not tell its end from a socket a third party cut under running copies (review
177): specs it wrote after the worker stopped reading were owed by the rank and held until the rank
process exited, which a long-lived engine process may never do. Now the worker's last frame
(CLOSED, protocol 9) follows the report of every copy it ran and names the last job it took; the
manager fails what it sent after that (WORKER_CLOSING) at once and frees the rank, holding nothing.

The window between the worker's close and the manager seeing the connection end is made as wide as
the test needs by copies of the worker's socket kept in the rank process (what a child the engine
forked without exec holds: multiprocessing 'fork' helpers, data loader workers). Before, while they
lived the manager saw no end at all and kept sending specs nobody read (the calls hung), and once
they closed it held the rank through its pidfd until the process exited.

The ranks are real processes with real workers; rank 1's copies are held inside its mover.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from closing_rank import ClosingRanks
from loop_probes import until_thread
from tp_helpers import CONFIG, SLOTS

from aiokv import CacheConfig, KVLayout
from aiokv.tp import RankStatus, TPCache

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
BOUND_S = 60.0
NOTICE_S = 10.0
"""Bound on the manager's noticing the close (before: never, while the socket's copies lived)."""
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)  # async runner: copies on its copy thread


@pytest_asyncio.fixture
async def cache(tmp_path: Path) -> AsyncIterator[TPCache]:
    config = CacheConfig(cpu_bytes=16 * MHA.page_bytes, disk=None, namespace="tp-worker-close",
                         pool_chunk_bytes=4 * MHA.page_bytes)
    cache = TPCache(config, MHA, tp_size=2, num_slots=SLOTS, tp_config=CONFIG, directory=tmp_path / "sock")
    await cache.start()
    yield cache
    async with asyncio.timeout(BOUND_S):
        await cache.aclose()


async def _started(cache: TPCache, ranks: ClosingRanks, keep_socket: int | None) -> None:
    ranks.start_all()
    async with asyncio.timeout(BOUND_S):
        await cache.wait_ranks()
        if keep_socket is not None:
            assert await ranks.ask(keep_socket, "keep socket") == 1


async def _detached(cache: TPCache, rank: int) -> None:
    async with asyncio.timeout(NOTICE_S):
        while rank in cache.group.attached:
            await cache.group.wait_change()


async def _ended(call: asyncio.Task[Any], within_s: float, what: str) -> Any:
    """``call``'s result once it ended within ``within_s`` seconds. Not cancelled when it did not: a
    cancelled call still waits for its ranks (the test's end, killing them, ends it)."""
    done, _ = await asyncio.wait({call}, timeout=within_s)
    assert done, f"{what} still waits after {within_s} s"
    return call.result()


async def _finish(calls: list[asyncio.Task[Any]]) -> None:
    """After the rank processes were killed: every call ends (a held rank's with its process)."""
    if calls:
        await asyncio.wait(calls, timeout=BOUND_S)


def _tokens(first: int) -> list[int]:
    return list(range(first, first + T))


@pytest.mark.asyncio
@pytest.mark.parametrize("socket_kept", [False, True], ids=["plain", "socket-kept"])
async def test_a_worker_closed_mid_copy_reports_it_then_fails_what_it_never_took(cache: TPCache,
                                                                                socket_kept: bool) -> None:
    ranks = ClosingRanks(Path(cache.address), MHA, 2, seed=5, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    calls: list[asyncio.Task[Any]] = []
    try:
        await _started(cache, ranks, 1 if socket_kept else None)
        first: asyncio.Task[Any] = asyncio.create_task(cache.offload(_tokens(3000), torch.arange(T)))
        calls.append(first)
        assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "rank 1's copy never began"
        ranks.send(1, "close")  # its engine closes the worker while that copy runs
        async with asyncio.timeout(BOUND_S):
            assert await ranks.reply(1) == ("closing", None)  # it takes no spec from now on
        second: asyncio.Task[Any] = asyncio.create_task(cache.offload(_tokens(4000), torch.arange(T, 2 * T)))
        calls.append(second)
        await until_thread(lambda: cache.group.jobs.statistics().submitted == 2, "the second offload sent", BOUND_S)
        held.release()  # the first copy ends: its report goes out before the worker's CLOSED
        assert (await _ended(first, BOUND_S, "the first offload")).stored == 1, "the copy that ran was not reported"
        assert (await _ended(second, BOUND_S, "the second offload")).stored == 0  # never run by rank 1
        async with asyncio.timeout(BOUND_S):
            assert await ranks.reply(1) == ("closed", None)
        assert ranks.procs[1].is_alive()
        await _detached(cache, 1)  # before, with the socket kept: attached for good
        stats = cache.group.statistics()
        assert stats.jobs.in_flight == 0 and stats.jobs.rank_failures == {RankStatus.WORKER_CLOSING: 1}, stats.jobs
        assert stats.worker_closes == 1 and stats.held_ranks == 0, stats
        third: asyncio.Task[Any] = asyncio.create_task(cache.offload(_tokens(5000), torch.arange(2 * T, 3 * T)))
        calls.append(third)
        await until_thread(lambda: cache.group.jobs.statistics().submitted == 3, "the third offload sent", BOUND_S)
        if socket_kept:
            assert await ranks.ask(1, "drop socket") == "dropped"
        assert (await _ended(third, NOTICE_S, "the third offload")).stored == 0  # before: held till rank 1 exited
        assert cache.group.jobs.in_flight == 0 and cache.group.statistics().held_ranks == 0
        assert ranks.procs[1].is_alive()
    finally:
        held.release(8)  # never leave a rank held when the test fails
        await ranks.kill_all()
        await _finish(calls)


@pytest.mark.asyncio
async def test_a_thread_runner_closed_with_its_socket_kept_is_let_go(cache: TPCache) -> None:
    ranks = ClosingRanks(Path(cache.address), MHA, 2, seed=6, held=frozenset(), config=RANK_CONFIG)
    calls: list[asyncio.Task[Any]] = []
    try:
        await _started(cache, ranks, 0)
        async with asyncio.timeout(BOUND_S):
            assert (await cache.offload(_tokens(3000), torch.arange(T))).stored == 1
            assert await ranks.ask(0, "close") == ("closed", None)
        # Its worker is closed; the process lives. Before, the kept socket hid the close: the spec
        # went to rank 0 and was never read, and once the copies closed the manager held the rank
        # (and the call) through its pidfd until the process exited.
        call: asyncio.Task[Any] = asyncio.create_task(cache.offload(_tokens(4000), torch.arange(T, 2 * T)))
        calls.append(call)
        await until_thread(lambda: cache.group.jobs.statistics().submitted == 2, "the second offload sent", BOUND_S)
        assert await ranks.ask(0, "drop socket") == "dropped"
        assert (await _ended(call, NOTICE_S, "the offload after the close")).stored == 0
        assert 0 not in cache.group.attached
        stats = cache.group.statistics()
        assert stats.worker_closes == 1 and stats.held_ranks == 0 and stats.jobs.in_flight == 0, stats
        assert ranks.procs[0].is_alive()
    finally:
        await ranks.kill_all()
        await _finish(calls)
