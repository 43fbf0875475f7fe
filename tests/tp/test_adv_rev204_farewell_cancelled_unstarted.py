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
import contextlib
import contextvars
import multiprocessing.connection
import os
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch
import uvloop
from child_procs import end_child, fork_context
from held_rank import Held, _hold
from loop_probes import until_thread
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, SLOTS, T, _sever
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankWorker, TPConfig

BOUND_S = 60.0


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held,
               loop_kind: str) -> None:
    torch.set_num_threads(1)
    _hold(held)
    kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)
    attached, cancel, returned, end = (threading.Event() for _ in range(4))
    state: dict[str, Any] = {"armed": False, "shutdown_steps": 0, "cancelled_unstarted": 0}
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
        worker = RankWorker(address, 0, 1, MHA, kv, config)
        run = loop.create_task(worker.run())
        await worker.wait_attached()
        attached.set()
        await asyncio.to_thread(cancel.wait, BOUND_S)
        run.cancel()  # the engine cancels the worker's run: the teardown drains, then owes the farewell
        await asyncio.wait({run}, timeout=BOUND_S)
        returned.set()

    def control() -> None:
        try:
            while True:
                command = ctrl.recv()
                reply: Any
                if command == "attached":
                    reply = attached.wait(BOUND_S)
                elif command == "cancel":
                    cancel.set()
                    reply = True
                elif command == "sever":
                    reply = _sever(address, set())
                elif command == "returned":
                    reply = dict(state) if returned.wait(BOUND_S) else None
                else:
                    break
                ctrl.send(reply)
        finally:
            end.set()

    threading.Thread(target=control, daemon=True).start()
    ctrl.send(("started", os.getpid()))
    with contextlib.suppress(asyncio.CancelledError):
        if loop_kind == "uvloop":
            uvloop.run(first())
        else:
            asyncio.run(first())
    end.wait(BOUND_S * 4)  # the process lives on: only a hello frees the manager's hold


@pytest.mark.asyncio
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
async def test_a_cancel_before_the_farewell_s_first_step_does_not_lose_it(
        tmp_path: Path, pool: PagePool, loop_kind: str) -> None:
    ctx = fork_context()
    held = Held(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("q", 0))
    async with RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_main, args=(child, os.fspath(group.address), RANK_CONFIG, held, loop_kind),
                           daemon=True)
        proc.start()
        child.close()

        async def ask(command: object) -> Any:
            parent.send(command)
            async with asyncio.timeout(BOUND_S + 5.0):
                return await asyncio.to_thread(parent.recv)

        try:
            async with asyncio.timeout(BOUND_S * 2):
                assert (await asyncio.to_thread(parent.recv))[0] == "started"
                assert await ask("attached")
                await group.wait_attached()
            group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(list(range(T)))))
            assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "A's copy never began"
            assert await ask("sever") == 1
            await until_thread(lambda: group.statistics().held_ranks == 1, "A's rank held", BOUND_S)
            assert await ask("cancel")
            held.release()
            state = await ask("returned")
            assert state is not None, "A's run() never ended"
            assert state["cancelled_unstarted"] == 1 and state["shutdown_steps"] == 1, state
            await until_thread(lambda: group.statistics().held_ranks == 0,
                               "the manager freeing A's rank (the farewell's hello)", 10.0)
        finally:
            held.release(8)
            with contextlib.suppress(Exception):
                parent.send("end")
            end_child(proc, 30)
