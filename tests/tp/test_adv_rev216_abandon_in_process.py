"""Review 216: a worker that abandons its copies (806b949) closed its link under them.

806b949: a teardown cancelled while it waits for running copies gives them
``TPConfig.abandon_copies_s`` more, then abandons them to the process's exit. It closed the link
then, counting on the manager to hold the rank while the process lives: true only where the
manager watches the worker's process (a pidfd). A worker in the manager's own process (or one it
cannot watch) is not held: the connection's end failed the job (``RANK_LOST``) and handed its slots
and pages back while the abandoned copy still wrote them (wrong KV). Now the link stays open while
the abandoned copies run: their reports go out once they end (the loop still running), then it
closes; else the process's exit ends it. Likewise the worker's copy thread ends once they are over
(it was left running for the process's life: "aiokv threads still running as the run ends:
['aiokv-copy_0']" after every run of tests/tp).

A real group and worker on this loop, the worker's LOAD copy held on its copy thread (the CPU
mover wrapped as :mod:`held_rank` does), and the application's shutdown: every task but the
test's cancelled until the worker abandons the copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import threading
from pathlib import Path

import pytest
import torch
from held_rank import Held, _hold
from loop_probes import cancel_every_task_but_nowait, until_thread
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, SLOTS, T
from tp_helpers import CONFIG

from aiokv.kernels import mover
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankWorker

ABANDON_S = 0.2
BOUND_S = 20.0


def _copy_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("aiokv-copy") and t.is_alive()}


@pytest.mark.asyncio
async def test_an_abandoned_copy_keeps_its_job_in_flight_in_the_manager_s_own_process(
        tmp_path: Path, pool: PagePool) -> None:
    copy_threads = _copy_threads()  # another test's, if any: not this worker's
    held = Held(threading.Semaphore(0), threading.Semaphore(0), multiprocessing.Value("q", 0))
    originals = mover.HostGather.offload, mover.HostScatter.load
    _hold(held)
    try:
        config = dataclasses.replace(RANK_CONFIG, abandon_copies_s=ABANDON_S)
        kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)
        group = RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m")
        await group.start()
        worker = RankWorker(os.fspath(group.address), 0, 1, MHA, kv, config)

        async def serve() -> None:
            async with worker:
                await asyncio.Event().wait()

        serving = asyncio.ensure_future(serve())
        async with asyncio.timeout(BOUND_S):
            await group.wait_attached()
        load = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(list(range(T)))))
        at_end: list[int] = []  # the held copies finished when the job ended
        load.add_done_callback(lambda _: at_end.append(held.finished_copies()))
        assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "the copy never began"

        def shutdown() -> bool:  # cancels until one lands on the teardown's drain, then its bound
            cancel_every_task_but_nowait(asyncio.current_task())  # the application's SIGTERM handler
            return worker.statistics().copies_abandoned == 1

        await until_thread(shutdown, "the worker abandoning its held copy", BOUND_S)
        for _ in range(500):  # the link's end, were it closed, reaches the manager in a few turns
            assert not load.done(), "the job ended (its slots handed back) under the abandoned copy"
            await asyncio.sleep(0)
        assert held.finished_copies() == 0, "the held copy ended before the test let it"
        held.release()  # the copy ends: its report goes out, then the link closes
        async with asyncio.timeout(BOUND_S):
            await load.wait()
        assert at_end == [1], f"the job ended before the abandoned copy did ({at_end})"
        async with asyncio.timeout(BOUND_S):
            await asyncio.wait({serving})
        async with asyncio.timeout(BOUND_S):
            await group.aclose()
        # The abandoned copy over, the worker's copy thread ends too: it was left running for the
        # process's life (its bridge never closed; "aiokv-copy_0" still running as the run ended).
        await until_thread(lambda: _copy_threads() <= copy_threads, "the worker's copy thread ending", BOUND_S)
    finally:
        held.release(8)
        mover.HostGather.offload, mover.HostScatter.load = originals
