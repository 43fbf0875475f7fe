"""A rank attached again to the same pool: its engine's layer waits for jobs issued before its new
session end at once (False) instead of waiting for a spec that never comes.

Review 177 (chaos seed 631, ``--faults 6``): rank 1's socket was shut down by a third party right
after a layered load's jobs were admitted; the live worker began a new session of the same pool
(same epoch), whose layer table knew no job. The engine's ``wait_layer`` for those jobs made
placeholders that only a later spec could end (specs arrive in job-id order); none came, and the
engine (which sends nothing more until its step ends) waited for good. Now the manager's WELCOME
carries the session's first job id (protocol 8): waits for earlier ids end at once.

Real rank processes (both runners), the socket shut down for real (``pidfd_getfd`` + ``shutdown``).
The job's id is taken (``RankGroup.spec``) while the rank is attached and never sent: the spec the
old session missed."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from adv_helpers import sever_socket
from test_tp_submit_room import LAYOUT, START_S, T, _cache, _tokens
from tp_helpers import RankProcesses

from aiokv.tp import Direction, LayeredLoad

REPLY_S = 20.0
"""The engine's wait, bounded here (the rank's own bound is 120 s: before the fix it took all of it)."""


@pytest.mark.asyncio
@pytest.mark.parametrize("severed", [0, 1], ids=["thread-runner", "async-worker"])
async def test_waits_for_jobs_issued_before_a_new_session_end_at_once(tmp_path: Path, severed: int) -> None:
    layers = LAYOUT.num_layers
    tokens = _tokens(32000, 2)
    slots = torch.arange(40, 40 + 2 * T)
    async with _cache(tmp_path) as cache:
        ranks = RankProcesses(Path(cache.address), LAYOUT, 2, seed=47, fill=True)
        ranks.start_all()
        try:
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()
            assert (await cache.offload(tokens, torch.arange(2 * T))).stored == 2
            group = cache.group
            before = group.sessions()[severed]
            missed = group.spec(Direction.LOAD, [0], torch.arange(T), layered=True)  # issued, never sent
            pid = ranks.procs[severed].pid
            assert pid is not None
            try:
                assert sever_socket(pid, os.fspath(cache.address)) == 1
            except PermissionError as exc:
                pytest.skip(f"cannot take the rank's socket: {exc}")
            async with asyncio.timeout(START_S):
                while group.sessions()[severed] in (0, before):
                    await group.wait_change()
            ranks.send(severed, ("layers", LayeredLoad(group.epoch, (missed.job_id,)), slots))
            async with asyncio.timeout(REPLY_S):
                answers = await ranks.reply(severed)
            assert [ok for ok, _ in answers] == [False] * layers, answers
            # The new session's own layered loads still land and say so.
            stream = cache.start_load(await cache.match(tokens), slots, layered=True)
            await stream.launched()
            load = stream.layered_load()
            assert load.jobs and min(load.jobs) > missed.job_id and not load.unsent
            ranks.send(severed, ("layers", load, slots))
            assert (await stream.finish()).tokens == 2 * T
            async with asyncio.timeout(REPLY_S):
                answers = await ranks.reply(severed)
            assert [ok for ok, _ in answers] == [True] * layers, answers
        finally:
            await ranks.kill_all()
