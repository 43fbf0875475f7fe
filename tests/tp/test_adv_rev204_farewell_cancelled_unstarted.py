"""Review 204: a loop-wide cancel landing on the farewell's task before its first step lost it.

ff8ca58 made the farewell (a connect, in a task of its own made by ``Cancels.outlast``) try again
within its deadline when a loop-wide cancel cuts its connect: the loop of tries ran inside that
task. A cancel requested before the task's first step (an application's shutdown step that cancels
every task, run in the loop turn after ``run()``'s ``finally`` made the task) is thrown into the
coroutine before any line of it runs: no try, no retry, the farewell lost, and the manager held the
rank while the process lived on (its jobs, the group's close waited).

A real rank process (tp_size 1): worker A on the main thread's ``asyncio.run`` (or ``uvloop.run``),
its socket shut down for real under a held copy (the manager holds the rank), its ``run()`` then
cancelled by the engine and the copy let go: its teardown owes the farewell. The application's
shutdown step (cancel every task but the main one) is queued by a loop task factory right before
the first task made after A's session ended (the farewell's), so it runs first in that turn.
Oracle: the manager frees A's rank while the process lives.
"""

from __future__ import annotations

import asyncio
import contextvars
import multiprocessing.connection
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from held_rank import Held
from loop_probes import until_thread
from shutdown_helpers import BOUND_S, RankChild, new_held, rank_child, sever_under_held_copy
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, T
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import RankGroup, RankWorker, TPConfig


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held,
               loop_kind: str) -> None:
    state: dict[str, Any] = {"armed": False, "shutdown_steps": 0, "cancelled_unstarted": 0}
    child = RankChild(ctrl, address, config, held, waits=("attached",), sets=("cancel",),
                      commands={"returned": lambda: dict(state) if child.events["returned"].wait(BOUND_S) else None})
    events = child.events
    events["returned"] = events["ended"]  # set once the loop ended (A's run() with it)
    session = RankWorker._session

    async def tracked_session(self: RankWorker) -> bool:
        try:
            return await session(self)
        finally:
            state["armed"] = True  # the next task made is run()'s farewell

    RankWorker._session = tracked_session  # type: ignore[method-assign]

    async def first() -> None:
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()

        def shutdown_step() -> None:  # the application's: cancel every task but main
            state["shutdown_steps"] += 1
            for task in asyncio.all_tasks(loop):
                if task is not main:
                    task.cancel()

        def factory(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any],
                    context: contextvars.Context | None = None) -> asyncio.Task[Any]:
            if state["armed"]:
                state["armed"] = False
                state["cancelled_unstarted"] += 1
                loop.call_soon(shutdown_step)  # queued before the new task's first step
            return asyncio.Task(coro, loop=loop, context=context)

        loop.set_task_factory(factory)  # type: ignore[arg-type]
        worker = RankWorker(address, 0, 1, MHA, child.kv, config)
        run = loop.create_task(worker.run())
        await worker.wait_attached()
        events["attached"].set()
        await asyncio.to_thread(events["cancel"].wait, BOUND_S)
        run.cancel()  # the engine cancels the worker's run: the teardown drains, then owes the farewell
        await asyncio.wait({run}, timeout=BOUND_S)

    child.start()
    child.run(first, loop_kind)
    child.finish()  # the process lives on: only a hello frees the manager's hold


@pytest.mark.asyncio
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
async def test_a_cancel_before_the_farewell_s_first_step_does_not_lose_it(
        tmp_path: Path, pool: PagePool, loop_kind: str) -> None:
    held = new_held()
    async with (RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group,
                rank_child(group, held, _rank_main, os.fspath(group.address), RANK_CONFIG, held, loop_kind) as link):
        await sever_under_held_copy(group, link, held, list(range(T)))
        assert await link.ask("cancel")
        held.release()
        state = await link.ask("returned")
        assert state is not None, "A's run() never ended"
        assert state["cancelled_unstarted"] == 1 and state["shutdown_steps"] == 1, state
        await until_thread(lambda: group.statistics().held_ranks == 0,
                           "the manager freeing A's rank (the farewell's hello)", 10.0)
