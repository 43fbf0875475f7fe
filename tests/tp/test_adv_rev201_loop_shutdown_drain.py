"""Review 201: a loop's shutdown (``asyncio.run`` ending) cancelled a closing session's drain.

A worker's ``run()`` cancelled drains its session's copies before it lets go of the rank's
per-process entry (no hello of this process may reach the manager while one of its copies runs).
The drain waits in a task of its own (``Cancels.outlast``); ``asyncio.run`` ending with that task
pending cancels every task left, that one too: the drain ended at once with the copy still running
on the copy thread, the rest of the teardown was skipped and the entry let go. A second worker of
the rank in the process (a thread runner started meanwhile) then said hello: the manager took it
for the end of the copies, the load failed, the engine reused its slots, and the copy landed in
them (wrong KV).

A real rank process (tp_size 1): worker A's loop is the main thread's ``asyncio.run``; its copy is
held, its ``run()`` cancelled, and the main coroutine returns while the session drains. Worker B
(thread runner) starts then. The oracle is on the rank's KV bytes.
"""

from __future__ import annotations

import asyncio
import multiprocessing.connection
import os
from pathlib import Path

import pytest
from held_rank import Held
from loop_probes import until_spin
from shutdown_helpers import BOUND_S, RankChild, assert_no_copy_after_reuse, new_held, rank_child
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, T
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import RankGroup, RankWorker, TPConfig


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held) -> None:
    child = RankChild(ctrl, address, config, held, waits=("attached", "returned"), sets=("cancel",))
    events = child.events

    async def first() -> None:
        worker = RankWorker(address, 0, 1, MHA, child.kv, config)
        run = asyncio.get_running_loop().create_task(worker.run())
        await worker.wait_attached()
        events["attached"].set()
        await asyncio.to_thread(events["cancel"].wait, BOUND_S)
        run.cancel()
        # The session's teardown began (its drain waits in a task of its own): return, and
        # asyncio.run cancels every task left.
        await until_spin(lambda: worker._epoch is None, "A's teardown", BOUND_S)
        events["returned"].set()

    child.start()
    child.run(first)
    child.finish()


@pytest.mark.asyncio
async def test_a_loop_s_shutdown_does_not_cut_the_drain_of_a_cancelled_worker(
        tmp_path: Path, pool: PagePool) -> None:
    pool.pages[0] = 3.0  # the page the load brings
    held = new_held()
    async with (RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group,
                rank_child(group, held, _rank_main, os.fspath(group.address), RANK_CONFIG, held) as link):
        await assert_no_copy_after_reuse(group, link, held, list(range(T)), "cancel", "A's teardown never began")
