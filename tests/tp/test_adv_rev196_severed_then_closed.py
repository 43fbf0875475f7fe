"""Review 196: a rank whose connection was cut under a running copy, then whose engine closes its worker.

A connection that ends without CLOSED under a live process is held by the manager (its copies may
still run) until that process exits or says hello again; the worker says hello again once its copies
are over, when it reconnects. A worker closed by its engine meanwhile never reconnected: the rank was
held until its process exited (never, for a long-lived engine), and the job waited with it, and the
group's close. Now a closing worker whose last session ended without its CLOSED says hello once more
after its copies are over, and the manager frees the rank (the job fails RANK_LOST: never reported).

Real rank processes (``closing_rank``), rank 1's copy held in its mover, its socket shut down for
real (``pidfd_getfd`` + ``shutdown``); both runners.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from adv_helpers import sever_socket
from closing_rank import ClosingRanks
from loop_probes import until_thread
from tp_helpers import CONFIG, new_pool

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankStatus

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
BOUND_S = 60.0
NOTICE_S = 10.0
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)  # async runner: copies on its copy thread


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(MHA.for_tp(2), 8)
    yield pool
    await pool.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", [0, 1], ids=["thread-runner", "async-runner"])
async def test_a_held_rank_whose_engine_closes_its_worker_is_freed(
        tmp_path: Path, pool: PagePool, subject: int) -> None:
    async with RankGroup(MHA, 2, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
        ranks = ClosingRanks(group.address, MHA, 2, seed=9, held=frozenset({subject}), config=RANK_CONFIG)
        held = ranks.held[subject]
        try:
            ranks.start_all()
            async with asyncio.timeout(BOUND_S * 2):
                await group.wait_attached()
            job = group.submit_nowait(group.spec(Direction.OFFLOAD, [0], torch.arange(T)))
            assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "the copy never began"
            pid = ranks.procs[subject].pid
            assert pid is not None
            try:
                assert sever_socket(pid, os.fspath(group.address)) == 1
            except PermissionError as exc:
                pytest.skip(f"cannot take the rank's socket: {exc}")
            await until_thread(lambda: group.statistics().held_ranks == 1, "the rank held", BOUND_S)
            ranks.send(subject, "close")  # its engine closes the worker while the copy runs
            if subject % 2:
                async with asyncio.timeout(BOUND_S):
                    assert await ranks.reply(subject) == ("closing", None)
            assert not job.done()  # held: the copy still runs
            held.release()
            async with asyncio.timeout(BOUND_S):
                assert await ranks.reply(subject) == ("closed", None)
            done, _ = await asyncio.wait({asyncio.ensure_future(job.wait())}, timeout=NOTICE_S)
            assert done, f"the job still waits {NOTICE_S} s after the worker closed ({group.statistics()})"
            outcome = done.pop().result()
            assert held.finished_copies() == 1
            assert [(f.rank, f.status) for f in outcome.failures] == [(subject, RankStatus.RANK_LOST)], outcome
            stats = group.statistics()
            assert stats.held_ranks == 0 and stats.jobs.in_flight == 0, stats
            assert subject not in group.attached and ranks.procs[subject].is_alive()
        finally:
            held.release(8)
            await ranks.kill_all()
