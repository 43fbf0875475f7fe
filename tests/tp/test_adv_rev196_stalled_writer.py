"""Review 196, item (b): a manager whose loop stalls past the worker's ``handshake_timeout_s`` and
writes a spec before it reads the worker's CLOSED.

A worker closed by its engine says CLOSED and waits ``handshake_timeout_s`` at most for the manager
to end the link, then closes its socket. A manager loop blocked meanwhile (a synchronous call on the
loop) that, once free, sends a spec before the loop polls its sockets gets EPIPE: asyncio ended the
connection with the write error and never read the CLOSED waiting in the socket. The rank was held
through its pidfd (its process lives on, its engine closed the worker for good): the job waited
until that process exited, and the group's close with it. The manager now reads what the peer wrote
before such an end: the CLOSED frees the rank, and what it never took fails at once.

Real rank processes (``closing_rank``); the manager is the test's loop, blocked for real on the rank's
control pipe until its close ended.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from closing_rank import ClosingRanks
from tp_helpers import CONFIG, new_pool

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankStatus

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
BOUND_S = 60.0
NOTICE_S = 10.0
WAIT_S = 1.0
"""The ranks' ``handshake_timeout_s``: how long a closed worker waits for the manager's end."""
RANK_CONFIG = dataclasses.replace(CONFIG, handshake_timeout_s=WAIT_S)


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(MHA.for_tp(2), 8)
    yield pool
    await pool.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("closer", [0, 1], ids=["thread-runner", "async-runner"])
async def test_a_spec_written_before_the_closed_is_read_fails_at_once(
        tmp_path: Path, pool: PagePool, closer: int) -> None:
    ranks: ClosingRanks | None = None
    async with RankGroup(MHA, 2, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
        ranks = ClosingRanks(group.address, MHA, 2, seed=5, held=frozenset(), config=RANK_CONFIG)
        try:
            ranks.start_all()
            async with asyncio.timeout(BOUND_S * 2):
                await group.wait_attached()
                assert (await group.submit_nowait(group.spec(Direction.OFFLOAD, [0], torch.arange(T)))).ok
            ctrl = ranks.ctrl[closer]
            ctrl.send("close")
            # The manager's loop blocks here (no poll of its sockets) until the worker's close ended:
            # the worker waited WAIT_S for an end that could not come, then closed its socket.
            replies = []
            while not replies or replies[-1][0] != "closed":
                assert ctrl.poll(BOUND_S), f"rank {closer}'s close did not end: {replies}"
                reply = ctrl.recv()
                if reply[0] != "started":
                    replies.append(reply)
            assert replies[-1] == ("closed", None), replies
            job = group.submit_nowait(group.spec(Direction.OFFLOAD, [1], torch.arange(T, 2 * T)))  # before any read
            done, _ = await asyncio.wait({asyncio.ensure_future(job.wait())}, timeout=NOTICE_S)
            assert done, f"the job still waits after {NOTICE_S} s: the rank is held ({group.statistics()})"
            outcome = done.pop().result()
            assert [(f.rank, f.status) for f in outcome.failures] == [(closer, RankStatus.WORKER_CLOSING)], outcome
            stats = group.statistics()
            assert stats.worker_closes == 1 and stats.held_ranks == 0 and stats.jobs.in_flight == 0, stats
            assert closer not in group.attached and ranks.procs[closer].is_alive()
        finally:
            await ranks.kill_all()
