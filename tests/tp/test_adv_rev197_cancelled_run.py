"""Review 197: a rank whose connection was cut under a running copy, then whose worker's ``run()`` task
is cancelled (an engine's task group torn down, not ``aclose()``).

The manager holds such a rank (its copies may still run) until its process exits or says hello
again; a worker closed by ``aclose()`` says one farewell hello after its copies are over (review 196).
A worker whose ``run()`` was cancelled instead drained its copies and ended without it: the rank was
held until the process exited, and the job waited with it, and the group's close.

A real rank process (tp_size 1, async runner, ``run()`` as a task of the engine's loop), its copy held
in its mover, its socket shut down for real (``pidfd_getfd`` + ``shutdown``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing.connection
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from adv_helpers import sever_socket
from child_procs import end_child, fork_context
from held_rank import Held, _hold
from loop_probes import until_thread
from tp_helpers import CONFIG

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankStatus, RankWorker, TPConfig

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
SLOTS = 4 * T
BOUND_S = 60.0
NOTICE_S = 10.0
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)  # copies on the copy thread: the loop stays free


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held) -> None:
    """``"cancel"`` cancels the worker's run() task; the reply comes once it ended. The process lives on."""
    torch.set_num_threads(1)
    _hold(held)
    kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)

    async def main() -> None:
        worker = RankWorker(address, 0, 1, MHA, kv, config)
        run = asyncio.get_running_loop().create_task(worker.run())
        await asyncio.to_thread(ctrl.send, ("started", os.getpid()))
        while await asyncio.to_thread(ctrl.recv) == "cancel":
            run.cancel()
            await asyncio.wait({run})
            await asyncio.to_thread(ctrl.send, ("cancelled", run.cancelled()))

    asyncio.run(main())


@pytest.mark.asyncio
async def test_a_held_rank_whose_worker_run_is_cancelled_is_freed(tmp_path: Path, pool: PagePool) -> None:
    ctx = fork_context()
    held = Held(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("q", 0))
    async with RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_main, args=(child, os.fspath(group.address), RANK_CONFIG, held), daemon=True)
        proc.start()
        child.close()

        async def recv() -> Any:
            async with asyncio.timeout(BOUND_S):
                return await asyncio.to_thread(parent.recv)

        try:
            async with asyncio.timeout(BOUND_S * 2):
                assert (await recv())[0] == "started"
                await group.wait_attached()
            job = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.arange(T)))
            assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "the copy never began"
            try:
                assert sever_socket(proc.pid, os.fspath(group.address)) == 1
            except PermissionError as exc:
                pytest.skip(f"cannot take the rank's socket: {exc}")
            await until_thread(lambda: group.statistics().held_ranks == 1, "the rank held", BOUND_S)
            parent.send("cancel")  # the engine cancels the worker's task while the copy runs
            assert not job.done()  # held: the copy still runs
            held.release()
            assert await recv() == ("cancelled", True)
            done, _ = await asyncio.wait({asyncio.ensure_future(job.wait())}, timeout=NOTICE_S)
            assert done, f"the job still waits {NOTICE_S} s after the worker's run ended ({group.statistics()})"
            outcome = done.pop().result()
            assert held.finished_copies() == 1
            assert [(f.rank, f.status) for f in outcome.failures] == [(0, RankStatus.RANK_LOST)], outcome
            stats = group.statistics()
            assert stats.held_ranks == 0 and stats.jobs.in_flight == 0, stats
            assert proc.is_alive()
        finally:
            held.release(8)
            end_child(proc, 30)
