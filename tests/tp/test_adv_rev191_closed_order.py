"""Review 191 of CLOSED (protocol 9, 5b9f208): specs whose job ids do not follow the order they were sent in.

A worker ending its session says CLOSED after the report of every spec it took; the manager fails at
once what the rank still owes. The first version told "never taken" by the job id (the owed ids
above the last id the worker took), assuming specs reach each link in job-id order. They need not:
``RankGroup.spec`` numbers a spec when it is built and an engine may submit built specs in any order
(a batch submitted by priority, a spec held while a later one went), and ``submit_*`` takes a
``TransferSpec.build`` of any id. A lower-numbered spec sent after the worker stopped taking made
the manager take it for a spec the worker took and never reported: the CLOSED was ignored and the
rank held through its pidfd until its process exited (the call hung for good in a long-lived engine
process), what the frame was made to end.

Real rank processes with real workers; rank 1's copies are held inside its mover, and its engine
closes its worker (``closing_rank``) while the test sends it specs.
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
from tp_helpers import CONFIG, new_pool

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import Direction, Job, RankGroup, RankStatus

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


async def _ended(job: Job, within_s: float, what: str) -> Any:
    done, _ = await asyncio.wait({asyncio.ensure_future(job.wait())}, timeout=within_s)
    assert done, f"{what} still waits after {within_s} s"
    return done.pop().result()


@pytest.mark.asyncio
async def test_a_lower_numbered_spec_sent_after_the_close_fails_at_once(tmp_path: Path, pool: PagePool) -> None:
    ranks: ClosingRanks | None = None
    jobs: list[Job] = []
    async with RankGroup(MHA, 2, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
        ranks = ClosingRanks(group.address, MHA, 2, seed=3, held=frozenset({1}), config=RANK_CONFIG)
        held = ranks.held[1]
        try:
            ranks.start_all()
            async with asyncio.timeout(BOUND_S):
                await group.wait_attached()
            early = group.spec(Direction.OFFLOAD, [0], torch.arange(T))  # numbered first, sent last
            late = group.spec(Direction.OFFLOAD, [1], torch.arange(T, 2 * T))
            assert early.job_id < late.job_id
            jobs.append(group.submit_nowait(late))
            assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "rank 1's copy never began"
            ranks.send(1, "close")  # its engine closes the worker while that copy runs
            async with asyncio.timeout(BOUND_S):
                assert await ranks.reply(1) == ("closing", None)  # it takes no spec from now on
            jobs.append(group.submit_nowait(early))  # reaches rank 1 after it stopped taking
            await until_thread(lambda: group.jobs.pending_ranks(early.job_id) == {1}, "rank 0's report", BOUND_S)
            held.release()  # the copy that ran ends: reported, then CLOSED
            assert (await _ended(jobs[0], BOUND_S, "the spec rank 1 took")).ok
            outcome = await _ended(jobs[1], NOTICE_S, "the spec rank 1 never took")  # before: till the exit
            assert [(f.rank, f.status) for f in outcome.failures] == [(1, RankStatus.WORKER_CLOSING)], outcome
            async with asyncio.timeout(BOUND_S):
                assert await ranks.reply(1) == ("closed", None)
            stats = group.statistics()
            assert stats.worker_closes == 1 and stats.held_ranks == 0 and stats.jobs.in_flight == 0, stats
            assert 1 not in group.attached and ranks.procs[1].is_alive()
        finally:
            held.release(8)
            await ranks.kill_all()
            if jobs:
                await asyncio.wait([asyncio.ensure_future(j.wait()) for j in jobs], timeout=BOUND_S)
