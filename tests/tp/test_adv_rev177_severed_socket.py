"""A live rank's connection shut down by a third party while it copies: no call returns under the copy.

Regression (review 177): the manager took the end of a rank's connection to mean none of its copies
runs any more (true for a worker, which closes only once they are over, and for a dead process).
A third party that shuts the socket down (``ss -K``, a tool holding a copy of the descriptor) ends
it under a live worker: the group failed the rank's jobs at once, ``load`` returned (shortened) in
under a millisecond, the engine reused the slots, and the rank's copy, still running, landed in
them afterwards (an offload's pages were aborted and reused under its gather the same way).

Now such a rank is held (not attached, its number taken, its jobs in flight) until its process
exits or says hello again: its worker drains its copies before it begins a new session.

The ranks are real spawned processes with real workers; rank 1's copy is held inside its mover
(``held_rank``) and its socket is shut down for real (``pidfd_getfd`` + ``shutdown``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from adv_helpers import sever_socket
from held_rank import HeldRanks
from tp_helpers import CONFIG, SLOTS

from aiokv import CacheConfig, KVLayout
from aiokv.tp import RankStatus, TPCache

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
BOUND_S = 60.0
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)


async def _acquire(semaphore: Any) -> None:
    assert await asyncio.to_thread(semaphore.acquire, True, BOUND_S), "the rank's copy never began"


@pytest.mark.asyncio
@pytest.mark.parametrize("then", ["reattaches", "exits"])
@pytest.mark.parametrize("direction", ["load", "offload"])
async def test_a_severed_rank_holds_its_jobs_until_its_copies_are_over(tmp_path: Path, direction: str,
                                                                       then: str) -> None:
    config = CacheConfig(cpu_bytes=16 * MHA.page_bytes, disk=None, namespace="tp-sever",
                         pool_chunk_bytes=4 * MHA.page_bytes)
    cache = TPCache(config, MHA, tp_size=2, num_slots=SLOTS, tp_config=CONFIG, directory=tmp_path / "sock")
    await cache.start()
    ranks = HeldRanks(Path(cache.address), MHA, 2, seed=5, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    try:
        ranks.start_all()
        await cache.wait_ranks()
        tokens = list(range(3000, 3000 + T))
        source, target = torch.arange(T), torch.arange(40, 40 + T)
        if direction == "load":
            held.release()  # the offload that fills the pool runs freely
            assert (await cache.offload(tokens, source)).stored == 1
            await _acquire(held.entered)
            call: asyncio.Task[Any] = asyncio.create_task(cache.load(await cache.match(tokens), target))
        else:
            call = asyncio.create_task(cache.offload(tokens, source))
        await _acquire(held.entered)  # rank 1's copy has begun and waits on the gate
        copies_before = held.finished_copies()
        finished_at: list[int] = []
        call.add_done_callback(lambda _: finished_at.append(held.finished_copies()))
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
        # Old code: the job was failed in the callback that saw the connection end (RANK_LOST).
        assert cache.group.jobs.in_flight == 1, "rank 1's job ended while its copy was still running"
        assert not call.done()
        assert cache.group.sessions()[1] == 0  # not attached: nothing new is sent to it
        if then == "exits":
            os.kill(pid, signal.SIGKILL)  # its copy dies with it
        else:
            held.release()  # the copy ends; the worker drains, closes and begins a new session
        async with asyncio.timeout(BOUND_S):
            await asyncio.wait({call})
        if then == "reattaches":
            assert finished_at == [copies_before + 1], "the call ended before rank 1's copy did"
        result = call.result()
        assert (result.tokens if direction == "load" else result.stored) == 0  # rank 1 never reported
        jobs = cache.group.statistics().jobs
        assert jobs.in_flight == 0 and jobs.rank_failures.get(RankStatus.RANK_LOST) == 1, jobs
        if then == "reattaches":
            async with asyncio.timeout(BOUND_S):
                await cache.wait_ranks()  # the same process attached again
            assert cache.group.statistics().attached == {0, 1}
    finally:
        held.release(8)  # never leave a rank held when the test fails
        async with asyncio.timeout(BOUND_S):
            await cache.aclose()
        await ranks.kill_all()
