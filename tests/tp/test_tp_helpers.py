"""The test rank processes of ``tp_helpers`` (real, spawned, CPU KV buffers): their control pipe.

An async rank (odd ranks: ``RankWorker`` on the process's own loop) answers the test on that same
loop. A reply longer than the pipe's buffer blocks its sender until the test reads it, and a test
often awaits a job of that rank before reading (``stream.finish()``, then the per-layer snapshots):
sent from the loop, the reply held the worker too, whose report of the job needs that loop. The
layered tests of ``test_tp_gpu.py`` hung so on the H200 (rank 1's part of the LOAD never
reported, 1 MiB and 9 MiB of snapshots); on CPU their snapshots were a few KiB.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from tp_helpers import CONFIG, SLOTS, RankProcesses, full_kv, new_pool, rank_kv

from aiokv.layout import KVLayout, TPSlice
from aiokv.tp import Direction, RankGroup

LAYOUT = KVLayout.mha(2, 4, 64, torch.float32, page_tokens=4)
TP = 2
ASYNC_RANK = 1
SEED = 17
START_S = 120.0
"""Bound on spawning rank processes and their first attach (torch import on a loaded machine)."""
JOB_S = 30.0
"""Bound on a two-page job once its layers may land (it takes milliseconds)."""


@pytest_asyncio.fixture
async def spawned() -> AsyncIterator[list[RankProcesses]]:
    groups: list[RankProcesses] = []
    yield groups
    for procs in groups:
        for gate in procs.gates.values():
            for _ in range(LAYOUT.num_layers):
                gate.release()  # whatever a failed test left gated
        await procs.kill_all()


def _slots_past_the_pipe_buffer() -> int:
    """KV slots per rank such that a dump of the buffer is 8 times what a pipe holds unread."""
    probe, other = socket.socketpair()  # what multiprocessing.Pipe() is made of
    with probe, other:
        held = probe.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    slot_bytes = rank_kv(full_kv(LAYOUT, SEED, 1), LAYOUT, ASYNC_RANK, TP).numel() * LAYOUT.itemsize
    return max(SLOTS, -(-8 * held // slot_bytes))


@pytest.mark.slow
@pytest.mark.asyncio
async def test_an_async_rank_reports_its_job_while_a_long_reply_waits_unread(
    tmp_path: Path, spawned: list[RankProcesses]
) -> None:
    slots = _slots_past_the_pipe_buffer()
    T = LAYOUT.page_tokens
    pool = await new_pool(LAYOUT.for_tp(TP), 4)
    try:
        async with RankGroup(LAYOUT, TP, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
            ranks = RankProcesses(group.address, LAYOUT, TP, SEED, True, slots, gated=True)
            spawned.append(ranks)
            ranks.start_all()
            async with asyncio.timeout(START_S):
                await group.wait_attached()
            gen = torch.Generator().manual_seed(3)
            pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(LAYOUT.dtype))
            pages, target = [2, 0], torch.arange(slots - 2 * T, slots)
            # Layered: every rank's copy waits at its gate before layer 0, so the job stays in
            # flight until the test lets the layers land.
            job = group.submit_nowait(group.spec(Direction.LOAD, pages, target, layered=True))
            # A short round trip first: it takes the rank's "started" off the pipe, so what the poll
            # below sees is the dump's first bytes (the buffer was read before any layer landed).
            assert (await ranks.ask(ASYNC_RANK, "stats")).attached
            ranks.send(ASYNC_RANK, "dump")
            conn = ranks.ctrl[ASYNC_RANK]
            assert await asyncio.to_thread(conn.poll, START_S), "the async rank never started its reply"
            for gate in ranks.gates.values():
                for _ in range(LAYOUT.num_layers):
                    gate.release()
            try:
                async with asyncio.timeout(JOB_S):
                    outcome = await job
            except TimeoutError:
                await ranks.kill_all()  # or the group's close waits for the job first
                pytest.fail(f"rank {ASYNC_RANK} never reported its job: its loop is held by a reply nobody reads")
            assert outcome.ok, outcome
            # The reply is the buffer as it was before the load (every layer was still gated).
            before = ranks.tensor(await ranks.reply(ASYNC_RANK))
            assert torch.equal(before, rank_kv(full_kv(LAYOUT, SEED, slots), LAYOUT, ASYNC_RANK, TP))
            part = TPSlice.of(LAYOUT, ASYNC_RANK, TP).part
            loaded = pool.pages[pages][:, part].transpose(0, 1).reshape(LAYOUT.num_layers, 2 * T, *before.shape[2:])
            assert torch.equal((await ranks.dump(ASYNC_RANK))[:, target], loaded)
            await ranks.stop_all()
            assert group.jobs.in_flight == 0
    finally:
        await pool.aclose()
