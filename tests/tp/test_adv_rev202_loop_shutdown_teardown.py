"""Review 202: a loop's shutdown (``asyncio.run`` ending) cut the steps of a worker's teardown.

Review 201 ran the drain and the executor's close again when their own task (``Cancels.outlast``)
ended cancelled: ``asyncio.run`` ending cancels every task left. The other steps were still cut:

- the wait for the manager's end of the link (after CLOSED): the session raised at once, the
  executor's close was skipped and the pool stayed mapped in the process;
- the unmap inside the executor's close (a ``to_thread`` task): the task ended cancelled while the
  thread unmapped, every later close raised that cancel at once, and the worker's teardown ran the
  close again for ever: ``asyncio.run`` never ended;
- the reclaim after the unmap (a ``to_thread`` task): the session raised before it noted that the
  manager may hold the rank (its socket cut): no farewell, the rank held while the process lived;
- the farewell hello itself: cut, so the rank stayed held, and the bridge's copy thread was left.

A real rank process (tp_size 1), worker A on the main thread's ``asyncio.run``; its ``run()`` is
cancelled and the main coroutine returns while the step is in progress (held by the test: the
manager's loop blocked, or a gate the step's thread or coroutine waits on). After ``asyncio.run``
the child reports its mappings (``/proc/self/maps``, ``/proc/self/fd``) and threads; the manager's
statistics tell whether it still holds the rank; the rank's KV bytes are the oracle for the copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing.connection
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from held_rank import Held
from loop_probes import until_spin, until_thread, waiting_in
from shutdown_helpers import BOUND_S, RankChild, new_held, rank_child, sever_under_held_copy
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, T
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import RankGroup, RankWorker, TPConfig
from aiokv.tp import worker as worker_module
from aiokv.tp.executor import RankExecutor
from aiokv.tp.wire import Hello

ENDED_S = 20.0  # asyncio.run's end after the step is let go (a teardown that spins never gets there)
STEPS = ["peer_end", "peer_end_never", "unmap", "reclaim", "farewell"]
NEVER_S = 2.0  # handshake_timeout_s of the peer_end_never case: the manager never ends the link


def _hold_step(step: str, entered: threading.Event, gate: threading.Event) -> None:
    """Hold ``step`` (the first time it runs) until ``gate``: ``entered`` is set once it waits."""
    if step == "unmap":
        teardown = RankExecutor._teardown

        def held_teardown(self: RankExecutor) -> None:  # on the loop's default executor
            entered.set()
            gate.wait(BOUND_S)
            teardown(self)

        RankExecutor._teardown = held_teardown  # type: ignore[method-assign]
    elif step == "reclaim":
        reclaim_left = worker_module._reclaim_left

        def held_reclaim(pool_name: str) -> None:
            entered.set()
            gate.wait(BOUND_S)
            reclaim_left(pool_name)

        worker_module._reclaim_left = held_reclaim
    elif step == "farewell":
        say_farewell = RankWorker._say_farewell

        async def held_farewell(self: RankWorker, hello: Hello) -> None:
            # A slow connect: the farewell's task waits here, not yet said.
            if not entered.is_set():
                entered.set()
                await asyncio.to_thread(gate.wait, BOUND_S)
            await say_farewell(self, hello)

        RankWorker._say_farewell = held_farewell  # type: ignore[method-assign]


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held,
               step: str, pool_name: str) -> None:
    entered, gate = threading.Event(), threading.Event()

    def ended() -> dict[str, Any] | None:
        gate.set()  # the held step goes on: asyncio.run may end now
        return dict(child.report) if child.events["ended"].wait(ENDED_S) else None

    child = RankChild(ctrl, address, config, held, waits=("attached", "returned"), sets=("go",),
                      commands={"ended": ended})
    child.on_end.append(gate.set)
    events = child.events
    _hold_step(step, entered, gate)
    returned_at: list[float] = []

    async def first() -> None:
        worker = RankWorker(address, 0, 1, MHA, child.kv, config)
        run = asyncio.get_running_loop().create_task(worker.run())
        await worker.wait_attached()
        events["attached"].set()
        await asyncio.to_thread(events["go"].wait, BOUND_S)
        run.cancel()
        if step.startswith("peer_end"):
            # CLOSED is out; the manager's loop is blocked by the test: the wait goes on.
            await until_spin(lambda: any(waiting_in(t, "wait_peer_end") for t in asyncio.all_tasks()),
                             "A's wait for the manager's end", BOUND_S)
        else:
            assert await asyncio.to_thread(entered.wait, BOUND_S), f"A's {step} never began"
        # Return: asyncio.run cancels every task left, the step's own among them.
        returned_at.append(time.monotonic())
        events["returned"].set()

    child.start()
    child.run(first)
    child.report["after_return_s"] = time.monotonic() - returned_at[0] if returned_at else None
    child.finish(pool_name)


@pytest.mark.asyncio
@pytest.mark.parametrize("step", STEPS)
async def test_a_loop_s_shutdown_does_not_cut_a_step_of_a_cancelled_worker_s_teardown(
        tmp_path: Path, pool: PagePool, step: str) -> None:
    pool.pages[0] = 3.0  # the page the load brings
    held = new_held()
    slots = list(range(T))
    config = RANK_CONFIG
    if step == "peer_end_never":
        config = dataclasses.replace(RANK_CONFIG, handshake_timeout_s=NEVER_S)
    async with (RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group,
                rank_child(group, held, _rank_main, os.fspath(group.address), config, held, step, pool.name) as link):
        load = None
        if step in ("reclaim", "farewell"):
            # The manager holds the rank for this process: its socket cut under a running copy.
            load = await sever_under_held_copy(group, link, held, slots)
            assert await link.ask("go")
            held.release()
            assert await link.ask("returned"), f"A's {step} never began"
        elif step.startswith("peer_end"):
            # The manager's loop blocked from the cancel until A's main coroutine returned
            # (peer_end_never: until asyncio.run ended there; the wait is bounded all the same).
            assert link.ask_blocking("go")
            assert link.ask_blocking("returned"), "A never waited for the manager's end"
        else:
            assert await link.ask("go")
            assert await link.ask("returned"), f"A's {step} never began"
        report = link.ask_blocking("ended") if step == "peer_end_never" else await link.ask("ended", ENDED_S)
        assert report is not None, f"asyncio.run did not end within {ENDED_S} s of A's {step} let go"
        if step == "peer_end_never":
            # One deadline for the wait's every run, then the farewell (a connect, not a reply).
            assert report["after_return_s"] < NEVER_S + 5.0, report["after_return_s"]
        assert not report["held"], f"the pool is still mapped after asyncio.run ended: {report['held']}"
        assert not report["threads"], f"threads left after asyncio.run ended: {report['threads']}"
        # The manager frees the rank: CLOSED read, or the farewell hello.
        await until_thread(lambda: group.statistics().held_ranks == 0, "the manager freeing A's rank", 10.0)
        if load is not None:
            async with asyncio.timeout(BOUND_S):
                await load.wait()
            assert held.finished_copies() == 1
            # The engine reuses the slots: no copy of A may land there any more.
            assert await link.ask(("write", slots, -7.0)) == "written"
            kv = torch.from_numpy(await link.ask("dump"))
            assert bool((kv[:, slots] == -7.0).all()), "a copy landed after the engine reused the slots"
